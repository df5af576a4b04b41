"""The sparse exact cache beside the window (GDNOptions.sparse_cache) against references written here: which
tokens a query keeps, by sorting (score, position) in Python; its softmax in float64 by loops; a cache with room
for every token turning the exact part into the teacher's causal softmax; the full forward against prefill +
decode steps; the probe's target and fit against loops and a known linear map."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import tiny_model
from test_convert import calib, ids, incremental_logits
from test_window import dense_sink_window

import linearize
from linearize.config import load_recipe
from linearize.layers import GDNAttention, GDNOptions
from linearize.ops import sparse_cache
from linearize.ops.sparse_cache import (
    far_attention,
    fit_probe,
    fresh_cache,
    merge_softmax,
    selection_keys,
    sink_window_cache_flex,
)
from linearize.ops.window import sink_window_softmax
from linearize.ops.window_inputs import fresh_inputs

f64 = torch.float64


def kept_by_sorting(score, pos, docs, t, window, sinks, size):
    """Indices query t keeps: the ``size`` best (score, position) among its document's tokens older than its
    window and not a sink, by Python's tuple order (ties to the later token)."""
    a, _ = next(d for d in docs if d[0] <= t < d[1])
    older = [s for s in range(a, t + 1) if t - s >= window and pos[s] > sinks]
    return sorted(older, key=lambda s: (float(score[s]), int(pos[s])), reverse=True)[:size]


def problem(T=40, Hq=4, H=2, D=8, seed=0, ties=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, Hq, D, generator=g, dtype=f64) * 0.7
    k, v = (torch.randn(1, T, H, D, generator=g, dtype=f64) for _ in range(2))
    score = torch.randn(1, T, H, generator=g).float()
    if ties:  # repeated tokens at layer 0 score alike: three values only in head 1
        score[..., 1] = torch.randint(0, 3, (1, T), generator=g).float()
    return q, k, v, score


