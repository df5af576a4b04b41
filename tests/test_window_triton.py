"""The Triton forward of the sink + sliding-window softmax (ops/triton/window_fwd.py) against
:func:`linearize.ops.window.sink_window_softmax` in float64 on the same rounded inputs (itself checked against
the dense softmax in tests/test_window.py): under the Triton interpreter on the CPU (fp32, fp16: the
interpreter's bf16 dots are wrong), and compiled on a CUDA GPU (``-m gpu``, NaN-poisoned outputs). Inputs are
laid out as the model lays them out, by ``fresh_inputs`` (a batch, padded rows, packed documents) and
``cached_inputs`` (a continuation after a first chunk, real keys in the W slots before it)."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_interpreter

from linearize.ops.triton.window_fwd import sink_window_triton
from linearize.ops.window import sink_window_softmax
from linearize.ops.window_inputs import WindowBuffers, cached_inputs, fresh_inputs

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
CASES = [  # (B, T, H, G, D, W, S, layout); packed: the document boundaries
    (2, 101, 2, 3, 48, 64, 4, "fresh"),  # sinks of one row each; T not a multiple of the block (10, 42)
    (2, 40, 2, 1, 64, 64, 0, "padded"),  # T < W
    (2, 71, 2, 3, 64, 16, 0, "fresh"),
    (2, 50, 1, 1, 48, 16, 4, "padded"),
    (1, 90, 2, 3, 64, 16, 4, (0, 1, 30, 31, 70, 90)),  # packed, 1-token documents, sinks of T rows
    (2, 30, 2, 3, 48, 16, 4, "cached"),
    (2, 9, 1, 3, 64, 64, 4, "cached"),  # a short continuation, T < W
    (2, 1, 2, 1, 64, 16, 4, "cached"),  # one decode step
    (2, 20, 1, 2, 256, 16, 4, "padded"),  # the widest heads
]


def case_id(c) -> str:
    B, T, H, G, D, W, S, layout = c
    return f"{B}x{T}x{H}x{G}x{D}-w{W}-s{S}-" + (layout if isinstance(layout, str) else "packed")


def window_args(B, T, H, G, D, W, S, layout, seed=0) -> list:
    """``sink_window_softmax``'s arguments for random q, k, v (float32) as the model lays them out."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = rn(B, T, G * H, D) * 0.5 + 0.1 * rn(1, 1, G * H, D)  # some queries peak, some spread
    k, v = rn(B, T, H, D) + 0.3 * rn(1, 1, H, D), rn(B, T, H, D)
    if layout == "cached":  # a first chunk of W + 5 tokens (row 1 starting with 3 of padding), then T more
        T0 = W + 5
        first = torch.ones(B, T0, dtype=torch.bool)
        first[1, :3] = False
        _, buffers = cached_inputs(rn(B, T0, H, D), rn(B, T0, H, D), WindowBuffers.empty(k, W, S), W, S, first)
        mask = torch.ones(B, T, dtype=torch.bool)
        if T > 1:
            mask[0, T // 2:] = False  # trailing padding in row 0
        else:
            mask[1] = False  # a decode step of a padded row
        x, _ = cached_inputs(k, v, buffers, W, S, mask)
    elif layout == "padded":  # row 1 left-padded
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[1, : T // 3] = False
        x = fresh_inputs(k, v, W, S, mask=mask)
    else:
        x = fresh_inputs(k, v, W, S, None if layout == "fresh" else torch.tensor(layout))
    return [q, x.k, x.v, x.key_doc, x.query_doc, W, x.sink_k, x.sink_v, x.sink_ok]


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def check(dtype, device, B, T, H, G, D, W, S, layout, seed=0) -> tuple[float, float]:
    args = window_args(B, T, H, G, D, W, S, layout, seed)
    low = [a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args]  # the kernel's inputs
    o_ref, lse_ref = sink_window_softmax(*(a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in low))
    o, lse = sink_window_triton(*(a.to(device) if torch.is_tensor(a) else a for a in low))
    assert o.dtype == lse.dtype == torch.float32 and o.shape == (B, T, G * H, D) and lse.shape == (B, T, G * H)
    o, lse = o.double().cpu(), lse.double().cpu()
    seen = torch.isfinite(lse_ref)
    if layout in ("padded", "cached"):
        assert not seen.all(), "padding must leave some queries without keys"
    if S and T > 1:
        assert args[8].any() and not args[8].all(), "some queries must see their sinks and some not"
    assert torch.isfinite(o).all()
    assert torch.equal(torch.isfinite(lse), seen) and (lse[~seen] == float("-inf")).all()
    assert (o[~seen] == 0).all()
    errors = rel(o, o_ref), rel(lse[seen], lse_ref[seen])
    assert max(errors) <= TOL[dtype], errors
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_sink_window_triton_interpreted_equals_reference(dtype, case, poisoned):
    needs_interpreter()
    check(dtype, "cpu", *case)


def test_sink_window_triton_rejects_bad_inputs(monkeypatch):
    args = window_args(1, 10, 2, 3, 16, 8, 2, "fresh")
    q, k, v, kd, qd, W, sk, sv, ok = args
    bad = {
        "k must be": [q, k[:, 1:], v, kd, qd, W, sk, sv, ok],
        "key_doc must be": [q, k, v, kd[:, 1:], qd, W, sk, sv, ok],
        "multiple of k/v heads": [q[:, :, :5], k, v, kd, qd, W, sk, sv, ok],
        "sink_ok must be": [q, k, v, kd, qd, W, sk, sv, ok[:, :, :1]],
        "sink_k must be": [q, k, v, kd, qd, W, sk.expand(1, 2, -1, -1, -1), sv, ok],
        "come together": [q, k, v, kd, qd, W, sk, None, None],
        "share one dtype": [q, k.half(), v, kd, qd, W, sk, sv, ok],
        "in q.s dtype": [q, k, v, kd, qd, W, sk.half(), sv, ok],
        "fp16/bf16/fp32": [q.double(), k.double(), v.double(), kd, qd, W, sk, sv, ok],
        "bool": [q, k, v, kd, qd, W, sk, sv, ok.int()],
        "integer document ids": [q, k, v, kd.float(), qd, W, sk, sv, ok],
        "window must be": [q, k, v, kd, qd, 0, sk, sv, ok],
        "head sizes up to": [torch.randn(1, 10, 6, 300), torch.randn(1, 18, 2, 300), torch.randn(1, 18, 2, 300), kd, qd,
                             W, None, None, None],
    }
    for message, call in bad.items():
        with pytest.raises(ValueError, match=message):
            sink_window_triton(*call)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        sink_window_triton(*args)


GPU_CASES = CASES + [
    (2, 8192, 3, 3, 64, 64, 4, "padded"),  # 9 query / 3 KV heads, as the profiled model
    (1, 8192, 3, 3, 64, 64, 4, (0, 1, 700, 701, 5000, 8192)),
    (2, 2000, 2, 4, 128, 64, 4, "cached"),
    (1, 1500, 1, 2, 256, 32, 4, "fresh"),
    (2, 700, 2, 7, 80, 64, 4, "padded"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_sink_window_triton_gpu_equals_reference(dtype, case, compiled):
    check(dtype, "cuda", *case)


def test_window_block_on_the_kernel_equals_the_banded_form(monkeypatch):
    """A converted model whose window part runs on the kernel (``backend="triton"``, no gradient): a left-padded
    prefill longer than window + sinks, decoding after it, and scoring a padded batch give the logits of the same
    model on the banded PyTorch form."""
    import copy

    from conftest import tiny_model
    from test_convert import calib, ids, incremental_logits

    import linearize
    import linearize.ops.triton.window_fwd as window_fwd
    from linearize.layers import GDNAttention, GDNOptions

    teacher = tiny_model("llama")
    banded = linearize.convert(teacher, calibration_ids=calib(teacher), options=GDNOptions(window=5, sinks=2))
    with torch.no_grad():
        for m in banded.modules():
            if isinstance(m, GDNAttention):
                m.mix_bias.normal_(0, 0.5)
    kernel = copy.deepcopy(banded)
    for m in kernel.modules():
        if isinstance(m, GDNAttention):
            m.options.backend = "triton"
    calls = []
    run = window_fwd.sink_window_triton
    monkeypatch.setattr(window_fwd, "sink_window_triton", lambda *a, **kw: calls.append(1) or run(*a, **kw))
    x = ids(banded, B=2, T=14)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        want, _ = incremental_logits(banded, x, mask, pos, prefill=11)
        assert not calls
        got, _ = incremental_logits(kernel, x, mask, pos, prefill=11)
        assert calls  # the prefill took the kernel (decode steps take the fused step)
        scored = kernel(x, attention_mask=mask).logits  # scoring: a fresh padded batch, no cache
        scored_banded = banded(x, attention_mask=mask).logits
    real = mask.bool()
    assert (got - want)[real].abs().max() < 1e-4
    assert (scored - scored_banded)[real].abs().max() < 1e-4
