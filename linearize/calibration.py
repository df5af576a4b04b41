"""Fitting a converted block's own parameters at conversion, on the calibration text, against the teacher.

``convert(..., calibration_steps=N)`` runs N full-batch Adam steps per converted layer on the parameters
the block adds — ρ, the β and decay corrections, the mix's per-head bias, the output gate and short
convolution where the block has them — minimizing the normalized squared error of the block's output
(before ``o_proj``) against the teacher's attention output on the same calibration rows, the block fed
the teacher's own input (as the align stage does, but on a few hundred tokens and no training data).
The teacher's weights the block reuses stay frozen and unchanged.
"""

from __future__ import annotations

import torch

# the parameters a converted block adds (everything else in it is the teacher's)
NEW_PARAMETERS = ("rho", "gate_proj.weight", "gate_proj.bias", "beta_proj.weight", "beta_proj.bias", "q_conv", "k_conv",
                  "v_conv", "mix_bias", "out_gate.gate_proj.weight", "out_gate.gate_proj.bias", "out_gate.norm_weight",
                  "out_gate.norm_mix", "channel_gate_proj.down.weight", "channel_gate_proj.up.weight",
                  "write_gate.weight", "write_gate.bias")


def fit_block(block: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings, target: torch.Tensor,
              steps: int, lr: float = 1e-3) -> dict:
    """``steps`` Adam steps on ``block``'s new parameters, keeping the best point seen (so the error on these
    rows never rises above the initialization's); returns the normalized error before and after.

    ``hidden_states`` ``(B, T, hidden)`` and ``position_embeddings``: the teacher's attention input;
    ``target`` ``(B, T, Hq·D)``: its attention output before ``o_proj``."""
    named = dict(block.named_parameters())
    new = [p for n, p in named.items() if n.endswith(NEW_PARAMETERS)]
    frozen = {n: p.requires_grad for n, p in named.items() if not n.endswith(NEW_PARAMETERS)}
    for n in frozen:
        named[n].requires_grad_(False)
    ref = target.detach().float()
    denom = ref.pow(2).sum().clamp_min(1e-30)

    def error() -> torch.Tensor:
        return (block.attention_output(hidden_states, position_embeddings).float() - ref).pow(2).sum() / denom

    opt = torch.optim.Adam(new, lr=lr)
    try:
        with torch.enable_grad():
            for i in range(steps + 1):  # the error at the start of each step, and after the last one
                loss = error()
                if i == 0:
                    before = best = loss.item()
                    kept = [p.detach().clone() for p in new]
                elif loss.item() < best:
                    best, kept = loss.item(), [p.detach().clone() for p in new]
                if i == steps:
                    break
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        with torch.no_grad():  # keep the best point seen: never worse than the initialization here
            for p, k in zip(new, kept):
                p.copy_(k)
    finally:
        for n, flag in frozen.items():
            named[n].requires_grad_(flag)
        for p in new:
            p.grad = None
    return {"before": before, "after": best}
