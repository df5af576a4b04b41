"""The align stage's loss terms in one pass each way: per row, ``Σ (o − r)²`` and ``Σ r²`` in float32.

``o`` is the GDN blocks' output, ``(B, T, L, D)`` (L layers side by side, as the batched align path makes
it, or L = 1), and ``r`` the teacher's captured output of each layer, L tensors ``(B, T, D)``. In PyTorch
the same sums cost a float32 copy of ``o``, a float32 difference and a norm per layer, and the backward
four more passes; here the forward reads ``o`` and ``r`` once and writes ``(B, ·)`` partial sums, the
backward reads them once and writes ``2 g (o − r)`` straight into the one ``(B, T, L, D)`` gradient.
Measured on the H200 with the fused RoPE (``rope.py``): the align step's kernels 130.5 → 108.4 ms over 5 steps (results/ab_align.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.common import cdiv

BLOCK_T = 32
BLOCK_D = 64


@triton.jit
def _sums_kernel(o, r, sse, rsq, T, so_b, so_t, sr_b, sr_t, NB,
                 D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Per (row, block of BLOCK_T tokens): partial ``Σ (o − r)²`` and ``Σ r²`` to ``sse/rsq[row, block]``."""
    i_b, i_t = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    acc_e = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    acc_r = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    p_o = o + i_b.to(tl.int64) * so_b + o_t[:, None].to(tl.int64) * so_t
    p_r = r + i_b.to(tl.int64) * sr_b + o_t[:, None].to(tl.int64) * sr_t
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m = m_t[:, None] & (o_d < D)[None, :]
        b_r = tl.load(p_r + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        b_e = tl.load(p_o + o_d[None, :], mask=m, other=0.0).to(tl.float32) - b_r
        acc_e += b_e * b_e
        acc_r += b_r * b_r
    tl.store(sse + i_b * NB + i_t, tl.sum(tl.sum(acc_e, axis=1), axis=0))
    tl.store(rsq + i_b * NB + i_t, tl.sum(tl.sum(acc_r, axis=1), axis=0))


@triton.jit
def _grad_kernel(o, r, g, do, T, so_b, so_t, sr_b, sr_t, sd_b, sd_t,
                 D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """``do = 2 g_row (o − r)``, in do's dtype."""
    i_b, i_t = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BLOCK_T + tl.arange(0, BLOCK_T)
    m_t = o_t < T
    two_g = 2.0 * tl.load(g + i_b).to(tl.float32)
    p_o = o + i_b.to(tl.int64) * so_b + o_t[:, None].to(tl.int64) * so_t
    p_r = r + i_b.to(tl.int64) * sr_b + o_t[:, None].to(tl.int64) * sr_t
    p_d = do + i_b.to(tl.int64) * sd_b + o_t[:, None].to(tl.int64) * sd_t
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m = m_t[:, None] & (o_d < D)[None, :]
        b_e = tl.load(p_o + o_d[None, :], mask=m, other=0.0).to(tl.float32) - tl.load(
            p_r + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(p_d + o_d[None, :], (two_g * b_e).to(do.dtype.element_ty), mask=m)


def _check(o: torch.Tensor, refs: list[torch.Tensor]) -> None:
    B, T, L, D = o.shape
    if len(refs) != L or any(r.shape != (B, T, D) for r in refs):
        raise ValueError(f"row_squared_errors: o is {tuple(o.shape)}, so refs must be {L} tensors of {(B, T, D)}")
    if o.stride(3) != 1:
        raise ValueError("row_squared_errors: the last dimension of o must be contiguous")


class RowSquaredErrors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, *refs):
        refs = tuple(r if r.stride(-1) == 1 else r.contiguous() for r in refs)
        _check(o, list(refs))
        B, T, L, D = o.shape
        NB = cdiv(T, BLOCK_T)
        sse = torch.empty(L, B, NB, dtype=torch.float32, device=o.device)
        rsq = torch.empty(L, B, NB, dtype=torch.float32, device=o.device)
        for i, r in enumerate(refs):
            ol = o[:, :, i]
            if B * NB:
                _sums_kernel[(B, NB)](ol, r, sse[i], rsq[i], T, ol.stride(0), ol.stride(1), r.stride(0), r.stride(1), NB,
                                      D=D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=4)
        ctx.save_for_backward(o, *refs)
        sse, rsq = sse.sum(2), rsq.sum(2)
        ctx.mark_non_differentiable(rsq)
        return sse, rsq

    @staticmethod
    def backward(ctx, g_sse, _g_rsq):
        o, *refs = ctx.saved_tensors
        B, T, L, D = o.shape
        NB = cdiv(T, BLOCK_T)
        do = torch.empty(o.shape, dtype=o.dtype, device=o.device)  # (B, T, L, D), contiguous
        g_sse = g_sse.float().contiguous()
        for i, r in enumerate(refs):
            ol, dl = o[:, :, i], do[:, :, i]
            if B * NB:
                _grad_kernel[(B, NB)](ol, r, g_sse[i], dl, T, ol.stride(0), ol.stride(1), r.stride(0), r.stride(1),
                                      dl.stride(0), dl.stride(1), D=D, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=4)
        return (do, *[None] * len(refs))


def row_squared_errors(o: torch.Tensor, refs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_row (o_l − r_l)², Σ_row r_l²)``, both ``(L, B)`` float32, for ``o`` ``(B, T, L, D)`` and ``refs``
    L tensors ``(B, T, D)`` (no gradient to them); the first is differentiable in ``o``."""
    return RowSquaredErrors.apply(o, *refs)
