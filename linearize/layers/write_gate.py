"""A learnable strength on what the Taylor-GDN writes into its state (``GDNOptions.write_gate``).

In the stable Taylor form a token's write into the state is ``β u k̂ᵀ = ‖k̃‖ ṽ k̂ᵀ / t`` whatever β, ρ and the
β correction are (they set only how much of the state along ``k̂`` is erased): the first-order expansion
of softmax gives each of ``t`` tokens a weight ``≈ 1/t``. A read can then never single out one token
written long ago — what retrieving a passkey needs, and what softmax does when ``q·k`` stands out. The
gate scales the written value by ``exp(w_h · v_t + b_h)``, one scalar per KV head read off the value of
the token being written (for the sink + window block, the token leaving the window: its value is what
the window kept, so a decode step has it), so training can write a token as strongly as it needs.
``w`` and ``b`` start at zero: the factor is 1 and the block is the Taylor form exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.common import compute_dtype


class WriteGate(nn.Module):
    """``exp(w_h · v + b_h)`` per KV head ``h``: ``(B, T, H, D)`` values → ``(B, T, H)`` factors, float32
    (float64 for float64 values)."""

    def __init__(self, num_kv_heads: int, head_dim: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_kv_heads, head_dim, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(num_kv_heads, dtype=torch.float32, device=device))

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        dt = compute_dtype(v.dtype)
        logit = torch.einsum("bthd,hd->bth", v.to(dt), self.weight.to(dt)) + self.bias.to(dt)
        return torch.exp(logit)
