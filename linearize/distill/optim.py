"""Each stage's optimizer (AdamW over its trainable parameters) and schedule (transformers' linear
warm-up then cosine to 10% of the peak)."""

from __future__ import annotations

import torch

from ..config import RecipeError

SOFTMAX_ATTN = "softmax_attn"  # the attention blocks a hybrid conversion kept softmax
NEW = "new"  # the parameters conversion added to the converted blocks (identity at init)
TEACHER_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")  # what a converted block reuses


def _softmax_attention(model) -> set[int]:
    """The ids of the parameters of the attention blocks left softmax (the layers a hybrid keeps)."""
    from ..layers import GDNAttention
    from ..models.adapters import decoder_layers

    return {id(p) for layer in decoder_layers(model) if not isinstance(layer.self_attn, GDNAttention)
            for p in layer.self_attn.parameters()}


def _new_parameters(model) -> set[int]:
    """The ids of the parameters conversion added: every parameter of a converted block but those of the
    teacher's projections and norms it reuses (ρ, β, the decay gates, the window's mix bias, the short
    convolution, the output gate, …), whatever their names."""
    from ..layers import GDNAttention
    from ..models.adapters import decoder_layers

    out = set()
    for layer in decoder_layers(model):
        attn = layer.self_attn
        if isinstance(attn, GDNAttention):
            reused = {id(p) for m in TEACHER_MODULES if getattr(attn, m, None) is not None
                      for p in getattr(attn, m).parameters()}
            out |= {id(p) for p in attn.parameters() if id(p) not in reused}
    return out


def trainable_names(model, stage) -> list[str]:
    """Parameters a stage trains. ``stage.trainable`` is comma-separated items: ``all``, a name substring
    (``self_attn``, ``mlp``, ``rho``), ``new`` (the parameters conversion added to the converted blocks,
    found by module rather than by name: a substring such as ``gate_proj`` also matches Gemma's and
    Llama's MLPs) or ``softmax_attn`` (the attention blocks a hybrid kept softmax); an item with a leading
    ``-`` removes what it matches from the others (``all,-softmax_attn``: every parameter but the kept
    softmax attention's)."""
    keys = [k.strip() for k in stage.trainable.split(",") if k.strip()]
    take, drop = [k for k in keys if not k.startswith("-")], [k[1:].strip() for k in keys if k.startswith("-")]
    sets = {SOFTMAX_ATTN: _softmax_attention, NEW: _new_parameters}
    sets = {k: find(model) for k, find in sets.items() if k in take + drop}

    def hit(key, name, p):
        return key == "all" or (id(p) in sets[key] if key in sets else key in name)

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
