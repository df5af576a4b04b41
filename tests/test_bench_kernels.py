"""``scripts/bench_kernels.py``: what flash-linear-attention, the anchor of the kernel tables, is handed."""

from __future__ import annotations

import torch
from conftest import load_script


def test_fla_gets_the_tensors_themselves_with_one_query_head_per_kv_head():
    """At G = 1 fla's inputs are k, v, g and β as they are: a copy (``repeat_interleave(x, 1)`` makes one) would
    be timed as fla's. At G = 3 each KV head is repeated to its three query heads, in order."""
    repeat_kv = load_script("bench_kernels").repeat_kv
    x = torch.randn(2, 5, 2, 4)
    assert repeat_kv(1)(x) is x
    assert torch.equal(repeat_kv(3)(x), x[:, :, [0, 0, 0, 1, 1, 1]])
    g = torch.randn(2, 5, 2)  # a decay per head: [B, T, H]
    assert torch.equal(repeat_kv(3)(g), g[:, :, [0, 0, 0, 1, 1, 1]])
