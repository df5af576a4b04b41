"""The mix of a sink + sliding-window block's two parts as one Triton kernel (inference only).

:func:`linearize.ops.window.mix_by_mass` composed in PyTorch reads and writes ``(B, T, G·H, D)`` float32 tensors
about six times (the mean logit ``q·k̄`` as a batched GEMV, the share ``w``, ``w·o_exact``, ``o_old`` in float32,
``(1 − w)·o_old``, their sum) and then casts to the model's dtype: in a 32K × 16 prefill of SmolLM2-135M on an
H100, float32 element-wise work and 720 small GEMVs among the largest kernels. Here each row (a query head of
one token) reads its q, the mean key of its KV head, its two outputs, its count and normalizer once, and writes
the mixed output in the model's dtype:

    mean   = q · k̄_old                                    (the old tokens' mean logit)
    log Zo = log max(n, 1) + mean [+ ½·max(Σ(q·k)²/n − mean², 0)] [+ bias]
    w      = σ(lse_exact − log Zo)  where n > 0, else 1    (lse_exact = −inf read as 0, as the reference)
    o      = w·o_exact + (1 − w)·o_old

Rows are the flattened ``(B, T, G·H)``: row ``r`` is token ``r // (G·H)``, query head ``r % (G·H)``, and reads
the mean key row ``r // G`` of the flattened ``(B, T, H, D)`` (query head ``h·G + g`` shares KV head ``h``).
Float32 arithmetic throughout. Checked against the composed form in ``tests/test_mix_triton.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2

_TILE = 4096  # rows × padded D a program: 64 rows of D = 64, 16 of D = 256 (four such tiles in registers)


@triton.jit
def _mix_kernel(o_exact, lse, o_old, q, k_mean, count, bias, square_sum, out, R,
                HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_SQUARES: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = r < R
    o_d = tl.arange(0, BD)
    m = m_r[:, None] & (o_d < D)[None, :]
    at = r[:, None] * D + o_d[None, :]
    b_q = tl.load(q + at, mask=m, other=0.0).to(tl.float32)
    b_k = tl.load(k_mean + (r // G)[:, None] * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(b_q * b_k, axis=1)  # (BR,)
    n = tl.load(count + r // HQ, mask=m_r, other=0).to(tl.float32)
    n1 = tl.maximum(n, 1.0)
    log_z = tl.log(n1) + mean
    if HAS_SQUARES:
        s = tl.load(square_sum + r, mask=m_r, other=0.0).to(tl.float32)
        log_z += 0.5 * tl.maximum(s / n1 - mean * mean, 0.0)
    if HAS_BIAS:
        log_z += tl.load(bias + r % HQ, mask=m_r, other=0.0).to(tl.float32)
    b_l = tl.load(lse + r, mask=m_r, other=0.0).to(tl.float32)
    b_l = tl.where((b_l == b_l) & (tl.abs(b_l) < float("inf")), b_l, 0.0)  # a query seeing no key: 0
    w = tl.where(n > 0, tl.sigmoid(b_l - log_z), 1.0)[:, None]
    b_e = tl.load(o_exact + at, mask=m, other=0.0).to(tl.float32)
    b_o = tl.load(o_old + at, mask=m, other=0.0).to(tl.float32)
    tl.store(out + at, (w * b_e + (1.0 - w) * b_o).to(out.dtype.element_ty), mask=m)


def mix_by_mass_triton(o_exact: torch.Tensor, lse_exact: torch.Tensor, o_old: torch.Tensor, q: torch.Tensor,
                       k_mean_old: torch.Tensor, n_old: torch.Tensor, bias: torch.Tensor | None = None,
                       square_sum: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`linearize.ops.window.mix_by_mass` in one kernel; forward only (no autograd).

    Shapes as there: ``o_exact``, ``o_old``, ``q`` ``(B, T, G·H, D)`` (q scaled), ``lse_exact`` ``(B, T, G·H)``,
    ``k_mean_old`` ``(B, T, H, D)``, ``n_old`` ``(B, T)`` (any number type), ``bias`` ``(G·H,)``, ``square_sum``
    ``(B, T, G·H)``; fp16/bf16/fp32, each its own. Returns ``(B, T, G·H, D)`` in ``out_dtype`` (default
    ``lse_exact``'s dtype, as the reference returns)."""
    B, T, Hq, D = q.shape
    H = k_mean_old.shape[2]
    if Hq % H or k_mean_old.shape != (B, T, H, D) or o_exact.shape != q.shape or o_old.shape != q.shape \
            or lse_exact.shape != (B, T, Hq) or n_old.shape != (B, T):
        raise ValueError(f"mix_by_mass_triton: shapes q {tuple(q.shape)}, o_exact {tuple(o_exact.shape)}, o_old "
                         f"{tuple(o_old.shape)}, lse {tuple(lse_exact.shape)}, k_mean {tuple(k_mean_old.shape)}, "
                         f"n {tuple(n_old.shape)} do not fit (B, T, G·H, D) / (B, T, H, D)")
    out = torch.empty(q.shape, dtype=out_dtype or lse_exact.dtype, device=q.device)
    R = B * T * Hq
    if R == 0:
        return out
    c = lambda x: x.contiguous()  # noqa: E731  (views the model hands over are mostly contiguous already)
    sq = c(square_sum) if square_sum is not None else lse_exact
    b = c(bias) if bias is not None else lse_exact
    BD = next_pow2(D)
    BR = max(16, _TILE // BD)
    _mix_kernel[(cdiv(R, BR),)](c(o_exact), c(lse_exact), c(o_old), c(q), c(k_mean_old), c(n_old), b, sq, out, R,
                                HQ=Hq, G=Hq // H, D=D, BR=BR, BD=BD, HAS_BIAS=bias is not None,
                                HAS_SQUARES=square_sum is not None)
    return out
