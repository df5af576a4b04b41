"""Training converted models against their teacher: ``linearize distill RECIPE.yaml``.

The recipe runner (``recipe.py``) only orchestrates; each concern has its module: ``setup`` (device,
seed, teacher and student), ``parallel`` (processes, DDP, FSDP2), ``precision`` (float32 masters),
``lora``, ``data`` and ``batches`` (what each step reads), ``losses`` and ``align`` (the objectives),
``optim`` (optimizer and schedule), ``stages`` (the training loop), ``checkpoint``, ``rundir`` (lock,
stale files), ``metrics`` (jsonl, TensorBoard, plots), ``evaluation``, ``export`` (the saved model).
"""

from .parallel import world
from .recipe import budget, run_recipe
from .stages import TrainingError, TrainingInterrupted

__all__ = ["TrainingError", "TrainingInterrupted", "budget", "run_recipe", "world"]
