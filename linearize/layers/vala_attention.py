"""The ``linear`` target: VaLA attention (seed 000, eq. va-la), a drop-in for a transformers attention module.

A :class:`~linearize.layers.gdn_attention.GDNAttention` in everything but the recurrence — the teacher's
``q_proj/k_proj/v_proj/o_proj``, norms and RoPE reused as they are, the optional short convolution and
output gate, the decoding state ``(S, Σk, Σv, t)`` in the model's ``Cache``, packed documents, padding —
so the toolkit (convert, save/load, distill, generate) treats it as one. In place of the Taylor-GDN it
runs the first-order linear attention of :mod:`linearize.ops.vala`:

    S_t = α_t S_{t−1} + (1/t)(v_t − v̄_{t−1})(k_t − k̄_t)ᵀ,   α_t = (1 − 1/t)^{exp(a_t)},   o_t = v̄_t + S_t q_t

with ``q`` carrying the softmax scale and one state per KV head read by its G query heads. Its one new
parameter is ``gate_proj`` (``a_t = w·x_t + b``, zero init): at initialization the block is eq. va-la exactly.
There is no ρ or β: the write is the equation's own ``1/t``. No sink/window form (``GDNOptions`` refuses
``window``/``sinks`` for this target). On CUDA the operator runs its Triton forward and backward kernels;
the CPU trains through the chunkwise PyTorch form.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.common import compute_dtype
from ..ops.linear import linear_attention
from ..ops.vala import vala_front, vala_step_
from .gdn_attention import GDNAttention
from .paths import operator_dtype


class VaLAAttention(GDNAttention):
    """VaLA attention initialized from a softmax attention module's weights (``GDNOptions.target="linear"``)."""

    fused_step = False  # no fused Triton step: decode steps run vala_step_

    def _add_corrections(self, hidden: int, p: torch.Tensor) -> None:
        self.gate_proj = nn.Linear(hidden, self.num_kv_heads, device=p.device, dtype=p.dtype)
        nn.init.zeros_(self.gate_proj.weight)
        nn.init.zeros_(self.gate_proj.bias)

    @torch.no_grad()
    def calibrate(self, hidden_states: torch.Tensor, position_embeddings) -> None:
        """Nothing to calibrate: VaLA has no ρ (and the block has no window whose mix could be fitted)."""

    def _attend(self, hidden_states, position_embeddings, mask, initial=None, h0=None, output_final_state=False,
                cu_seqlens=None, conv_past=None):
        """``(o (B, T, Hq·D), state, sums, conv_tails)``: a fresh sequence, or one continuing from the cache's
        ``initial`` sums and ``h0`` state (one token: an in-place step of both)."""
        B, T, _ = hidden_states.shape
        q, k, v, tails = self.project(hidden_states, position_embeddings, mask, cu_seqlens, conv_past=conv_past)
        dt = compute_dtype(q.dtype)
        q, k, v = q.to(dt) * self.scaling, k.to(dt), v.to(dt)
        gate_factor = torch.exp(self.gate_proj(hidden_states).to(dt))  # (B, T, H): 1 at init
        if T == 1 and h0 is not None:  # one decode step: a rank-1 update and a mat-vec per KV head
            o = vala_step_(q[:, 0], k[:, 0], v[:, 0], h0, initial, gate_factor[:, 0],
                           mask=None if mask is None else mask[:, 0])
            return o.reshape(B, 1, -1).to(hidden_states.dtype), h0, initial, tails
        front = vala_front(k, v, cu_seqlens=cu_seqlens, mask=mask, initial=initial, gate_factor=gate_factor)
        # the front in float32 (prefix sums over long documents); the operator in the model's own precision, as
        # the softmax attention it replaces; g and w stay float32
        cdt = operator_dtype(hidden_states.dtype, dt)
        o, state = linear_attention(q.to(cdt), front.k.to(cdt), front.v.to(cdt), front.g, front.w, initial_state=h0,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                    backend=self.options.backend, v_offset=front.v_mean)  # (B, T, Hq, V)
        return o.reshape(B, T, -1).to(hidden_states.dtype), state, front.sums, tails
