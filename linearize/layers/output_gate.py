"""The output gate and per-head RMSNorm after the GDN operator (before ``o_proj``), as in Gated DeltaNet,
Qwen3-Next and fla's ``FusedRMSNormGated`` — but the identity at init, so a converted block still
computes its Taylor form exactly.

A plain RMSNorm is not the identity: it would rescale every head's output and break the match with the
teacher at init. So the normalized output is *mixed in* per head, ``y = o + λ·(RMSNorm(o)·w − o)``, with
``λ`` (``norm_mix``) starting at 0; training can move it towards 1, the normalized output GDN models
have (λ is not clamped). The gate is ``2·sigmoid(gate_proj(x))`` (fla uses ``silu``) from a zero
``gate_proj``, so it starts at exactly 1.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.common import compute_dtype

EPS = 1e-6


class OutputGate(nn.Module):
    """``forward(o, x)``: the gated, partly normalized operator output, ``[B, T, H·D]`` in ``o``'s dtype.

    Parameters: ``gate_proj`` (``nn.Linear(hidden_size, H·D)``, zero weight and bias), ``norm_weight``
    ``[H, D]`` (ones), ``norm_mix`` ``[H]`` (zeros, float32).

    >>> gate = OutputGate(hidden_size=8, num_heads=2, head_dim=3)
    >>> o = torch.randn(1, 4, 6)
    >>> torch.equal(gate(o, torch.randn(1, 4, 8)), o)
    True
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.gate_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=True, device=device, dtype=dtype)
        nn.init.zeros_(self.gate_proj.weight)
        nn.init.zeros_(self.gate_proj.bias)
        self.norm_weight = nn.Parameter(torch.ones(num_heads, head_dim, device=device, dtype=dtype))
        self.norm_mix = nn.Parameter(torch.zeros(num_heads, device=device, dtype=torch.float32))

    def forward(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o ``[B, T, H·D]``: the operator output; x ``[B, T, hidden]``: the block's input hidden states.
        Computes in float32 (float64 for a float64 ``o``); returns ``o``'s dtype."""
        H, D = self.num_heads, self.head_dim
        if o.dim() != 3 or o.shape[-1] != H * D:
            raise ValueError(f"OutputGate: o must be [B, T, {H * D}] (num_heads·head_dim), got {tuple(o.shape)}")
        if x.shape[:-1] != o.shape[:-1] or x.shape[-1] != self.gate_proj.in_features:
            raise ValueError(f"OutputGate: x must be [{o.shape[0]}, {o.shape[1]}, {self.gate_proj.in_features}]"
                             f" (B, T, hidden_size), got {tuple(x.shape)}")
        acc = compute_dtype(o.dtype)
        oh = o.to(acc).unflatten(-1, (H, D))  # (B, T, H, D)
        n = oh * torch.rsqrt(oh.pow(2).mean(-1, keepdim=True) + EPS) * self.norm_weight.to(acc)
        y = oh + self.norm_mix.to(acc)[:, None] * (n - oh)  # λ=0: oh exactly
        g = self.gate_proj(x.to(self.gate_proj.weight.dtype)).to(acc)  # (B, T, H·D)
        gate = 2 * torch.sigmoid(g)  # exactly 1 at init
        return (y.flatten(-2) * gate).to(o.dtype)
