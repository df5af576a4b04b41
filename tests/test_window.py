"""The sink + sliding-window block (GDNOptions.window/sinks) against references written here in float64:
dense masked softmax for the exact part, the Taylor recurrence by loops (test_ops.taylor_direct) for the
older tokens, the mixing rule of SPEC §2; and the teacher itself for the first window + sinks tokens."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import tiny_model
from test_convert import calib, ids, incremental_logits
from test_ops import taylor_direct

import linearize
from linearize.eval import capture_attention
from linearize.layers import GDNAttention, GDNOptions
from linearize.models import project_qkv
from linearize.ops.window import sink_window_softmax

f64 = torch.float64


def exact_sets(t: int, window: int, sinks: int) -> tuple[list[int], list[int]]:
    """1-based positions a query at position t sees exactly (sinks ∪ window) and through the state (the rest)."""
    exact = sorted(set(range(1, min(sinks, t) + 1)) | set(range(max(1, t - window + 1), t + 1)))
    return exact, [i for i in range(1, t + 1) if i not in exact]


def dense_sink_window(q, k, v, docs, window, sinks, valid=None):
    """``(o, lse)`` by loops over queries: softmax over each query's exact set inside its document."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    o, lse = torch.zeros(B, T, Hq, D, dtype=f64), torch.full((B, T, Hq), -math.inf, dtype=f64)
    for b in range(B):
        for a, e in docs:
            real = [i for i in range(a, e) if valid is None or valid[b, i]]
            for n, t in enumerate(real, 1):
                keys = [real[p - 1] for p in exact_sets(n, window, sinks)[0] if real[p - 1] <= t]
                keys = [i for i in keys if t - i < window or real.index(i) < sinks]
                for h in range(Hq):
                    s = torch.stack([q[b, t, h].double() @ k[b, i, h // G].double() for i in keys])
                    lse[b, t, h] = torch.logsumexp(s, 0)
                    o[b, t, h] = (s.softmax(0)[:, None] * torch.stack([v[b, i, h // G].double() for i in keys])).sum(0)
    return o, lse


def window_layout(k, v, docs, window):
    """The kernel's layout: W empty slots, then the keys; document ids per key and query."""
    B, T, H, D = k.shape
    doc = torch.zeros(T, dtype=torch.long)
    for n, (a, e) in enumerate(docs):
        doc[a:e] = n
    z = k.new_zeros(B, window, H, D)
    key_doc = torch.cat([torch.full((window,), -1), doc]).expand(B, -1)
    return torch.cat([z, k], 1), torch.cat([z, v], 1), key_doc, doc.expand(B, -1)


@pytest.mark.parametrize("window,T", [(4, 13), (8, 8), (16, 5)])
def test_sink_window_softmax_equals_dense_reference(window, T):
    """No sinks: a band of W keys per query, packed documents apart; values and log-normalizers."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, T, 4, 8, generator=g), torch.randn(2, T, 2, 8, generator=g), torch.randn(2, T, 2, 8, generator=g)
    docs = [(0, T // 2), (T // 2, T)]
    kk, vv, kd, qd = window_layout(k, v, docs, window)
    o, lse = sink_window_softmax(q, kk, vv, kd, qd, window)
    o_ref, lse_ref = dense_sink_window(q, k, v, docs, window, 0)
    assert (o.double() - o_ref).abs().max() < 1e-5 and (lse.double() - lse_ref).abs().max() < 1e-5


def test_sink_window_softmax_gradients():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 9, h, 4, generator=g, dtype=f64, requires_grad=True) for h in (2, 1, 1))
    docs = [(0, 9)]

    def f(q, k, v):
        kk, vv, kd, qd = window_layout(k, v, docs, 3)
        sk, sv = k[:, None, :2].expand(1, 9, 2, 1, 4), v[:, None, :2].expand(1, 9, 2, 1, 4)
        ok = torch.tensor([[[j + 1 <= t + 1 and j <= t - 3 for j in range(2)] for t in range(9)]])
        o, lse = sink_window_softmax(q, kk, vv, kd, qd, 3, sk, sv, ok)
        return o, lse

    assert torch.autograd.gradcheck(f, (q, k, v))


def convert(family, options, seed=0):
    teacher = tiny_model(family, seed=seed)
    model = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib(teacher), options=options)
    return teacher, model


@pytest.mark.parametrize("family,window,sinks", [("llama", 8, 3), ("qwen3", 8, 3), ("gemma3_text", 5, 2)])
def test_window_block_is_the_teacher_for_the_first_window_plus_sinks_tokens(family, window, sinks):
    """Every layer converted: on window + sinks tokens the model is its teacher (to float32 rounding); past
    them the older tokens go through the state, and the logits move off by far more. (The tiny Gemma 3's
    own sliding window is 8 tokens, so it is checked within them.)"""
    teacher, model = convert(family, GDNOptions(window=window, sinks=sinks))
    n = window + sinks
    x = ids(teacher, B=2, T=24)
    with torch.no_grad():
        short = (model(x[:, :n]).logits - teacher(x[:, :n]).logits).abs().max()
        long = (model(x).logits[:, n:] - teacher(x).logits[:, n:]).abs().max()
    assert short < 1e-5 and long > 20 * max(short, 1e-7)


def block_reference(gdn, h, pe, docs):
    """The block on one packed row, independently, in float64: per document and per query, softmax over
    its exact set; the Taylor recurrence (by loops) over the tokens older than its window and sinks,
    fed in order, read with its query; the two mixed by w = σ(lse_E − log n_O − q·k̄_O − bias), and with
    ``mix_order`` 2 the variance of the query's logits over those tokens, halved, in the normalizer too."""
    W, S = gdn.options.window, gdn.options.sinks
    g64 = copy.deepcopy(gdn).double()
    q, k, v = project_qkv(g64, h.double()[None], tuple(x.double() for x in pe))
    G = gdn.num_heads // gdn.num_kv_heads
    out = torch.zeros(h.shape[0], gdn.num_heads, gdn.head_dim, dtype=f64)
    for a, e in docs:
        L = e - a
        qs, ks, vs = q[:, a:e], k[:, a:e], v[:, a:e]
        o_exact, lse = dense_sink_window(qs * gdn.scaling, ks, vs, [(0, L)], W, S)
        n_old = max(L - W - S, 0)
        if n_old:  # step n of the old stream writes token S + n and is read by the query at S + n + W
            o_old = taylor_direct(qs[:, S + W:], ks[:, S:S + n_old], vs[:, S:S + n_old], gdn.scaling, "stable",
                                  rho=g64.rho, beta_max=gdn.options.beta_max)
        for t in range(L):
            n = t + 1 - W - S  # old tokens this query has
            for hq in range(gdn.num_heads):
                if n <= 0:
                    out[a + t, hq] = o_exact[0, t, hq]
                    continue
                logits = gdn.scaling * ks[0, S:S + n, hq // G] @ qs[0, t, hq]
                log_z = math.log(n) + logits.mean() + g64.mix_bias[hq]
                if gdn.options.mix_order == 2:
                    log_z = log_z + logits.var(unbiased=False) / 2
                w = torch.sigmoid(lse[0, t, hq] - log_z)
                out[a + t, hq] = w * o_exact[0, t, hq] + (1 - w) * o_old[0, n - 1, hq]
    return out.flatten(1)


@pytest.mark.parametrize("family,window,sinks,mix_order", [("llama", 4, 2, 1), ("qwen3", 6, 0, 1), ("llama", 3, 5, 1),
                                                            ("llama", 4, 2, 2), ("qwen3", 3, 1, 2)])
def test_window_block_equals_reference_per_document(family, window, sinks, mix_order):
    """Two packed documents per row, a random per-head mix bias: the block's output before o_proj and
    its gradient with respect to the input equal the float64 reference (either order of the mix)."""
    teacher = tiny_model(family)
    x = ids(teacher, B=1, T=30)
    pos = torch.cat([torch.arange(12), torch.arange(18)])[None]
    cap = capture_attention(teacher, x, [1], position_ids=pos)[1]
    gdn = linearize.linearize_layer(teacher.model.layers[1].self_attn,
                                    GDNOptions(window=window, sinks=sinks, mix_order=mix_order),
                                    cap.hidden_states, cap.position_embeddings)
    with torch.no_grad():
        gdn.mix_bias.normal_(0, 1.0)
    h = cap.hidden_states.detach().clone().requires_grad_(True)
    out = gdn.attention_output(h, cap.position_embeddings, pos)[0]
    h64 = h.detach().double()[0].requires_grad_(True)
    ref = block_reference(gdn, h64, cap.position_embeddings, [(0, 12), (12, 30)])
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5
    r = torch.randn_like(ref)
    (gh,) = torch.autograd.grad((out * r.float()).sum(), h)
    (gr,) = torch.autograd.grad((ref * r).sum(), h64)
    assert ((gh[0].double() - gr).norm() / gr.norm()).item() < 1e-4


@pytest.mark.parametrize("prefill", [3, 14])
@pytest.mark.parametrize("keep,mix_order", [(None, 1), ([1], 1), (None, 2)])
def test_window_prefill_and_decode_equal_full_forward(prefill, keep, mix_order):
    """Prefill shorter and longer than window + sinks, then token by token: the full forward's logits; the
    cache holds a fixed number of keys (sinks + window) whatever the length — with the second-order mix,
    also Σkkᵀ of the old keys; beam reordering permutes it."""
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=calib(teacher), keep_softmax=keep,
                              options=GDNOptions(window=5, sinks=2, short_conv=3, output_gate=True, mix_order=mix_order))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GDNAttention):
                m.mix_bias.normal_(0, 0.5)
                m.out_gate.norm_mix.fill_(0.5)
                m.out_gate.gate_proj.weight.normal_(0, 0.1)
    x = ids(model, B=2, T=24)
    mask, pos = torch.ones_like(x), torch.arange(24)[None].expand(2, -1)
    with torch.no_grad():
        full = model(x, attention_mask=mask, use_cache=False).logits  # the fresh (training) path
        inc, cache = incremental_logits(model, x, mask, pos, prefill=prefill)
    assert (inc - full).abs().max() < 1e-4
    buf = cache.layers[0].window_buffers
    assert buf.win_k.shape[1] == 5 and buf.sink_k.shape[1] == 2 and buf.count.tolist() == [24, 24]
    assert buf.sink_index.tolist() == [[0, 1], [0, 1]] and buf.win_pos[0].tolist() == list(range(20, 25))
    kk = cache.layers[0].sums.kk
    assert (kk is None) == (mix_order == 1)
    if kk is not None:  # Σkkᵀ over the 24 - 5 - 2 old keys: symmetric, positive semidefinite, a fixed size
        d = model.model.layers[0].self_attn.head_dim
        assert kk.shape[-2:] == (d, d) and torch.allclose(kk, kk.transpose(-1, -2))
    before = buf.win_k.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].window_buffers.win_k, before[[1, 0]])


@pytest.mark.parametrize("mix_order", [1, 2])
def test_window_left_padding_matches_unpadded(mix_order):
    """A left-padded row decodes as the same row alone: padding is no key, no sink, no position."""
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=calib(teacher),
                              options=GDNOptions(window=4, sinks=2, mix_order=mix_order))
    x = ids(model, B=1, T=16)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), x], 1)
    both = torch.cat([padded, torch.cat([ids(model, B=1, T=21, seed=5)], 1)])
    mask = torch.ones_like(both)
    mask[0, :5] = 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        alone = model(x).logits
        inc, _ = incremental_logits(model, both, mask, pos, prefill=12)
    assert (inc[0, 5:] - alone[0]).abs().max() < 1e-4


