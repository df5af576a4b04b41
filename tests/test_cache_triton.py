"""The Triton forward of the sparse cache's softmax (ops/triton/cache_fwd.py) against
:func:`linearize.ops.sparse_cache.cache_softmax` in float64 on the same rounded inputs (itself checked against
a dense per-query selection in tests/test_sparse_cache.py): under the Triton interpreter on the CPU (fp32,
fp16: the interpreter's bf16 dots are wrong), and compiled on a CUDA GPU (``-m gpu``). Candidates as a
decoder's continuation lays them out: ``prior`` carried slots (some empty), then one stream token a query
(some without a token: padding, the window not yet full)."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_interpreter

from linearize.ops.sparse_cache import CacheBuffers, cache_softmax, cached_cache
from linearize.ops.triton.cache_fwd import cache_softmax_triton

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
CASES = [  # (B, T, H, G, D, prior, size, block)
    (2, 37, 2, 3, 16, 5, 5, 8),  # several blocks, a partial last one
    (1, 50, 1, 2, 64, 12, 12, 16),
    (2, 40, 3, 1, 32, 0, 7, 7),  # nothing carried: the first block's queries see fewer than size
    (2, 23, 2, 3, 48, 9, 9, None),  # one block (the default: 256 or size)
    (1, 30, 1, 2, 256, 4, 4, 10),  # the widest heads
]


def case_id(c) -> str:
    return "x".join(map(str, c[:5])) + f"-p{c[5]}-c{c[6]}-b{c[7]}"


def cache_args(B, T, H, G, D, prior, size, seed=0):
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = rn(B, T, G * H, D) * 0.5 + 0.1 * rn(1, 1, G * H, D)
    k, v = rn(B, prior + T, H, D) + 0.3 * rn(1, 1, H, D), rn(B, prior + T, H, D)
    key = rn(B, prior + T, H).double()
    key[:, : prior // 2] = float("-inf")  # empty carried slots
    key[-1, : prior + 1] = float("-inf")  # the last row's first query keeps nothing
    key[0, prior + T // 3: prior + T // 2] = float("-inf")  # stream steps that write nothing
    return q, k, v, key


def check(dtype, device, B, T, H, G, D, prior, size, block, seed=0) -> tuple[float, float]:
    q, k, v, key = (x.to(dtype) if x.dtype != torch.float64 else x for x in cache_args(B, T, H, G, D, prior, size, seed))
    o_ref, lse_ref = cache_softmax(q.double(), k.double(), v.double(), key, prior, size, block=block)
    o, lse = cache_softmax_triton(*(x.to(device) for x in (q, k, v, key)), prior, size, block=block)
    assert o.dtype == lse.dtype == torch.float32 and o.shape == (B, T, G * H, D) and lse.shape == (B, T, G * H)
    o, lse = o.double().cpu(), lse.double().cpu()
    seen = torch.isfinite(lse_ref)
    assert not seen.all() and seen.any(), "some query must keep nothing"
    assert torch.isfinite(o).all()
    assert torch.equal(torch.isfinite(lse), seen) and (o[~seen] == 0).all()
    errors = ((o - o_ref).norm() / o_ref.norm()).item(), ((lse - lse_ref)[seen].norm() / lse_ref[seen].norm()).item()
    assert max(errors) <= TOL[dtype], errors
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_cache_triton_interpreted_equals_reference(dtype, case, poisoned):
    needs_interpreter()
    check(dtype, "cpu", *case)


def test_cached_cache_on_the_kernel_equals_the_dense_form():
    """A decoder's prefill after a first chunk: the same outputs and the same buffers after, kernel or not."""
    needs_interpreter()
    B, T, H, G, D, W, C = 2, 45, 2, 3, 16, 8, 6
    q, old_k, old_v, _ = cache_args(B, T, H, G, D, 0, C, seed=1)
    g = torch.Generator().manual_seed(2)
    past = CacheBuffers.empty(old_k, C, W)
    past.key[:, : C - 2] = torch.randn(B, C - 2, H, generator=g).double()  # two slots still empty
    past.k.copy_(torch.randn(past.k.shape, generator=g))
    past.win_key.copy_(torch.randn(past.win_key.shape, generator=g).double())
    old_ok = torch.ones(B, T, dtype=torch.bool)
    old_ok[1, :5] = False
    token_key = torch.randn(B, T, H, generator=g)
    with torch.no_grad():
        dense = cached_cache(q, old_k, old_v, old_ok, token_key, past, W, C, backend="torch")
        fused = cached_cache(q, old_k, old_v, old_ok, token_key, past, W, C, backend="triton")
    assert (dense[0] - fused[0]).abs().max() < 1e-5 and torch.equal(torch.isfinite(dense[1]), torch.isfinite(fused[1]))
    fin = torch.isfinite(dense[1])
    assert (dense[1][fin] - fused[1][fin]).abs().max() < 1e-5
    for a, b in zip(dense[2].tensors(), fused[2].tensors()):
        assert torch.equal(a, b)


