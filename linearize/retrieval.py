"""Which layers retrieve from far back: the induction probe that ranks layers for ``--keep-softmax N:induction``.

A converted block keeps its window and sinks exact, but it represents the softmax over older tokens to first
order, which cannot be sharp: a head that finds one token far back and copies what followed it (an induction
or retrieval head: Olsson et al. 2022; Wu et al. 2024) loses what it found. A hybrid that keeps a few layers
softmax should keep the layers that hold such heads. :func:`induction_scores` finds them without any task
text: on rows of random tokens repeated once, a token of the second copy that attends to the token after its
earlier occurrence — ``length`` positions back, far outside any window — is retrieving. A layer's score is its
best head's (one head serves the layer).
"""

from __future__ import annotations

import torch

PROBE_ROWS = 2
PROBE_LENGTH = 512  # tokens of random text, then the same again: every retrieval is 512 positions back


@torch.no_grad()
def induction_scores(model, rows: int = PROBE_ROWS, length: int = PROBE_LENGTH, seed: int = 0,
                     layers: list[int] | None = None) -> torch.Tensor:
    """``(layers, q_heads)`` float64: per softmax layer and query head, the mean attention mass a token of the
    second copy puts on the token after its earlier occurrence. ``model``: the softmax teacher (its attention
    recomputed from its own q and k, after RoPE); ``layers``: these only (default every layer), in that order."""
    from .eval import attention_modules, capture_attention

    mods = attention_modules(model)
    layers = list(range(len(mods))) if layers is None else list(layers)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    half = torch.randint(min(100, vocab // 2), vocab, (rows, length), generator=g)  # past the special tokens
    ids = torch.cat([half, half], dim=1).to(device)
    caps = capture_attention(model, ids, layers)
    t = torch.arange(length, ids.shape[1] - 1, device=device)  # queries of the second copy (its last has no next)
    target = t - length + 1  # the token after the earlier occurrence of token t
    out = []
    for i in layers:
        p = attention_rows(mods[i], caps[i], t)  # (rows, H, G, queries, T)
        mass = p.gather(-1, target.view(1, 1, 1, -1, 1).expand(*p.shape[:-1], 1))[..., 0]
        out.append(mass.mean(dim=(0, 3)).flatten())
    return torch.stack(out)


def attention_rows(module, capture, t: torch.Tensor) -> torch.Tensor:
    """``(B, H, G, len(t), T)`` float64: the softmax attention of the queries at positions ``t`` of a teacher's
    attention ``module``, recomputed from its own q and k (after RoPE) on its captured input
    (:func:`linearize.eval.capture_attention`): causal, and a local layer (Gemma 3) sees its window only."""
    from .models.adapters import project_qkv

    q, k, _ = project_qkv(module, capture.hidden_states, capture.position_embeddings, with_v=False)
    B, T, Hq, D = q.shape
    H = k.shape[2]
    qq = q[:, t].double().view(B, len(t), H, Hq // H, D)
    logits = torch.einsum("bqhgd,bshd->bhgqs", qq, k.double()) * float(module.scaling)
    s = torch.arange(T, device=q.device)[None]
    hidden = s > t[:, None]
    if getattr(module, "sliding_window", None):
        hidden = hidden | (s <= t[:, None] - module.sliding_window)
    return logits.masked_fill(hidden, float("-inf")).softmax(-1)


def retrieval_layers(model, candidates: list[int], count: int) -> list[int]:
    """The ``count`` layers of ``candidates`` whose best head scores highest on :func:`induction_scores`, sorted."""
    scores = induction_scores(model, layers=candidates).max(-1).values
    ranked = sorted(range(len(candidates)), key=lambda j: -float(scores[j]))
    return sorted(candidates[j] for j in ranked[:count])