@pytest.mark.parametrize("prefill,mix_order", [(6, 1), (14, 1), (14, 2)])
def test_window_mask_with_a_hole_fresh_equals_decoding(prefill, mix_order):
    """A padding slot inside a row (a mask with a hole): the fresh path and decoding agree — the token
    leaving the window at the padded slot still enters the state, with correction factors 1 — and the
    token under the mask changes nothing."""
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=calib(teacher),
                              options=GDNOptions(window=4, sinks=2, mix_order=mix_order))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GDNAttention):
                m.beta_proj.weight.normal_(0, 0.3)
                m.gate_proj.weight.normal_(0, 0.3)
    x = ids(model, B=2, T=20)
    mask = torch.ones_like(x)
    mask[0, 10] = 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    other = x.clone()
    other[0, 10] = (x[0, 10] + 7) % model.config.vocab_size
    with torch.no_grad():
        fresh = model(x, attention_mask=mask, position_ids=pos, use_cache=False).logits
        inc, _ = incremental_logits(model, x, mask, pos, prefill=prefill)
        inc_other, _ = incremental_logits(model, other, mask, pos, prefill=prefill)
    real = mask.bool()
    assert (fresh - inc)[real].abs().max() < 1e-4
    assert (inc - inc_other)[real].abs().max() < 1e-6