def check_thresholds(device, B, T, H, G, D, prior, size, block, seed=0):
    """Every block's thresholds from the kernel equal the PyTorch count's, bit for bit, and so do the pools."""
    from linearize.ops.sparse_cache import _pooled_blocks
    from linearize.ops.triton.cache_fwd import block_thresholds

    key = cache_args(B, T, H, G, D, prior, size, seed)[3].to(device)
    torch_form = list(_pooled_blocks(key, prior, size, None, None, block, kept=False))
    kernel = list(_pooled_blocks(key, prior, size, None, None, block, kept=False, thresholds=block_thresholds))
    assert len(kernel) == len(torch_form) > 0
    for (t0, t1, idx, thr, _), (u0, u1, jdx, want, _) in zip(kernel, torch_form):
        assert (t0, t1) == (u0, u1) and torch.equal(idx, jdx) and thr.shape == want.shape
        assert torch.equal(thr.cpu(), want.cpu())
    assert any(torch.isfinite(b[3]).any() for b in torch_form) and any((~torch.isfinite(b[3])).any() for b in torch_form)


@pytest.mark.parametrize("case", CASES + [(2, 300, 2, 1, 8, 100, 100, 128), (1, 200, 3, 1, 8, 0, 40, 70)], ids=case_id)
def test_threshold_kernel_interpreted_equals_the_count(case, poisoned):
    """The selection's thresholds through the kernel (several tiles of queries and of pool entries, carried entries
    some empty, stream steps that write nothing) against the PyTorch form's count."""
    needs_interpreter()
    check_thresholds("cpu", *case)


GPU_CASES = CASES + [
    (2, 4096, 3, 3, 64, 1024, 1024, None),  # SmolLM2's heads, the recipe's cache, blocks of 2,048
    (1, 5000, 1, 4, 128, 256, 256, None),
    (4, 700, 2, 7, 80, 64, 64, 256),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_cache_triton_gpu_equals_reference(dtype, case, compiled):
    check(dtype, "cuda", *case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_threshold_kernel_gpu_equals_the_count(case, compiled):
    check_thresholds("cuda", *case)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_fresh_prefill_skipping_the_empty_slots_equals_reading_them(backend):
    """``fresh=True`` (a decoder's first chunk) leaves the empty past out of the softmax: same outputs, same buffers."""
    if backend == "triton":
        needs_interpreter()
    B, T, H, G, D, W, C = 2, 30, 2, 2, 16, 8, 12  # T - W < C: some slots stay empty after
    q, old_k, old_v, _ = cache_args(B, T, H, G, D, 0, C, seed=3)
    old_ok = torch.arange(T)[None].expand(B, T) >= W  # the window not yet full: nothing leaves it
    token_key = torch.randn(B, T, H, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        runs = [cached_cache(q, old_k, old_v, old_ok, token_key, CacheBuffers.empty(old_k, C, W), W, C, backend=backend,
                             fresh=fresh) for fresh in (False, True)]
    (o1, l1, b1), (o2, l2, b2) = runs
    assert torch.isfinite(l1).any() and not torch.isfinite(l1).all()
    assert torch.equal(torch.isfinite(l1), torch.isfinite(l2)) and (o1 - o2).abs().max() < 1e-6
    assert (l1 - l2)[torch.isfinite(l1)].abs().max() < 1e-6
    for a, b in zip(b1.tensors(), b2.tensors()):
        assert torch.equal(a, b)
