"""``torch.autograd.Function`` around the Triton forward and backward kernels."""

from __future__ import annotations

import torch

from ..common import TRITON_DTYPES, wants_grad
from .chunk_bwd import chunk_gated_delta_rule_bwd
from .chunk_fwd import Kept, chunk_gated_delta_rule_fwd

# keep the forward's W, g cumsum, states and Δ for the backward (``chunk_fwd.Kept``) rather than compute them
# again there: more memory held between the two, two launches fewer in the backward. On an H100 (bf16, 16 heads
# of 128) forward+backward 1.91 → 1.64 / 2.20 → 1.86 / 4.39 → 3.65 ms at 2×8192 / 1×16384 / 1×32768 for GDN,
# 1.70 → 1.41 / 1.93 → 1.62 / 3.81 → 3.13 for DeltaNet, one call's peak lower too (934 vs 998 MiB at 2×8192):
# results/ab_gdn_keep_forward_h100/
KEEP_FORWARD = True


class ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens, v_offset=None,
                keep=False):
        o, ht, tm, *kept = chunk_gated_delta_rule_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=scale,
                                                      initial_state=initial_state,
                                                      output_final_state=output_final_state,
                                                      cu_seqlens=cu_seqlens, v_offset=v_offset, keep=keep)
        # T always (the solve is the costly part); the rest only with KEEP_FORWARD, else the backward recomputes it
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, tm, *(kept[0] if kept else ()))
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu_seqlens, tm, *kept = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(q=q, k=k, v=v, g=g, beta=beta, scale=ctx.scale,
                                                                initial_state=h0, do=do, dht=dht,
                                                                cu_seqlens=cu_seqlens, tm=tm,
                                                                kept=Kept(*kept) if kept else None)
        dvo = None
        if ctx.needs_input_grad[9]:  # o = … + v_offset of the KV head, read by its G query heads
            B, T, HQ, V = do.shape
            H = v.shape[2]
            dvo = do.reshape(B, T, H, HQ // H, V).sum(3, dtype=torch.float32)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, dvo, None


def chunk_gated_delta_rule_triton(
    q, k, v, g, beta, *, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None, v_offset=None
):
    """Triton chunkwise GDN; same contract as :func:`linearize.ops.gated_delta_rule` (g None: no decay), plus
    ``v_offset`` (``[B, T, H, V]``, float32, or None): added to the output of every query head of its KV head
    before the output's one rounding — ``taylor_back(o, v_offset)`` fused into the output kernel."""
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"the Triton backend takes {', '.join(map(str, TRITON_DTYPES))}; got {q.dtype} (use backend='torch')")
    if v_offset is not None and v_offset.shape != v.shape:
        raise ValueError(f"v_offset must be shaped like v {tuple(v.shape)}; got {tuple(v_offset.shape)}")
    # kept only where autograd will differentiate this call (not under no_grad, not without a leaf to differentiate)
    keep = KEEP_FORWARD and wants_grad(q, k, v, g, beta, initial_state, v_offset)
    o, ht = ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, float(scale),
                                      output_final_state, cu_seqlens, v_offset, keep)
    return o, ht
