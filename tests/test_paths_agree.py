"""Differential checks: a converted model's logits are one function of the tokens, whatever path computes them.

The reference is one forward call without a cache; against it, in float64 (where the paths differ only by float64
rounding), the same tokens prefilled in chunks cut across the window, sink and sparse-cache boundaries, then decoded
one token at a time on the same cache, and a left-padded batch whose rows must each give what they give alone. The
block's new parameters are moved off their identity initialization first, so that every one of them acts. Each
configuration mixes options the way a recipe would; the prompts repeat tokens (equal inputs, tied cache scores).
"""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import linearize
from linearize.calibration import NEW_PARAMETERS
from linearize.compat import cache_kwargs
from linearize.layers import GDNOptions

CONFIGS = {
    "taylor": dict(family="llama"),
    "window-cache": dict(family="llama", window=3, sinks=2, sparse_cache=2),
    "window-cache-conv-gate": dict(family="qwen3", window=4, sinks=1, sparse_cache=3, short_conv=3, output_gate=True),
    "deltanet-window": dict(family="mistral", to="deltanet", window=2, sinks=0),
    "kda-window-cache": dict(family="llama", to="kda", window=3, sinks=1, sparse_cache=2, decay_rank=2),
    "gemma-hybrid-cache": dict(family="gemma3_text", window=3, sinks=2, sparse_cache=4, keep_softmax=[1]),
    "mix2-write-gate": dict(family="qwen2", window=2, sinks=1, mix_order=2, write_gate=True),
}


def converted(family, to="gdn", keep_softmax=None, **options):
    teacher = tiny_model(family)
    calib = torch.randint(1, teacher.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    model = linearize.convert(teacher, to=to, calibration_ids=calib, keep_softmax=keep_softmax,
                              options=GDNOptions(**options))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(NEW_PARAMETERS) and not name.endswith("rho"):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.double().eval()


def prompt(vocab: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, vocab, (n,), generator=g)
    x[5:8] = x[2]  # a repeated token, and a run of one
    return x


@torch.no_grad()
def by_parts(model, x, cuts, mask=None):
    """Logits of ``x`` ``(B, T)`` fed in the parts ``cuts`` delimit, on one cache."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = None if mask is None else (mask.cumsum(-1) - 1).clamp_min(0)
    out = []
    for a, b in zip([0, *cuts], [*cuts, x.shape[1]]):
        kw = {} if mask is None else {"attention_mask": mask[:, :b], "position_ids": pos[:, a:b]}
        out.append(model(x[:, a:b], **cache_kwargs(cache), use_cache=True, **kw).logits)
    return torch.cat(out, 1)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool((a - b).abs().max() <= 1e-10 * b.abs().max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunks_steps_and_padded_rows_give_one_calls_logits(name):
    model = converted(**CONFIGS[name])
    vocab = model.config.vocab_size
    x = prompt(vocab, 23, seed=len(name))[None]
    with torch.no_grad():
        whole = model(x, use_cache=False).logits
    for cuts in ([7], [1, 2, 3, 9, 16], list(range(10, 23))):  # then a token at a time past the window and cache
        assert close(by_parts(model, x, cuts), whole), cuts
    # a left-padded batch: each row as it is alone (positions from the mask), in one call and prefilled then stepped
    rows = [prompt(vocab, n, seed=n) for n in (17, 9)]
    batch = torch.zeros(2, 17, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, r in enumerate(rows):
        batch[i, 17 - len(r):], mask[i, 17 - len(r):] = r, 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        one = model(batch, attention_mask=mask, position_ids=pos, use_cache=False).logits
        alone = [model(r[None], use_cache=False).logits[0] for r in rows]
    stepped = by_parts(model, batch, list(range(12, 17)), mask)
    for i, r in enumerate(rows):
        for got in (one, stepped):
            assert close(got[i, 17 - len(r):], alone[i]), (name, i)
