"""``linearize distill``: the recipe runner. setup → evaluate at init → train (stages) → save → cleanup.

Under ``torchrun`` the global batch is split across processes (``parallel: ddp`` or ``fsdp``, see
``parallel.py``). Checkpoints and the saved model hold whole tensors.
"""

from __future__ import annotations

import json

from ..config import RecipeConfig
from ..saving import write_atomic
from .evaluation import evaluate
from .export import save_student
from .parallel import barrier, is_main
from .setup import cleanup, setup
from .stages import train


def budget(cfg: RecipeConfig) -> dict:
    """Steps and tokens of each stage and in all."""
    from ..config import stage_seq_len

    tokens = [s.steps * s.batch_size * stage_seq_len(cfg, s) for s in cfg.stages]
    return {"stages": [{"name": s.name, "steps": s.steps, "seq_len": stage_seq_len(cfg, s), "tokens": t}
                       for s, t in zip(cfg.stages, tokens)],
            "total_steps": sum(s.steps for s in cfg.stages), "total_tokens": sum(tokens)}


def initial_evaluation(run, resume: bool) -> dict | None:
    """The student at init beside the teacher (``initial_eval.json``; a resumed run reads it back)."""
    path = run.out / "initial_eval.json"
    if resume and path.is_file():
        return json.loads(path.read_text())
    # a fresh run, or one killed before its first evaluation was written: the student is still at init here
    initial = evaluate(run)
    if is_main():
        write_atomic(path, json.dumps(initial, indent=1))
    return initial


def run_recipe(cfg: RecipeConfig, resume: bool = False, progress=None) -> dict:
    """Run a recipe; returns ``{initial, final, model, budget}``."""
    run = setup(cfg, resume)
    try:
        initial = initial_evaluation(run, resume)
        final = train(run, resume, progress)
        if is_main() or run.fsdp:  # FSDP: every process takes part in gathering the model
            save_student(run, final, initial)
        barrier()
    finally:
        cleanup(run)
    return {"initial": initial, "final": final, "model": str(run.out / "model"), "budget": budget(cfg)}
