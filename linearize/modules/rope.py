"""Rotary position embedding (RoPE) of a ``(B, T, H, D)`` tensor in one Triton pass each way.

transformers' ``apply_rotary_pos_emb`` computes ``x·cos + rotate_half(x)·sin`` in five elementwise
launches forward (one a concatenation) and more backward, each a full pass over q or k; at training
shapes those passes cost more GPU time than the GDN operator. Here, with ``x = (x₁, x₂)`` split in halves:

    forward   y₁ = x₁c₁ − x₂s₁            y₂ = x₂c₂ + x₁s₂
    backward  dx₁ = dy₁c₁ + dy₂s₂         dx₂ = dy₂c₂ − dy₁s₁      (rotate_half transposed)

in float32, one program per (token, block of up to ``2048 // D`` heads). ``cos``/``sin`` are the model's position
embeddings, ``(B, T, D)`` or ``(1, T, D)``; they take no gradient (they are functions of the positions).
``tests/test_triton.py`` checks it against transformers' function in float64 under ``TRITON_INTERPRET=1``.
Measured on the H200 with the fewer-pass align loss (``rowsq.py``): the align step's kernels 130.5 → 108.4 ms over 5 steps (results/ab_align.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.common import cdiv, next_pow2


@triton.jit
def _rope_kernel(x, cos, sin, y, T, cos_batch_stride, H: tl.constexpr, HALF: tl.constexpr, BH: tl.constexpr,
                 BACKWARD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # token index in the flattened (B·T)
    c_row = (row // T) * cos_batch_stride + (row % T) * (2 * HALF)
    o_d = tl.arange(0, HALF)
    o_h = tl.program_id(1) * BH + tl.arange(0, BH)
    m = (o_h < H)[:, None]
    p1 = row * H * 2 * HALF + o_h[:, None] * (2 * HALF) + o_d[None, :]
    x1 = tl.load(x + p1, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x + p1 + HALF, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(cos + c_row + o_d).to(tl.float32)[None, :]
    c2 = tl.load(cos + c_row + HALF + o_d).to(tl.float32)[None, :]
    s1 = tl.load(sin + c_row + o_d).to(tl.float32)[None, :]
    s2 = tl.load(sin + c_row + HALF + o_d).to(tl.float32)[None, :]
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y + p1, y1.to(y.dtype.element_ty), mask=m)
    tl.store(y + p1 + HALF, y2.to(y.dtype.element_ty), mask=m)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    B, T, H, D = x.shape
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        BH = min(next_pow2(H), max(1, 2048 // D))  # many heads (every layer's, side by side): blocks
        _rope_kernel[(B * T, cdiv(H, BH))](x, cos, sin, y, T, 0 if cos.shape[0] == 1 else T * D, H=H,
                                           HALF=D // 2, BH=BH, BACKWARD=backward,
                                           num_warps=1 if BH * D <= 1024 else 4)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy, cos, sin, backward=True), None, None


def rope_usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether :func:`apply_rope_triton` covers this call: full-width rotation of an even power-of-two
    head size, position embeddings of one row or one per batch row, no gradient into them."""
    B, T, H, D = x.shape
    return (cos.dim() == 3 and cos.shape[-1] == D and cos.shape[1] == T and cos.shape[0] in (1, B)
            and D >= 2 and D & (D - 1) == 0 and not cos.requires_grad)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x·cos + rotate_half(x)·sin`` for ``x`` of ``(B, T, H, D)`` and ``cos``/``sin`` of ``(B or 1, T, D)``,
    in ``x``'s dtype (float32 inside); differentiable in ``x``."""
    cos, sin = cos.to(x.dtype).contiguous(), sin.to(x.dtype).contiguous()
    return _Rope.apply(x, cos, sin)
