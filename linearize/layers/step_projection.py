"""A decode step's five projections of one GDN block — q, k, v, the β factor's and the decay's logits —
as one matrix product over their weights stacked, where the step would otherwise launch five.

The stacked weights are a copy, kept on the block and refreshed whenever a source weight changed (moved,
reloaded, or trained in place: a tensor's version counter), so a step never reads stale weights; a CUDA
graph that recorded the product reads the copy's memory, which :func:`refresh` updates in place before
the graph replays. Writes that bypass the version counter (``weight.data += …``) need :func:`forget`.
Only plain ``nn.Linear`` projections are stacked (a LoRA-wrapped one keeps the block's own path)."""

from __future__ import annotations

import torch
from torch import nn


def _sources(attn) -> list[nn.Linear] | None:
    if getattr(attn, "beta_proj", None) is None:  # a block without the β factor (VaLA) steps its own way
        return None
    mods = [attn.q_proj, attn.k_proj, attn.v_proj, attn.beta_proj] + ([attn.gate_proj] if attn.decays else [])
    return mods if all(type(m) is nn.Linear for m in mods) else None


def forget(model) -> None:
    """Drop every block's stacked copy, to be rebuilt from the weights on the next step: for writes the
    version counters do not see (``weight.data += …``, as peft's merge does)."""
    for module in model.modules():
        module.__dict__.pop("_stacked", None)


@torch.compiler.disable  # host-side bookkeeping (pointers, version counters): run eagerly inside a compiled step
def refresh(attn) -> dict | None:
    """The block's stacked weights, built or brought up to date with its projections (None where they
    cannot be stacked)."""
    mods = _sources(attn)
    if mods is None:
        return None
    w0 = mods[0].weight
    sizes = [m.out_features for m in mods]
    stamp = tuple((m.weight.data_ptr(), m.weight._version, None if m.bias is None else (m.bias.data_ptr(),
                   m.bias._version)) for m in mods)
    kept = attn.__dict__.get("_stacked")
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, writable in and out of inference mode
        if kept is None or kept["weight"].shape != (sum(sizes), w0.shape[1]) or kept["weight"].dtype != w0.dtype \
                or kept["weight"].device != w0.device:
            kept = attn.__dict__["_stacked"] = {"weight": w0.new_empty(sum(sizes), w0.shape[1]),
                                                "bias": w0.new_zeros(sum(sizes)), "sizes": sizes, "stamp": None}
        if kept["stamp"] != stamp:
            torch.cat([m.weight for m in mods], out=kept["weight"])
            torch.cat([m.bias if m.bias is not None else w0.new_zeros(m.out_features) for m in mods],
                      out=kept["bias"])
            kept["stamp"] = stamp
    return kept


def step_projections(attn, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """``(q, k, v, β logit, decay logit)`` of ``hidden_states [B, T, hidden]`` through one product, q/k/v as
    ``[B, T, H·D]`` (the decay logit 0 for a block without a decay); None where the weights cannot be stacked
    or autograd is recording (training keeps the block's own path)."""
    if torch.is_grad_enabled():
        return None
    kept = refresh(attn)
    if kept is None:
        return None
    parts = torch.nn.functional.linear(hidden_states, kept["weight"], kept["bias"]).split(kept["sizes"], -1)
    return parts if attn.decays else (*parts, torch.zeros_like(parts[3]))