@pytest.mark.parametrize("block", [256, 1, 7])
@pytest.mark.parametrize("window,sinks,size", [(4, 2, 3), (6, 0, 1), (3, 1, 50)])
def test_fresh_cache_keeps_the_best_scored_and_attends_exactly(window, sinks, size, block, monkeypatch):
    """Two packed documents, scores with ties: each query's cache part is the softmax over the tokens the
    Python sort picks, in float64; merged with the sink/window part it is one softmax over the union — whether
    the queries are taken all at once or in blocks (the best of the older candidates carried between them)."""
    monkeypatch.setattr(sparse_cache, "_BLOCK", block)
    T = 40
    q, k, v, score = problem(T)
    cu = torch.tensor([0, 17, T])
    docs = [(0, 17), (17, T)]
    inp = fresh_inputs(k, v, window, sinks, cu)
    key = selection_keys(score, inp.pos).masked_fill((inp.pos <= sinks)[..., None], -math.inf)
    o_c, lse_c = fresh_cache(q, inp.old_k, inp.old_v, inp.old_ok, key, inp.key_doc[:, :T], inp.query_doc, window, size)
    o_e, lse_e = sink_window_softmax(q, inp.k, inp.v, inp.key_doc, inp.query_doc, window, inp.sink_k, inp.sink_v,
                                     inp.sink_ok)
    o, lse = merge_softmax(o_e, lse_e, o_c, lse_c)
    o_ref, lse_ref = dense_sink_window(q, k, v, docs, window, sinks)
    pos = inp.pos[0]
    G = q.shape[2] // k.shape[2]
    for t in range(T):
        for h in range(q.shape[2]):
            kept = kept_by_sorting(score[0, :, h // G], pos, docs, t, window, sinks, size)
            if not kept:
                assert lse_c[0, t, h] == -math.inf and o_c[0, t, h].abs().max() == 0
                continue
            s = torch.stack([q[0, t, h] @ k[0, i, h // G] for i in kept])
            assert torch.allclose(lse_c[0, t, h], s.logsumexp(0), atol=1e-12)
            ref = (s.softmax(0)[:, None] * v[0, kept, h // G]).sum(0)
            assert torch.allclose(o_c[0, t, h], ref, atol=1e-12)
            both = torch.logaddexp(lse_ref[0, t, h], s.logsumexp(0))
            assert torch.allclose(lse[0, t, h], both, atol=1e-12)


@pytest.mark.parametrize("block", [256, 7])
def test_fused_cpu_block_softmax_equals_the_float64_cache(block, monkeypatch):
    """A float32 prefill on the CPU without gradients runs each block's softmax as torch's fused CPU attention
    (``masked_softmax`` where ``cpu_fused``): the same ``(o, lse)`` as the float64 composed ops to float32 rounding,
    −inf and 0 for the queries whose cache is still empty; with gradients the composed ops run."""
    monkeypatch.setattr(sparse_cache, "_BLOCK", block)
    calls = []
    fused = sparse_cache.cpu_fused
    monkeypatch.setattr(sparse_cache, "cpu_fused", lambda *a: calls.append(fused(*a)) or calls[-1])
    T, W, S, C = 40, 4, 2, 5
    q, k, v, score = problem(T, seed=5)
    cu = torch.tensor([0, 17, T])
    inp = fresh_inputs(k, v, W, S, cu)
    key = selection_keys(score, inp.pos).masked_fill((inp.pos <= S)[..., None], -math.inf)
    args = (inp.old_ok, key, inp.key_doc[:, :T], inp.query_doc, W, C)
    o64, lse64 = fresh_cache(q, inp.old_k, inp.old_v, *args)
    calls.clear()
    with torch.no_grad():
        o32, lse32 = fresh_cache(q.float(), inp.old_k.float(), inp.old_v.float(), *args)
    assert calls and all(calls) and o32.dtype == lse32.dtype == torch.float32
    empty = torch.isinf(lse64)
    assert empty.any() and (~empty).any()  # the first queries of each document keep nothing yet
    assert torch.equal(torch.isinf(lse32), empty) and o32[empty].abs().max() == 0
    assert (lse32[~empty].double() - lse64[~empty]).abs().max() < 1e-5
    assert (o32.double() - o64).abs().max() < 1e-5
    calls.clear()
    qg = q.float().requires_grad_(True)
    fresh_cache(qg, inp.old_k.float(), inp.old_v.float(), *args)[0].sum().backward()
    assert calls and not any(calls) and qg.grad is not None


def test_room_for_every_token_is_causal_softmax():
    """C ≥ T: sinks + window + cache cover every earlier token of the document — the teacher's softmax."""
    T, W, S = 30, 4, 2
    q, k, v, score = problem(T, seed=3)
    inp = fresh_inputs(k, v, W, S)
    key = selection_keys(score, inp.pos).masked_fill((inp.pos <= S)[..., None], -math.inf)
    o_c, lse_c = fresh_cache(q, inp.old_k, inp.old_v, inp.old_ok, key, inp.key_doc[:, :T], inp.query_doc, W, T)
    o_e, lse_e = sink_window_softmax(q, inp.k, inp.v, inp.key_doc, inp.query_doc, W, inp.sink_k, inp.sink_v, inp.sink_ok)
    o, lse = merge_softmax(o_e, lse_e, o_c, lse_c)
    logits = torch.einsum("bthd,bshd->bhts", q, k.repeat_interleave(2, 2))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = logits.masked_fill(~causal, -math.inf).softmax(-1)
    ref = torch.einsum("bhts,bshd->bthd", p, v.repeat_interleave(2, 2))
    assert (o - ref).abs().max() < 1e-12 and (lse - logits.masked_fill(~causal, -math.inf).logsumexp(-1).transpose(1, 2)).abs().max() < 1e-12


def test_flex_with_cache_equals_dense():
    """FlexAttention's mask (eager on the CPU) picks the same tokens as the dense selection."""
    T, W, S, C = 48, 5, 2, 4
    q, k, v, score = problem(T, seed=5)
    q, k, v = q.float(), k.float(), v.float()
    cu = torch.tensor([0, 20, T])
    inp = fresh_inputs(k, v, W, S, cu)
    key = selection_keys(score, inp.pos).masked_fill((inp.pos <= S)[..., None], -math.inf)
    o_c, lse_c = fresh_cache(q, inp.old_k, inp.old_v, inp.old_ok, key, inp.key_doc[:, :T], inp.query_doc, W, C)
    o_e, lse_e = sink_window_softmax(q, inp.k, inp.v, inp.key_doc, inp.query_doc, W, inp.sink_k, inp.sink_v, inp.sink_ok)
    o, lse = merge_softmax(o_e, lse_e, o_c, lse_c)
    o2, lse2 = sink_window_cache_flex(q, k, v, inp.key_doc[:, W:], inp.query_doc, inp.pos, W, S, key, inp.old_ok, C,
                                      compiled=False)
    assert (o - o2).abs().max() < 1e-5 and (lse - lse2).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
def test_flex_with_cache_compiled_equals_dense_on_gpu(dtype, tol):
    """The compiled kernel and its gradients against the dense path on the GPU (float32 reference)."""
    T, W, S, C = 300, 16, 3, 24
    q, k, v, score = problem(T, D=16, seed=6)  # FlexAttention's kernels need a head dim of 16 or more
    cu = torch.tensor([0, 130, T], device="cuda")
    outs = []
    for flex in (False, True):
        x = [t.cuda().to(torch.float32 if not flex else dtype).requires_grad_(True) for t in (q, k, v)]
        inp = fresh_inputs(x[1], x[2], W, S, cu, gather_sinks=not flex)
        key = selection_keys(score.cuda(), inp.pos).masked_fill((inp.pos <= S)[..., None], -math.inf)
        if flex:
            o, lse = sink_window_cache_flex(x[0], x[1], x[2], inp.key_doc[:, W:], inp.query_doc, inp.pos, W, S, key,
                                            inp.old_ok, C)
        else:
            o_c, lse_c = fresh_cache(x[0], inp.old_k, inp.old_v, inp.old_ok, key, inp.key_doc[:, :T], inp.query_doc, W, C)
            o_e, lse_e = sink_window_softmax(x[0], inp.k, inp.v, inp.key_doc, inp.query_doc, W, inp.sink_k, inp.sink_v,
                                             inp.sink_ok)
            o, lse = merge_softmax(o_e, lse_e, o_c, lse_c)
        r = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).cuda()
        d = torch.autograd.grad((o * r).sum() + lse.sum(), x)
        outs.append((o.detach(), lse.detach(), d))
    (o1, l1, d1), (o2, l2, d2) = outs
    assert (o1 - o2).abs().max() < tol and (l1 - l2).abs().max() < tol
    for a, b in zip(d1, d2):
        assert ((a - b.float()).norm() / a.norm()).item() < tol


def perturbed(options, seed=0):
    teacher = tiny_model("llama", seed=seed)
    model = linearize.convert(teacher, calibration_ids=calib(teacher), options=options)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GDNAttention):
                m.mix_bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("prefill", [3, 17])
@pytest.mark.parametrize("probe,block", [("fitted", 256), ("zero", 256), ("fitted", 2)])
def test_prefill_and_decode_equal_full_forward(prefill, probe, block, monkeypatch):
    """Prefill, then token by token: the full forward's logits, whether the probe separates tokens or ties them
    all (zero: the newest kept), and with the selection in blocks of 2 queries; the cache holds C tokens per KV
    head whatever the length."""
    monkeypatch.setattr(sparse_cache, "_BLOCK", block)
    model = perturbed(GDNOptions(window=4, sinks=2, sparse_cache=3))
    blocks = [m for m in model.modules() if isinstance(m, GDNAttention)]
    assert all(b.cache_probe.abs().sum() > 0 for b in blocks)  # fitted at convert
    if probe == "zero":
        for b in blocks:
            b.cache_probe.zero_()
    x = ids(model, B=2, T=26)
    mask, pos = torch.ones_like(x), torch.arange(26)[None].expand(2, -1)
    with torch.no_grad():
        full = model(x, attention_mask=mask, use_cache=False).logits
        without = linearize.convert(tiny_model("llama"), calibration_ids=calib(model),
                                    options=GDNOptions(window=4, sinks=2))
        for b, m in zip(blocks, (m for m in without.modules() if isinstance(m, GDNAttention))):
            m.mix_bias.copy_(b.mix_bias)
        other = without(x, attention_mask=mask, use_cache=False).logits
        inc, cache = incremental_logits(model, x, mask, pos, prefill=prefill)
    assert (inc - full).abs().max() < 1e-4
    assert (full - other)[:, 7:].abs().max() > 1e-3  # the cache changes what the block computes past window + sinks
    buf = cache.layers[0].cache_buffers
    assert buf.k.shape[1] == 3 and buf.win_key.shape[1] == 4 and torch.isfinite(buf.key).all()


def test_far_attention_and_probe_fit():
    """The probe's target by loops; a target that is a linear map of the features is recovered by the fit."""
    T, W = 12, 3
    q, k, _, _ = problem(T, seed=7)
    got = far_attention(q, k, W, block=5)
    for t in range(T):
        for h in range(k.shape[2]):
            best = 1e-6
            for u in range(t + W, T):
                for hq in (2 * h, 2 * h + 1):
                    p = (torch.stack([q[0, u, hq] @ k[0, s, h] for s in range(u + 1)])).softmax(0)
                    best = max(best, float(p[t]))
            assert abs(got[0, t, h].item() - math.log(best)) < 1e-9
    g = torch.Generator().manual_seed(8)
    x = torch.randn(3, 50, 6, generator=g, dtype=f64)
    w = torch.randn(2, 7, generator=g, dtype=f64)
    y = x @ w[:, :-1].T + w[:, -1]
    assert torch.allclose(fit_probe(x, y, ridge=1e-12), w, atol=1e-6)


def test_saved_loaded_options_and_bad_input(tmp_path, tiny_dir):
    from test_cli import run

    model = perturbed(GDNOptions(window=4, sinks=2, sparse_cache=5))
    model.save_pretrained(tmp_path / "m")
    back = linearize.load(tmp_path / "m")
    assert back.config.linearize["options"]["sparse_cache"] == 5
    x = ids(model, B=1, T=20)
    with torch.no_grad():
        assert torch.equal(back(x).logits, model(x).logits)
        assert torch.equal(back.model.layers[0].self_attn.cache_probe, model.model.layers[0].self_attn.cache_probe)
    with pytest.raises(ValueError, match="sparse_cache=8 is an option of the sink"):
        GDNOptions(sparse_cache=8)
    with pytest.raises(ValueError, match="sparse_cache must be"):
        GDNOptions(window=4, sparse_cache=-1)
    out = tmp_path / "sc"
    code, text = run("convert", "--model", tiny_dir, "--output", out, "--sparse-cache", 16, "--tokens", 64,
                     "--calibration-tokens", 64)
    assert code == 0, text
    assert json.loads((out / "config.json").read_text())["linearize"]["options"]["sparse_cache"] == 16
    code, text = run("convert", "--model", tiny_dir, "--output", tmp_path / "bad", "--window", 0, "--sparse-cache", 16)
    assert code == 2 and "sparse" in text and not (tmp_path / "bad").exists()
    assert load_recipe(None, [f"teacher.model={tiny_dir}", "convert.window=8", "convert.sparse_cache=32"]).convert.sparse_cache == 32
    with pytest.raises(Exception, match="convert.sparse_cache"):
        load_recipe(None, [f"teacher.model={tiny_dir}", "convert.sparse_cache=32"])


def test_left_padding_and_a_hole():
    """A left-padded row, scored fresh and decoded, is the same row alone; a padding slot inside a row changes
    nothing of the others (the token under it is never a key, a sink or a cache candidate)."""
    model = perturbed(GDNOptions(window=4, sinks=2, sparse_cache=3))
    x = ids(model, B=1, T=22)
    both = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), x], 1), ids(model, B=1, T=27, seed=5)])
    mask = torch.ones_like(both)
    mask[0, :5] = 0
    mask[1, 12] = 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    other = both.clone()
    other[1, 12] = (both[1, 12] + 7) % model.config.vocab_size
    with torch.no_grad():
        alone = model(x, use_cache=False).logits
        fresh = model(both, attention_mask=mask, position_ids=pos, use_cache=False).logits
        inc, _ = incremental_logits(model, both, mask, pos, prefill=12)
        inc_other, _ = incremental_logits(model, other, mask, pos, prefill=12)
    real = mask.bool()
    assert (fresh[0, 5:] - alone[0]).abs().max() < 1e-4 and (inc[0, 5:] - alone[0]).abs().max() < 1e-4
    assert (fresh - inc)[real].abs().max() < 1e-4 and (inc - inc_other)[real].abs().max() < 1e-6


