"""What a run records: ``metrics.jsonl`` (one JSON record per logged step), TensorBoard scalars, and
``losses.png`` (one panel per stage, held-out perplexity of student and teacher beside them)."""

from __future__ import annotations

import json
from pathlib import Path

METRICS = "metrics.jsonl"


def read_metrics(out: Path) -> list[dict]:
    """The records of ``metrics.jsonl``; a torn last line (a kill mid-write) is skipped."""
    p = out / METRICS
    if not p.is_file():
        return []
    recs = []
    for line in p.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            recs.append(rec)
    return recs


def truncate_metrics(out: Path, step: int) -> None:
    """After a resume from ``step``, keep only the records up to it (drops what the killed run wrote past
    its last checkpoint, and any torn line)."""
    from ..saving import write_atomic

    if (out / METRICS).is_file():
        keep = [r for r in read_metrics(out) if r["step"] <= step]
        write_atomic(out / METRICS, "".join(json.dumps(r) + "\n" for r in keep))


class MetricLogger:
    """Appends records to ``metrics.jsonl`` and scalars to TensorBoard (where the package is installed)."""

    def __init__(self, out: Path):
        self.out = out
        self.writer = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(out / "tensorboard"))
        except ImportError:
            pass

    def log(self, record: dict) -> None:
        with open(self.out / METRICS, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is None:
            return
        for key, value in record.items():
            if isinstance(value, (int, float)) and key not in ("step", "stage_step"):
                self.writer.add_scalar(key if key.startswith("eval_") else f"{record['stage']}/{key}", value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def plot_losses(out: Path) -> None:
    """``losses.png``: a panel per stage (its loss against the global step, log scale), and a panel of
    held-out perplexity (student and teacher) at every evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(out)
    if not recs:
        return
    stages = list(dict.fromkeys(r["stage"] for r in recs))
    evals = [r for r in recs if "eval_ppl_student" in r]
    fig, axes = plt.subplots(1, len(stages) + 1, figsize=(4.5 * (len(stages) + 1), 3.8), squeeze=False)
    label = {"align": "attention-output loss (per-layer mean)", "distill": "KL(teacher ‖ student)"}
    for ax, stage in zip(axes[0], stages):
        rs = [r for r in recs if r["stage"] == stage]
        ax.plot([r["step"] for r in rs], [r["loss"] for r in rs])
        ax.set(title=f"{stage} stage", xlabel="step", ylabel=label.get(stage, "loss"), yscale="log")
        ax.grid(alpha=0.3)
    ax = axes[0][-1]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_ppl_student"] for r in evals], "o-", label="student")
        ax.plot([r["step"] for r in evals], [r["eval_ppl_teacher"] for r in evals], "--", label="teacher")
        far = [r for r in evals if "eval_ppl_student_far" in r]
        if far:  # the predictions with 512+ tokens of their document before them
            ax.plot([r["step"] for r in far], [r["eval_ppl_student_far"] for r in far], "o-", label="student, past 512")
            ax.plot([r["step"] for r in far], [r["eval_ppl_teacher_far"] for r in far], ":", label="teacher, past 512")
        ax.legend()
    ax.set(title="held-out perplexity", xlabel="step", ylabel="perplexity", yscale="log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "losses.png", dpi=110)
    plt.close(fig)
