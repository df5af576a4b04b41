"""``torch.autograd.Function`` around the Triton forward and backward kernels."""

from __future__ import annotations

import torch

from .chunk_bwd import chunk_gated_delta_rule_bwd
from .chunk_fwd import chunk_gated_delta_rule_fwd

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens):
        o, ht, tm = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, tm)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        # of the forward's intermediates only T is kept; the backward launcher recomputes the others
        q, k, v, g, beta, h0, cu_seqlens, tm = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(q, k, v, g, beta, ctx.scale, h0, do, dht, cu_seqlens, tm)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None


def chunk_gated_delta_rule_triton(
    q, k, v, g, beta, *, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None
):
    """Triton chunkwise GDN; same contract as :func:`linearize.ops.gated_delta_rule`."""
    if q.dtype not in DTYPES:
        raise ValueError(f"the Triton backend takes {', '.join(map(str, DTYPES))}; got {q.dtype} (use backend='torch')")
    o, ht = ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, float(scale), output_final_state, cu_seqlens)
    return o, ht