def test_probe_text_fits_the_context():
    """The probe's 8,192 tokens come in one row, or in rows of the model's context where it is shorter."""
    from types import SimpleNamespace

    from linearize.conversion import probe_shape

    assert probe_shape(SimpleNamespace(max_position_embeddings=131072)) == (1, 8192)
    assert probe_shape(SimpleNamespace(max_position_embeddings=2048)) == (4, 2048)
    assert probe_shape(SimpleNamespace()) == (1, 8192)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("size", [0, 3])
def test_packed_rows_equal_documents_alone(device, size):
    """Two rows packing two documents each (positions restarting), which the blocks run as one flat row: each
    document's logits are its own alone, with the window alone and with the cache — on CUDA with gradients
    through FlexAttention, whose block mask and selection then run row by row."""
    model = perturbed(GDNOptions(window=4, sinks=2, sparse_cache=size)).to(device)
    lens = [(9, 15), (20, 4)]
    docs = [[ids(model, B=1, T=n, seed=10 * r + i).to(device) for i, n in enumerate(row)] for r, row in enumerate(lens)]
    x = torch.cat([torch.cat(row, 1) for row in docs])
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lens]).to(device)
    with torch.set_grad_enabled(device == "cuda"):
        packed = model(x, position_ids=pos, use_cache=False).logits
        for r, row in enumerate(docs):
            a = 0
            for d in row:
                alone = model(d, use_cache=False).logits
                assert (packed[r, a:a + d.shape[1]] - alone[0]).abs().max() < (1e-4 if device == "cpu" else 2e-3)
                a += d.shape[1]


