"""The kda target's decay: one per key channel (Kimi Delta Attention's ``Diag(α_t)``), a learnable low-rank
correction of the GDN block's per-head decay that is exactly zero at initialization.

The GDN block decays its state by ``α_t = exp(g_t)`` per KV head, ``g_t = f_g,t · log(1 − 1/t)`` with the
gate's factor ``f_g,t = exp(a_t)``, ``a_t = gate_proj(x_t)`` (zero init: the Taylor schedule ``α_t = 1 − 1/t``).
The kda block gives key channel ``i`` of head ``h`` its own

    g_t,hi = g_t,h · exp(δ_t,hi),   δ_t = W_up (W_down x_t) ∈ R^{H·K},   W_down: r × hidden,  W_up: H·K × r,

that is, the gate's logit becomes ``a_t,h + δ_t,hi`` (:class:`ChannelDecay` returns it; the block's
``correction_factors`` and the operator's ``scale_log_decay`` take it from there). ``exp(·) > 0`` and
``g_t ≤ 0`` keep every decay in (0, 1]. ``W_up`` starts at zero, so ``δ = 0`` exactly and ``a + 0`` is ``a`` to
the bit: every channel decays as its head does and the block computes what the gdn block computes (up to the
rounding of the per-channel operator's other summation order). Training moves ``W_up`` first — ``W_down``'s
gradient is zero while ``W_up`` is — then both. The correction reads the block's input, as KDA's own
low-rank gate does: ``H·K`` logits a token from ``r·(hidden + H·K)`` parameters.
"""

from __future__ import annotations

import torch
from torch import nn


class ChannelDecay(nn.Module):
    """``(B, T, H)`` gate logits → ``(B, T, H, K)`` per-channel ones, ``a + W_up W_down x`` (``W_up = 0`` at init).

    Example:
        >>> cd = ChannelDecay(hidden=32, num_kv_heads=2, head_dim=8, rank=4)
        >>> x, a = torch.randn(1, 5, 32), torch.randn(1, 5, 2)
        >>> out = cd(x, a)
        >>> out.shape, torch.equal(out, a[..., None].expand(1, 5, 2, 8))
        (torch.Size([1, 5, 2, 8]), True)
    """

    def __init__(self, hidden: int, num_kv_heads: int, head_dim: int, rank: int = 16, device=None, dtype=None):
        super().__init__()
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.down = nn.Linear(hidden, rank, bias=False, device=device, dtype=dtype)
        self.up = nn.Linear(rank, num_kv_heads * head_dim, bias=False, device=device, dtype=dtype)
        nn.init.zeros_(self.up.weight)  # δ = 0: the gdn block's decay in every channel

    def forward(self, hidden_states: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
        delta = self.up(self.down(hidden_states)).unflatten(-1, (self.num_kv_heads, self.head_dim))  # (B, T, H, K)
        return gate_logit[..., None] + delta
