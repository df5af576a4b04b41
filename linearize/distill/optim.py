"""Each stage's optimizer (AdamW over its trainable parameters) and schedule (transformers' linear
warm-up then cosine to 10% of the peak)."""

from __future__ import annotations

import torch

from ..config import RecipeError


def trainable_names(model, stage) -> list[str]:
    """Parameters a stage trains: ``stage.trainable`` is comma-separated name substrings, or ``all``."""
    keys = [k.strip() for k in stage.trainable.split(",") if k.strip()]
    names = [n for n, _ in model.named_parameters() if keys == ["all"] or any(k in n for k in keys)]
    if not names:
        raise RecipeError(f"stage {stage.name}: trainable={stage.trainable!r} matches no parameter of the student")
    return names


def make_optimizer(model, stage, optim_cfg, fsdp: bool):
    """``(optimizer, scheduler, names)``; outside FSDP only ``names`` keep ``requires_grad``."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    names = trainable_names(model, stage)
    params = dict(model.named_parameters())
    if not fsdp:  # under FSDP every stage's parameters keep requires_grad (see setup)
        model.requires_grad_(False)
        for n in names:
            params[n].requires_grad_(True)
    opt = torch.optim.AdamW([params[n] for n in names], lr=stage.lr, weight_decay=optim_cfg.weight_decay)
    sched = get_cosine_with_min_lr_schedule_with_warmup(
        opt, num_warmup_steps=optim_cfg.warmup_steps, num_training_steps=stage.steps, min_lr_rate=0.1)
    return opt, sched, names