def test_decode_step_equals_the_selection_and_updates_in_place():
    """:func:`cache_step_` against :func:`cached_cache` step after step in float64, from an empty cache through
    filling (sinks and first tokens never candidates) to evicting: the same output and normalizer, the same
    set of kept tokens, written into the same tensors."""
    from linearize.ops.sparse_cache import CacheBuffers, cache_step_, cached_cache

    W, C, T = 3, 4, 20
    q, k, v, score = problem(T, seed=5)
    pos = torch.arange(1, T + 1)[None]
    key = selection_keys(score, pos).masked_fill((pos <= 1)[..., None], -math.inf)
    ok = torch.ones(1, 1, dtype=torch.bool)
    a, b = CacheBuffers.empty(k, C, W), CacheBuffers.empty(k, C, W)
    tensors = [x.data_ptr() for x in b.tensors()[:3]]
    win = torch.zeros(1, W, 2, 8, dtype=f64), torch.zeros(1, W, 2, 8, dtype=f64)  # the window's tokens
    for t in range(T):
        old_ok = ok & (t >= W)  # the token leaving the window (none in the first W steps)
        old_k, old_v = win[0][:, :1], win[1][:, :1]
        o_a, lse_a, a = cached_cache(q[:, t:t + 1], old_k, old_v, old_ok, key[:, t:t + 1], a, W, C)
        o_b, lse_b, b = cache_step_(q[:, t:t + 1], old_k, old_v, old_ok, key[:, t:t + 1], b, W)
        assert torch.allclose(o_b, o_a, atol=1e-12) and torch.allclose(lse_b, lse_a, atol=1e-12)
        assert torch.equal(b.key.sort(1).values, a.key.sort(1).values) and torch.equal(b.win_key, a.win_key)
        order_a, order_b = a.key.argsort(1), b.key.argsort(1)
        fin = torch.isfinite(a.key.sort(1).values)[..., None]
        for x, y in ((a.k, b.k), (a.v, b.v)):
            gx = torch.gather(x, 1, order_a[..., None].expand_as(x))
            gy = torch.gather(y, 1, order_b[..., None].expand_as(y))
            assert torch.equal(gx * fin, gy * fin)
        win = tuple(torch.cat([w[:, 1:], x[:, t:t + 1]], 1) for w, x in zip(win, (k, v)))
    assert torch.isfinite(b.key).all() and [x.data_ptr() for x in b.tensors()[:3]] == tensors