def test_window_options_checked_and_off_the_fused_path():
    from linearize.layers.gdn_attention import fused_path

    for bad in (dict(window=-1), dict(sinks=4), dict(window=True), dict(output_gate=1), dict(calibrate_mix=1),
                dict(mix_order=2), dict(window=4, mix_order=3), dict(window=4, mix_order=True)):
        with pytest.raises(ValueError):
            GDNOptions(**bad)
    h = torch.zeros(1, 4, 8)
    assert not fused_path(GDNOptions(window=8, fused_front=True), h)
    assert not fused_path(GDNOptions(output_gate=True, fused_front=True), h)


@pytest.mark.parametrize("order", [1, 2])
def test_normalizer_gap_equals_loops_and_calibration_sets_it(order):
    """The mean normalizer gap per head by loops over queries and heads, against the first-order estimate
    (log n + mean logit) or the second (+ half the logits' variance); convert with calibrate_mix puts it in
    mix_bias (and without, 0); the first-order gap is never negative (Jensen)."""
    from linearize.ops.window import normalizer_gap

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 20, 4, 8, generator=g, dtype=f64), torch.randn(2, 20, 2, 8, generator=g, dtype=f64)
    W, S = 5, 2
    gaps = torch.zeros(4, dtype=f64)
    count = 0
    for b in range(2):
        for t in range(20):
            old = [i for i in range(S, t - W + 1)]
            if not old:
                continue
            count += b == 0
            for h in range(4):
                x = torch.stack([q[b, t, h] @ k[b, i, h // 2] for i in old])
                estimate = math.log(len(old)) + x.mean() + (0.5 * x.var(unbiased=False) if order == 2 else 0)
                gaps[h] += torch.logsumexp(x, 0) - estimate
    ref = gaps / (2 * count)
    got = normalizer_gap(q, k, W, S, order)
    assert (got - ref).abs().max() < 1e-10
    assert order == 2 or bool((got > 0).all())
    teacher = tiny_model("llama")
    opts = dict(window=4, sinks=2, mix_order=order)
    on = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib(teacher), options=GDNOptions(calibrate_mix=True, **opts))
    off = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib(teacher), options=GDNOptions(**opts))
    bias = on.model.layers[0].self_attn.mix_bias
    assert bool((bias > 0).all() if order == 1 else (bias != 0).all()) and not off.model.layers[0].self_attn.mix_bias.any()
    with pytest.raises(ValueError, match="order"):
        normalizer_gap(q, k, W, S, 3)


def flex_against_banded(device, dtype, mask_rows, grads):
    """``[(o, lse, grads)]`` of the banded softmax and of FlexAttention's path on the same real queries."""
    import warnings

    from linearize.ops.window import sink_window_flex
    from linearize.ops.window_inputs import fresh_inputs

    g = torch.Generator().manual_seed(0)
    B, T = (2, 150) if mask_rows else (1, 300)
    q = (torch.randn(B, T, 4, 16, generator=g) * 0.5).to(device, dtype).requires_grad_(grads)
    k, v = (torch.randn(B, T, 2, 16, generator=g).to(device, dtype).requires_grad_(grads) for _ in range(2))
    cu = None if mask_rows else torch.tensor([0, 70, 300], device=device)
    mask = None
    if mask_rows:
        mask = torch.ones(B, T, dtype=torch.bool, device=device)
        mask[1, :9] = False
    outs = []
    for flex in (False, True):
        inp = fresh_inputs(k, v, 16, 3, cu, mask)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if flex:
                o, lse = sink_window_flex(q, k, v, inp.key_doc[:, 16:], inp.query_doc, inp.pos, 16, 3,
                                          compiled=device != "cpu")
            else:
                o, lse = sink_window_softmax(q, inp.k, inp.v, inp.key_doc, inp.query_doc, 16, inp.sink_k, inp.sink_v,
                                             inp.sink_ok)
        real = inp.query_doc >= 0
        d = ()
        if grads:
            r = torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(device)
            d = torch.autograd.grad(((o * r)[real].sum() + lse[real].sum()), (q, k, v))
        outs.append((o[real].detach(), lse[real].detach(), d))
    return outs


@pytest.mark.parametrize("mask_rows", [False, True])
def test_sink_window_flex_equals_banded(mask_rows):
    """FlexAttention's path for fresh sequences (eager on the CPU, which has no backward for it) equals
    the banded softmax on packed documents and on a left-padded batch. Gradients: the gpu test below."""
    (o1, l1, _), (o2, l2, _) = flex_against_banded("cpu", torch.float32, mask_rows, grads=False)
    assert (o1 - o2).abs().max() < 1e-5 and (l1 - l2).abs().max() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("mask_rows", [False, True])
def test_sink_window_flex_compiled_equals_banded_on_gpu(mask_rows, dtype, tol):
    """The compiled FlexAttention kernel (what training on CUDA runs) against the banded softmax in
    float32 on the same inputs: values, log-normalizers and the gradients of q, k, v (relative)."""
    (o1, l1, g1), (o2, l2, g2) = flex_against_banded("cuda", dtype, mask_rows, grads=True)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(o2, o1) < tol and rel(l2, l1) < tol
    assert all(rel(a, b) < tol for a, b in zip(g2, g1))


def test_second_order_mix_from_the_cli_and_recipe(tiny_dir, tmp_path):
    """``--mix-order 2`` saves its option and the converted model reloads to the same logits; without a window
    the CLI says so in one line (exit 2, nothing written) and a recipe names the key."""
    import json

    from test_cli import run

    from linearize.config import load_recipe

    out = tmp_path / "mo2"
    code, text = run("convert", "--model", tiny_dir, "--output", out, "--window", 4, "--sinks", 1, "--mix-order", 2,
                     "--tokens", 64, "--calibration-tokens", 64)
    assert code == 0, text
    assert json.loads((out / "config.json").read_text())["linearize"]["options"]["mix_order"] == 2
    model = linearize.load(out)
    blocks = [m for m in model.modules() if isinstance(m, GDNAttention)]
    assert blocks and all(m.options.mix_order == 2 for m in blocks)
    x = torch.randint(1, 100, (1, 20))
    with torch.no_grad():
        second = model(x).logits
        for m in blocks:
            m.options.mix_order = 1
        first = model(x).logits
    assert torch.equal(second[:, :5], first[:, :5]) and not torch.allclose(second, first)  # equal while t <= W + S
    code, text = run("convert", "--model", tiny_dir, "--output", tmp_path / "bad", "--window", 0, "--mix-order", 2)
    assert code == 2 and "mix-order" in text and not (tmp_path / "bad").exists()
    assert load_recipe(None, [f"teacher.model={tiny_dir}", "convert.window=4", "convert.mix_order=2"]).convert.mix_order == 2
    with pytest.raises(Exception, match="convert.mix_order"):
        load_recipe(None, [f"teacher.model={tiny_dir}", "convert.mix_order=2"])


def test_fresh_layout_is_shared_by_the_layers_of_one_forward_and_follows_its_documents():
    """The index part of ``fresh_inputs`` is laid out once for the same ``cu_seqlens`` (the same tensors
    come back, as the layers of one forward see them), and laid out again for other documents, for the
    same ``cu_seqlens`` written in place, and under inference mode; each equals a layout made afresh."""
    from linearize.ops import window_inputs as wi

    def fresh(cu):
        return wi._layout(1, 40, 8, 2, cu, None, torch.device("cpu"), True)

    def same(a, b):
        return all((x is None and y is None) or torch.equal(x, y) for x, y in
                   zip((a.key_doc, a.query_doc, a.old_ok, a.pos, a.sink_index, a.sink_ok),
                       (b.key_doc, b.query_doc, b.old_ok, b.pos, b.sink_index, b.sink_ok)))

    cu = torch.tensor([0, 13, 40])
    one = wi.fresh_layout(1, 40, 8, 2, cu, None, cu.device)
    assert wi.fresh_layout(1, 40, 8, 2, cu, None, cu.device) is one and same(one, fresh(cu))
    other = torch.tensor([0, 25, 40])
    assert not same(wi.fresh_layout(1, 40, 8, 2, other, None, cu.device), one)
    assert same(wi.fresh_layout(1, 40, 8, 2, other, None, cu.device), fresh(other))
    cu[1] = 30  # in place: the version moves on
    assert same(wi.fresh_layout(1, 40, 8, 2, cu, None, cu.device), fresh(torch.tensor([0, 30, 40])))
    rows = wi.fresh_layout(2, 40, 8, 2, None, None, cu.device)
    assert wi.fresh_layout(2, 40, 8, 2, None, None, cu.device) is rows
    with torch.inference_mode():
        assert wi.fresh_layout(2, 40, 8, 2, None, None, cu.device) is not rows
    assert same(wi.fresh_layout(2, 40, 8, 2, None, None, cu.device), wi._layout(2, 40, 8, 2, None, None, cu.device, True))


def test_flex_block_mask_is_kept_for_the_same_tensors_and_built_again_when_they_change():
    """FlexAttention's block mask is built once for the tensors a forward's layers share, found again
    without reading them back, and built again for other tensors of the same shape (other documents) and
    for the same tensors written in place: the output then equals the banded softmax on those documents (a
    mask kept by mistake would mix the old ones)."""
    import warnings

    from linearize.ops import window as win
    from linearize.ops.window_inputs import fresh_inputs

    g = torch.Generator().manual_seed(0)
    T, W, S = 512, 16, 3  # four of FlexAttention's blocks of 128
    q = torch.randn(1, T, 4, 16, generator=g) * 0.5
    k, v = (torch.randn(1, T, 2, 16, generator=g) for _ in range(2))

    def flex_equals_banded(inp, ref):
        o, lse = win.sink_window_flex(q, k, v, inp.key_doc[:, W:], inp.query_doc, inp.pos, W, S, compiled=False)
        o_ref, lse_ref = win.sink_window_softmax(q, ref.k, ref.v, ref.key_doc, ref.query_doc, W, ref.sink_k,
                                                 ref.sink_v, ref.sink_ok)
        return (o - o_ref).abs().max() < 1e-5 and (lse - lse_ref).abs().max() < 1e-5

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inp = fresh_inputs(k, v, W, S, torch.tensor([0, 256, T]), None, gather_sinks=False)
        first = win._block_mask(inp.key_doc[:, W:], inp.query_doc, inp.pos, W, S, False)
        assert win._block_mask(inp.key_doc[:, W:], inp.query_doc, inp.pos, W, S, False) is first  # another view
        other = fresh_inputs(k, v, W, S, torch.tensor([0, 100, 300, T]), None)  # new tensors, version 0 as well
        assert flex_equals_banded(other, other)
        kept = win._MASK["last"][2]
        assert kept is not first
        # in place, one document: the last block's queries now need the first block's sinks, a block the mask
        # built for three documents does not visit (it reads its tensors when it runs, but which blocks it
        # visits was fixed when it was built; on the CPU FlexAttention runs densely, so the output alone
        # cannot tell: the mask must be a new one)
        new = fresh_inputs(k, v, W, S, None, None)
        for a, b in ((other.key_doc, new.key_doc), (other.query_doc, new.query_doc), (other.pos, new.pos)):
            a.copy_(b)  # the version moves on
        assert win._block_mask(other.key_doc[:, W:], other.query_doc, other.pos, W, S, False) is not kept
        assert flex_equals_banded(other, new)
