"""``torch.autograd.Function`` around the Triton forward."""

from __future__ import annotations

import torch

from ..chunk import gated_delta_rule_chunk
from .chunk_fwd import chunk_gated_delta_rule_fwd

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens):
        o, ht = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale = scale
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        # recompute through the chunkwise PyTorch form and differentiate it (fp32 inside)
        q, k, v, g, beta, h0, cu_seqlens = ctx.saved_tensors
        inputs = [x.detach().requires_grad_(x.requires_grad) if x is not None else None for x in (q, k, v, g, beta, h0)]
        with torch.enable_grad():
            o, ht = gated_delta_rule_chunk(
                *inputs[:5], scale=ctx.scale, initial_state=inputs[5], output_final_state=dht is not None,
                cu_seqlens=cu_seqlens,
            )
            outs, grads = [o], [do]
            if dht is not None:
                outs.append(ht)
                grads.append(dht)
            wrt = [x for x in inputs if x is not None and x.requires_grad]
            got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True)) if wrt else iter(())
        dx = [next(got) if x is not None and x.requires_grad else None for x in inputs]
        return (*dx, None, None, None)


def chunk_gated_delta_rule_triton(
    q, k, v, g, beta, *, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None
):
    """Triton chunkwise GDN; same contract as :func:`linearize.ops.gated_delta_rule`."""
    if q.dtype not in DTYPES:
        raise ValueError(f"the Triton backend takes {', '.join(map(str, DTYPES))}; got {q.dtype} (use backend='torch')")
    o, ht = ChunkGatedDeltaRule.apply(q, k, v, g, beta, initial_state, float(scale), output_final_state, cu_seqlens)
    return o, ht