def test_a_compiled_offer_writes_what_the_eager_one_does():
    """The offer of a token to the cache traced by torch.compile (an indexed write in place) against the eager
    scatter, step after step from a partly empty cache: the same slots, keys and values, in the same tensors."""
    from linearize.ops.sparse_cache import CacheBuffers, _offer_

    g = torch.Generator().manual_seed(4)
    B, C, H, D = 2, 5, 3, 8
    key = torch.randn(B, C, H, generator=g, dtype=f64).masked_fill(torch.rand(B, C, H, generator=g) < 0.5, -math.inf)
    a = CacheBuffers(torch.randn(B, C, H, D, generator=g), torch.randn(B, C, H, D, generator=g), key, key[:, :1])
    b = CacheBuffers(*(t.clone() for t in a.tensors()))
    tensors = [t.data_ptr() for t in b.tensors()[:3]]
    offer = torch.compile(_offer_, dynamic=False)
    for _ in range(12):
        k, v = torch.randn(B, 1, H, D, generator=g), torch.randn(B, 1, H, D, generator=g)
        new = torch.randn(B, 1, H, generator=g, dtype=f64).masked_fill(torch.rand(B, 1, H, generator=g) < 0.2, -math.inf)
        _offer_(a, k, v, new)
        offer(b, k, v, new)
        for x, y in zip(a.tensors()[:3], b.tensors()[:3]):
            assert torch.equal(x, y)
    assert torch.isfinite(a.key).all() and [t.data_ptr() for t in b.tensors()[:3]] == tensors


def random_cache(N, H, D, W, C, win_pos, S, dtype, seed, empty=0.3):
    """Cache slots of ``dtype`` with float64 keys, a share ``empty`` of the slots empty (−inf); the window's keys
    −inf where its slot holds padding or a sink (as token_keys leaves them)."""
    from linearize.ops.sparse_cache import CacheBuffers

    g = torch.Generator().manual_seed(seed)
    key = torch.randn(N, C, H, generator=g, dtype=f64).masked_fill(torch.rand(N, C, H, generator=g) < empty, -math.inf)
    win_key = torch.randn(N, W, H, generator=g, dtype=f64).masked_fill((win_pos <= S)[..., None], -math.inf)
    k, v = (torch.randn(N, C, H, D, generator=g).to(dtype) for _ in range(2))
    return CacheBuffers(k, v, key, win_key), torch.randn(N, H, generator=g)


STEP_CASES = [(2, 2, 2, 16, 4, 2, [3, 40], [0, 2], 5), (3, 3, 3, 64, 64, 4, [1, 70, 400], [5, 0, 2], 40),
              (1, 1, 4, 40, 5, 3, [30], [1], 7), (2, 1, 2, 16, 3, 2, [0, 1], [0, 1], 2),
              (1, 1, 1, 16, 3, 1, [20], [0], 1030),  # the lowest key sought in two blocks
              (2, 2, 2, 16, 4, 2, [50, 9], [0, 1], 100, 0.97)]  # splits of the cache all empty


