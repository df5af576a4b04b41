"""Each stage's optimizer (AdamW over its trainable parameters) and schedule (transformers' linear
warm-up then cosine to 10% of the peak)."""

from __future__ import annotations

import torch

from ..config import RecipeError

SOFTMAX_ATTN = "softmax_attn"  # the attention blocks a hybrid conversion kept softmax


def _softmax_attention(model) -> set[int]:
    """The ids of the parameters of the attention blocks left softmax (the layers a hybrid keeps)."""
    from ..layers import GDNAttention
    from ..models.adapters import decoder_layers

    return {id(p) for layer in decoder_layers(model) if not isinstance(layer.self_attn, GDNAttention)
            for p in layer.self_attn.parameters()}


def trainable_names(model, stage) -> list[str]:
    """Parameters a stage trains. ``stage.trainable`` is comma-separated items: ``all``, a name substring
    (``self_attn``, ``mlp``, ``rho``), or ``softmax_attn`` (the attention blocks a hybrid kept softmax); an
    item with a leading ``-`` removes what it matches from the others (``all,-softmax_attn``: every
    parameter but the kept softmax attention's)."""
    keys = [k.strip() for k in stage.trainable.split(",") if k.strip()]
    take, drop = [k for k in keys if not k.startswith("-")], [k[1:].strip() for k in keys if k.startswith("-")]
    soft = _softmax_attention(model) if SOFTMAX_ATTN in take + drop else set()

    def hit(key, name, p):
        return key == "all" or (id(p) in soft if key == SOFTMAX_ATTN else key in name)

    names = [n for n, p in model.named_parameters()
             if any(hit(k, n, p) for k in take) and not any(hit(k, n, p) for k in drop)]
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
