"""The align stage's batched path: every converted layer's output before ``o_proj`` in one call.

The align stage runs every GDN block on the teacher's captured inputs. Layer by layer, Python and
kernel launches (about 25 per layer) cost more time than the GPU work, so
:func:`batched_attention_outputs` runs the blocks' heads side by side, as if one layer had all of
them. Training code only; the layer (:mod:`linearize.layers.gdn_attention`) knows nothing of it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers.gdn_attention import GDNAttention, fused_path
from ..layers.packing import flatten_rows, packed_cu_seqlens
from ..models.adapters import apply_rope, project_qkv
from ..ops import gated_delta_rule
from ..ops.taylor import correction_factors


def batched_attention_outputs(blocks: list[GDNAttention], hidden: list[torch.Tensor], position_embeddings,
                              position_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """Every block's :meth:`GDNAttention.attention_output` on its own input, stacked ``(B, T, block, Hq·D)``
    (block i is ``[:, :, i]``), in one front launch and one operator call: the blocks' heads side by
    side (each head's state and prefix means are its own, so the result is the same).

    Returns None where it does not apply — fewer than two blocks, or blocks that differ in head
    layout, scale, β bound, backend or dtype, or that are not on the fused path (:func:`fused_path`:
    the Triton front, on CUDA or with ``fused_front=True``) — and the caller runs the blocks one by one."""
    from ..ops.triton.front import taylor_front_triton

    if len(blocks) < 2 or not hidden:
        return None
    b0, h0 = blocks[0], hidden[0]
    same = ("head_dim", "num_heads", "num_kv_heads", "scaling")
    if (any(getattr(b, a) != getattr(b0, a) for b in blocks for a in same)
            or any(b.options.beta_max != b0.options.beta_max or b.options.backend != b0.options.backend for b in blocks)
            or any(h.shape != h0.shape or h.dtype != h0.dtype for h in hidden)
            or not all(fused_path(b.options, h) for b, h in zip(blocks, hidden))):
        return None
    B, T, _ = h0.shape
    cu = packed_cu_seqlens(position_ids) if position_ids is not None else None
    if cu is not None:  # packed documents: one flat row, documents given by cu (as attention_output does)
        hidden, position_embeddings = flatten_rows(hidden, position_embeddings)
    parts = [(*project_qkv(b, h, position_embeddings, with_v=False, rope=False)[:2], *v_beta_gate(b, h))
             for b, h in zip(blocks, hidden)]
    q, k, v, beta_logit, gate_logit = (torch.cat(x, dim=2) for x in zip(*parts))
    q, k = apply_rope(q, k, position_embeddings, fused=True)  # every layer's heads in one pass each way
    rho = torch.cat([b.rho.float() for b in blocks])
    beta_factor, gate_factor = correction_factors(beta_logit, gate_logit)
    kh, u, g, beta, v_mean = taylor_front_triton(k, v, rho, b0.options.beta_max, beta_factor=beta_factor, cu_seqlens=cu)
    o, _ = gated_delta_rule(q=q, k=kh, v=u, g=g * gate_factor, beta=beta, scale=b0.scaling, cu_seqlens=cu,
                            backend=b0.options.backend, v_offset=v_mean)
    # (B, T, layer, Hq·D). A caller that takes the blocks apart should use unbind, not o[:, :, i]: unbind's
    # backward stacks the layers' gradients in one pass, where 30 selects would each fill and add a
    # gradient of the full size
    return o.reshape(B, T, len(blocks), -1).to(h0.dtype)


def v_beta_gate(block: GDNAttention, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(v [B, T, H, D], β logit, gate logit)`` of one block: ``v_proj``, ``beta_proj`` and ``gate_proj`` as
    one GEMM on their stacked weights where all three are plain ``nn.Linear`` (or the trainer's float32
    parametrized ones; not LoRA-wrapped, quantized or hooked), so the input is read once and the two
    3-wide products are not GEMMs of their own, forward or backward; the outputs are views of the one
    product. Otherwise the three modules, one by one."""
    lins = (block.v_proj, block.beta_proj, block.gate_proj)
    B, T, _ = h.shape
    if not all(plain_linear(m) for m in lins):
        return block.v_proj(h).view(B, T, -1, block.head_dim), block.beta_proj(h), block.gate_proj(h)
    weights = [m.weight for m in lins]  # through float32_trainables' casts where the trainer set them
    bias = None
    if any(m.bias is not None for m in lins):
        bias = torch.cat([m.bias if m.bias is not None else w.new_zeros(w.shape[0]) for m, w in zip(lins, weights)])
    out = torch.nn.functional.linear(h, torch.cat(weights), bias)
    v, beta_logit, gate_logit = out.split([w.shape[0] for w in weights], dim=-1)
    return v.view(B, T, -1, block.head_dim), beta_logit, gate_logit


def plain_linear(m: nn.Module) -> bool:
    """Whether ``m`` computes ``x Wᵀ + b`` from its ``weight`` and ``bias``: ``nn.Linear`` itself, or with the
    trainer's float32 parametrization, and no hooks (a quantized subclass's weight is not its map)."""
    from torch.nn.utils import parametrize

    linear = type(m) is nn.Linear or (isinstance(m, nn.Linear) and parametrize.is_parametrized(m))
    return linear and not (m._forward_hooks or m._forward_pre_hooks)