@pytest.mark.parametrize("case", STEP_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_step_with_a_cache_kernel_equals_torch_body(case, dtype):
    """The decode-step kernels with a sparse cache (TRITON_INTERPRET=1) — the old token offered to the cache and the
    new one keyed inside it, the slots' softmax split 32 at a time and joined — against the PyTorch body after ``cache_enter_``, in float64 on the same rounded
    inputs, step after step past the window (the kernel's own keys offered in turn; rows filling their sinks):
    the output, the states, every buffer and the cache's slots."""
    from test_window_step import ARGS, BETA_MAX, cast, named, random_step, rel

    from linearize.ops.sparse_cache import CacheBuffers
    from linearize.ops.window_step import sink_window_gdn_step_

    N, H, G, D, W, S, counts, pads, C, *empty = case
    x = cast(random_step(N, H, G, D, W, S, counts, pads, seed=D + C), dtype)
    cache, score = random_cache(N, H, D, W, C, x["buffers"].win_pos, S, dtype, seed=C, empty=(empty or [0.3])[0])
    for _ in range(min(W + 3, 8)):
        y, ycache = cast(x, f64, f64), CacheBuffers(*(t.double().clone() for t in cache.tensors()))
        want = sink_window_gdn_step_(*(y[n] for n in ARGS), BETA_MAX, W, S, backend="torch", cache=ycache,
                                     token_score=score)
        got = sink_window_gdn_step_(*(x[n] for n in ARGS), BETA_MAX, W, S, backend="triton", cache=cache,
                                    token_score=score)
        assert torch.isfinite(got).all() and rel(got, want) < 1e-6
        for n in ("state", "sum_k", "sum_v"):
            assert rel(x[n], y[n]) < 1e-6, n
        for (name, a), b in zip(named(x["buffers"]).items(), y["buffers"].tensors()):
            assert torch.equal(a.double(), b), name
        assert torch.equal(cache.k.double(), ycache.k) and torch.equal(cache.v.double(), ycache.v)
        for a, b in ((cache.key, ycache.key), (cache.win_key, ycache.win_key)):  # an FMA may round a key's last bit
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.allclose(a, b, rtol=1e-15, atol=0)
        cache = CacheBuffers(cache.k, cache.v, ycache.key.clone(), ycache.win_key.clone())  # the same keys on
        score = score + 0.5  # the next token's
    assert torch.isfinite(cache.key).sum() > 0


@pytest.mark.parametrize("case,features", [(STEP_CASES[0], 40), (STEP_CASES[2], 1100)])  # 1,100: two blocks of 1,024
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_step_scores_the_new_token_with_the_probe(case, features, dtype):
    """``probe=(x, probe)`` in place of ``token_score``: the kernel (TRITON_INTERPRET=1) computes the new token's score
    from the block's input itself; against the float64 body given the float64 score ``x·w + b``, step after step: the
    output, the window's keys (the new token's key last) and the cache's. The torch route takes the same argument."""
    from test_window_step import ARGS, BETA_MAX, cast, random_step, rel

    from linearize.ops.sparse_cache import CacheBuffers
    from linearize.ops.window_step import sink_window_gdn_step_

    N, H, G, D, W, S, counts, pads, C, *_ = case
    x = cast(random_step(N, H, G, D, W, S, counts, pads, seed=D + C), dtype)
    cache, _ = random_cache(N, H, D, W, C, x["buffers"].win_pos, S, dtype, seed=C)
    g = torch.Generator().manual_seed(features)
    weights = (torch.randn(H, features + 1, generator=g) / features ** 0.5).to(dtype)
    for step in range(min(W + 3, 8)):
        inp = torch.randn(N, features, generator=g).to(dtype)
        score = inp.double() @ weights[:, :-1].double().T + weights[:, -1].double()
        y, ycache = cast(x, f64, f64), CacheBuffers(*(t.double().clone() for t in cache.tensors()))
        want = sink_window_gdn_step_(*(y[n] for n in ARGS), BETA_MAX, W, S, backend="torch", cache=ycache,
                                     token_score=score)
        backend = "torch" if step == 0 and dtype == torch.float32 else "triton"
        got = sink_window_gdn_step_(*(x[n] for n in ARGS), BETA_MAX, W, S, backend=backend, cache=cache,
                                    probe=(inp, weights))
        assert torch.isfinite(got).all() and rel(got, want) < 1e-6
        for a, b in ((cache.key, ycache.key), (cache.win_key, ycache.win_key)):  # the score summed in float64: a
            assert torch.equal(torch.isfinite(a), torch.isfinite(b))      # float32 sum would be ~1e-7 off
            assert torch.allclose(a[torch.isfinite(a)], b[torch.isfinite(b)], rtol=1e-13, atol=1e-13)
        assert not torch.equal(cache.win_key[:, -1], cache.win_key[:, -2])  # the new key arrived
        cache = CacheBuffers(cache.k, cache.v, ycache.key.clone(), ycache.win_key.clone())  # the same keys on
    with pytest.raises(ValueError, match="probe must be"):
        sink_window_gdn_step_(*(x[n] for n in ARGS), BETA_MAX, W, S, cache=cache, probe=(inp, weights[:, 1:]))


@pytest.mark.parametrize("case", STEP_CASES + [(1, 2, 2, 16, 4, 2, [1], [0], 6, 1.0)])  # every slot empty
def test_cpu_step_with_a_cache_in_float32_equals_the_float64_body(case, monkeypatch):
    """The PyTorch body of the decode step in float32 on the CPU — the window's and the cache's softmax each through
    torch's fused CPU attention on the buffers in place, then joined — against the same body in float64 (composed),
    step after step: the output, the states, every buffer and the cache's slots."""
    from test_window_step import ARGS, BETA_MAX, cast, named, random_step, rel

    import linearize.ops.window_step as ws
    from linearize.ops.sparse_cache import CacheBuffers

    fused = []
    fused_route = sparse_cache.cpu_fused
    monkeypatch.setattr(sparse_cache, "cpu_fused",
                        lambda q, *kv: fused.append((q.dtype, fused_route(q, *kv))) or fused[-1][1])
    N, H, G, D, W, S, counts, pads, C, *empty = case
    x = cast(random_step(N, H, G, D, W, S, counts, pads, seed=D + C), torch.float32)
    cache, score = random_cache(N, H, D, W, C, x["buffers"].win_pos, S, torch.float32, seed=C, empty=(empty or [0.3])[0])
    for _ in range(min(W + 3, 8)):
        y, ycache = cast(x, f64, f64), CacheBuffers(*(t.double().clone() for t in cache.tensors()))
        want = ws.sink_window_gdn_step_(*(y[n] for n in ARGS), BETA_MAX, W, S, backend="torch", cache=ycache,
                                        token_score=score)
        got = ws.sink_window_gdn_step_(*(x[n] for n in ARGS), BETA_MAX, W, S, backend="torch", cache=cache,
                                       token_score=score)
        assert got.dtype == torch.float32 and torch.isfinite(got).all() and rel(got, want) < 1e-5
        for n in ("state", "sum_k", "sum_v"):
            assert rel(x[n], y[n]) < 1e-5, n
        for (name, a), b in zip(named(x["buffers"]).items(), y["buffers"].tensors()):
            assert torch.equal(a.double(), b), name
        assert torch.equal(cache.k.double(), ycache.k) and torch.equal(cache.v.double(), ycache.v)
        score = score + 0.5
    assert set(fused) == {(torch.float32, True), (f64, False)}  # float32: the fused route, always


def test_resized_cache_equals_a_model_converted_with_that_size(tmp_path, tiny_dir):
    """``resize_sparse_cache``: the probe does not depend on the size, so a model converted with 3 slots and
    resized to 9 computes what one converted with 9 does (same calibration), and differs from its own 3-slot
    output past window + sinks + 3; ``linearize eval --sparse-cache`` (and ``generate``) resizes the model it
    measures and refuses, in one line, a model without a cache or a size below 1."""
    from test_cli import assert_one_line_error, run

    from linearize.layers.options import resize_sparse_cache

    teacher = tiny_model("llama")
    small = linearize.convert(teacher, calibration_ids=calib(teacher), options=GDNOptions(window=4, sinks=2, sparse_cache=3))
    big = linearize.convert(tiny_model("llama"), calibration_ids=calib(teacher),
                            options=GDNOptions(window=4, sinks=2, sparse_cache=9))
    x = ids(small, B=2, T=30)
    with torch.no_grad():
        before = small(x).logits
        assert resize_sparse_cache(small, 9) == len(small.model.layers)
        assert torch.allclose(small(x).logits, big(x).logits, atol=1e-6)
        assert (small(x).logits - before)[:, 10:].abs().max() > 1e-4
    assert small.config.linearize["options"]["sparse_cache"] == 9
    assert resize_sparse_cache(linearize.convert(tiny_model("llama"), calibration_ids=calib(teacher),
                                                 options=GDNOptions(window=4, sinks=2)), 9) == 0
    for name, extra in (("m", ("--sparse-cache", 3)), ("plain", ())):
        code, text = run("convert", "--model", tiny_dir, "--output", tmp_path / name, "--window", 4, "--tokens", 64,
                         "--calibration-tokens", 64, *extra)
        assert code == 0, text
    common = ("--teacher", "none", "--tasks", "none", "--seq-len", 16, "--ppl-tokens", 64, "--device", "cpu")
    code, text = run("eval", "-m", tmp_path / "m", *common, "--sparse-cache", 40, "-o", tmp_path / "q.json")
    assert code == 0, text
    assert json.loads((tmp_path / "q.json").read_text())["plan"]["sparse_cache"] == 40
    code, text = run("eval", "-m", tmp_path / "plain", *common, "--sparse-cache", 40, "-o", tmp_path / "p.json")
    assert code == 2 and "no sparse cache" in text and not (tmp_path / "p.json").exists()
    code, text = run("eval", "-m", tmp_path / "m", *common, "--sparse-cache", 0)
    assert code == 2 and "--sparse-cache must be at least 1" in text
    gen = ("generate", "-n", 4, "--device", "cpu", "Hello")  # linearize generate resizes the same way
    code, text = run(*gen, "--model", tmp_path / "m", "--sparse-cache", 40)
    assert code == 0, text
    for name, size, why in (("plain", 40, "no sparse cache"), ("m", 0, "--sparse-cache must be at least 1")):
        assert_one_line_error(*run(*gen, "--model", tmp_path / name, "--sparse-cache", size), why)
    code, text = run("eval", "-m", tmp_path / "m", *common, "--sparse-cache", 70000)
    assert code == 2 and "at most 65536" in text


def test_decode_through_the_kernel_equals_full_forward():
    """The model decoding through the Triton step (TRITON_INTERPRET=1), its cache filling and evicting over 16
    tokens, gives the full forward's logits (float32)."""
    model = perturbed(GDNOptions(window=4, sinks=2, sparse_cache=3, backend="triton"))
    x = ids(model, B=2, T=16)
    mask, pos = torch.ones_like(x), torch.arange(16)[None].expand(2, -1)
    with torch.no_grad():
        full = model(x, attention_mask=mask, use_cache=False).logits
        inc, cache = incremental_logits(model, x, mask, pos, prefill=3)
    assert (inc - full).abs().max() < 1e-4
    assert torch.isfinite(cache.layers[0].cache_buffers.key).all()


def test_refit_probes_on_the_converted_model():
    """``refit_cache_probes`` fits each probe on the model it serves: layer 0's input and q/k are the teacher's in
    the converted model too, so its refitted probe is the one conversion fitted; later layers read converted
    layers' outputs, so theirs move."""
    from linearize.conversion import refit_cache_probes

    teacher = tiny_model("llama")
    c = calib(teacher)
    model = linearize.convert(teacher, calibration_ids=c, options=GDNOptions(window=4, sinks=2, sparse_cache=3))
    blocks = [layer.self_attn for layer in model.model.layers]
    fitted = [b.cache_probe.clone() for b in blocks]
    for b in blocks:
        b.cache_probe.zero_()
    assert refit_cache_probes(model, calibration_ids=c) == len(blocks)
    assert torch.allclose(blocks[0].cache_probe, fitted[0], rtol=1e-5, atol=1e-6)
    assert max((b.cache_probe - f).abs().max().item() for b, f in zip(blocks[1:], fitted[1:])) > 1e-4
    assert refit_cache_probes(linearize.convert(tiny_model("llama"), calibration_ids=c, options=GDNOptions(window=4)),
                              calibration_ids=c) == 0


def test_a_repeated_token_is_kept_alike_whatever_the_call():
    """Two copies of a token have the same input at layer 0, so their probe scores tie and the selection keys' tie-break
    keeps the newer: a float64 model gives the same logits prefilled in one call, in chunks and token by token. With
    float32 scores (rounded differently with a call's number of rows, 2.4e-7 for one row against the 1e-14 tie-break)
    the chunked and stepped calls kept the other copy: logits 1e-3 apart."""
    from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

    from linearize.compat import cache_kwargs

    torch.manual_seed(975)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    teacher = AutoModelForCausalLM.from_config(cfg).eval()
    ids0 = torch.randint(1, 97, (1, 48), generator=torch.Generator().manual_seed(976))
    m = linearize.convert(teacher, calibration_ids=ids0, options=GDNOptions(window=2, sinks=0, sparse_cache=1)).double().eval()
    for row, cuts in (([96, 33, 96, 11, 21, 24, 68, 95, 76, 19, 56], [2]), ([8, 15, 3, 8, 16, 13, 13, 17, 19, 13, 10, 12], "steps")):
        x = torch.tensor([row])
        cuts = list(range(1, x.shape[1])) if cuts == "steps" else cuts
        with torch.no_grad():
            whole = m(x, use_cache=False).logits
            cache = DynamicCache(config=m.config)
            parts = [m(x[:, a:b], **cache_kwargs(cache), use_cache=True).logits
                     for a, b in zip([0, *cuts], [*cuts, x.shape[1]])]
        assert (torch.cat(parts, 1) - whole).abs().max() < 1e-10 * whole.abs().max()


def test_a_grafted_cache_is_the_one_conversion_gives_a_one_layer_model(tmp_path):
    """``graft_sparse_cache`` on a model converted without a cache: every window block gets the slots and a probe
    fitted on the model. With one layer, whose input and q/k are the teacher's either way, the grafted model is
    the model converted with the cache: the same probe, the same logits over rows longer than window + sinks +
    cache (the cache picks), other logits than without it; the saved config says the size, and loads so."""
    from linearize.conversion import graft_sparse_cache
    from linearize.saving import load, save

    c = calib(tiny_model("llama"))
    convert = lambda **kw: linearize.convert(tiny_model("llama", num_hidden_layers=1), calibration_ids=c,  # noqa: E731
                                             options=GDNOptions(window=4, sinks=2, **kw))
    with_cache, plain, grafted = convert(sparse_cache=3), convert(), convert()
    assert graft_sparse_cache(grafted, 3, calibration_ids=c) == 1
    assert graft_sparse_cache(with_cache, 3, calibration_ids=c) == 0  # it has one already
    block, want = grafted.model.layers[0].self_attn, with_cache.model.layers[0].self_attn
    assert block.options.sparse_cache == 3
    assert torch.allclose(block.cache_probe, want.cache_probe, rtol=1e-5, atol=1e-6)
    x = ids(grafted, T=32)
    with torch.no_grad():
        got, ref, without = (m(x).logits for m in (grafted, with_cache, plain))
    assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    assert (got - without).abs().max() > 1e-3
    save(grafted, None, tmp_path / "m")
    again = load(tmp_path / "m")
    assert again.model.layers[0].self_attn.options.sparse_cache == 3
    with torch.no_grad():
        assert torch.allclose(again(x).logits, got, rtol=1e-5, atol=1e-6)
