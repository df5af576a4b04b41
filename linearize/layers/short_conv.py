"""The optional short causal convolution on q, k and v (``GDNOptions.short_conv``), as in Mamba, GDN and
fla's ``ShortConvolution``: each channel of a projection's output mixes in its previous K-1 tokens, so a
block can be sharp and local like a softmax previous-token head.

The weights are depthwise, ``[C, K]`` (tap ``K-1`` is the token itself), and start at the identity
(last tap 1, the others 0), so a converted block computes the Taylor form exactly at init. Taps never
reach across a document start (packed documents) nor into padding (zeroed before the convolution);
decoding carries the last K-1 inputs of each sequence (a fixed size) in the cache.
"""

from __future__ import annotations

import torch

from ..ops.common import compute_dtype

CONV_NAMES = ("q_conv", "k_conv", "v_conv")
KERNEL_SIZES = range(2, 9)  # GDNOptions.short_conv: 0 (off) or one of these


def identity_weight(channels: int, kernel: int, device=None, dtype=None) -> torch.Tensor:
    """``[C, K]`` depthwise taps of the identity map: the last tap (the token itself) 1, the others 0."""
    w = torch.zeros(channels, kernel, device=device, dtype=dtype)
    w[:, -1] = 1
    return w


def since_document_start(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """``(1, n)`` long: how many tokens before each of the ``n`` flattened tokens belong to its document
    (0 at a document start), from the document offsets ``cu_seqlens`` (``[0, …, n]``)."""
    t = torch.arange(n, device=cu_seqlens.device)
    start = cu_seqlens[torch.searchsorted(cu_seqlens, t, right=True) - 1]
    return (t - start)[None]


def causal_conv(x: torch.Tensor, weight: torch.Tensor, since_start: torch.Tensor | None = None,
                past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``y[t] = Σ_s weight[:, K-1-s] · x[t-s]`` over ``s = 0..K-1``: a causal depthwise convolution.

    x ``[B, T, C]``; weight ``[C, K]``; past ``[B, K-1, C]``: the inputs just before ``x`` (None: a
    sequence start, zeros); since_start ``(B, T)``: tokens since each token's document start — a tap
    ``s > since_start[t]`` reaches before it and contributes zero. Accumulates in float32 (float64 for a
    float64 x) as a sum of shifted elementwise products, so the identity taps return x bit for bit.
    Returns ``(y [B, T, C] in x's dtype, the last K-1 inputs [B, K-1, C])`` — the next call's ``past``.

    >>> x = torch.arange(4.0).view(1, 4, 1)
    >>> causal_conv(x, torch.tensor([[1.0, 1.0]]))[0].flatten().tolist()
    [0.0, 1.0, 3.0, 5.0]
    """
    B, T, C = x.shape
    K = weight.shape[1]
    if past is None:
        past = x.new_zeros(B, K - 1, C)
    full = torch.cat([past.to(x.dtype), x], 1)  # (B, K-1+T, C)
    acc = compute_dtype(x.dtype)
    fa, w = full.to(acc), weight.to(acc)
    y = fa[:, K - 1:] * w[:, K - 1]
    for s in range(1, K):
        term = fa[:, K - 1 - s: K - 1 - s + T] * w[:, K - 1 - s]  # x[t-s], a view of the padded input
        if since_start is not None:
            term = term * (since_start >= s)[..., None]
        y = y + term
    return y.to(x.dtype), full[:, T:]


def conv_qkv(block: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
             mask: torch.Tensor | None = None, since_start: torch.Tensor | None = None,
             past: tuple[torch.Tensor, ...] | None = None):
    """``(q, k, v, tails)``: the block's ``q_conv/k_conv/v_conv`` on the projections' outputs ``[B, T, H, D]``
    (v may be None). ``mask`` ``(B, T)`` bool: padding (False) is zeroed first, so no tap reads it.
    ``past``/``tails``: the last K-1 inputs of q, k, v ``[B, K-1, H·D]`` before and after this call."""
    out, tails = [], []
    for i, (name, x) in enumerate(zip(CONV_NAMES, (q, k, v))):
        if x is None:
            out.append(None)
            continue
        B, T = x.shape[:2]
        flat = x.reshape(B, T, -1)  # (B, T, H·D)
        if mask is not None:
            flat = flat * mask[..., None].to(flat.dtype)
        y, tail = causal_conv(flat, getattr(block, name), since_start, None if past is None else past[i])
        out.append(y.view_as(x))
        tails.append(tail)
    return (*out, tails)
