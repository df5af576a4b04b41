"""Training converted models: data (datasets, packing), losses, the recipe runner with checkpoints."""

from .trainer import TrainingError, budget, run_recipe

__all__ = ["TrainingError", "budget", "run_recipe"]
