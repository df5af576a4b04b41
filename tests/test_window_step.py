"""The fused decode step of the sink + sliding-window block (``linearize.ops.window_step``).

- On real cache states: a tiny model converted with the window block, a (left-padded) batch prefilled
  through it with a ``DynamicCache``, then decoded token by token; at every step the model's own path
  (``_attend_window``, T = 1) is the reference, and copies of the cache layer taken after the prefill go
  on through the step alone: the model's functions composed for one token (bit for bit the model's path),
  the fused step's PyTorch body (to float64 rounding) and its Triton kernel (to float32 rounding); every
  buffer the same.
- On random states of many shapes: the PyTorch body against a dense float64 restatement of the step
  written here (:func:`dense_step`, the module docstring's math), the kernel (TRITON_INTERPRET=1, fp32 and
  fp16 inputs) against the PyTorch body in float64 on the same rounded values; its output NaN-poisoned.
- On a GPU (``gpu`` marker): the compiled kernel in fp32 and bf16, and under a CUDA graph.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import tiny_model
from test_convert import calib, ids
from transformers import DynamicCache

import linearize
from linearize.compat import cache_kwargs
from linearize.layers import GDNAttention, GDNOptions
from linearize.ops.kda import scale_log_decay
from linearize.ops.reference import gated_delta_rule_step
from linearize.ops.taylor import RunningSums, correction_factors, fold_decay, taylor_back, taylor_front
from linearize.ops.window import mix_by_mass, sink_window_softmax
from linearize.ops.window_inputs import WindowBuffers, cached_inputs
from linearize.ops.window_step import sink_window_gdn_step_

f64 = torch.float64
BETA_MAX = 1.0
BUFFERS = ("sink_k", "sink_v", "sink_index", "win_k", "win_v", "win_pos", "tokens", "rows")
ARGS = ("q", "k", "v", "buffers", "state", "sum_k", "sum_v", "count", "rho", "beta_factor", "gate_factor", "mix_bias")


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def run_step(x, window, sinks, backend, decays=True):
    return sink_window_gdn_step_(*(x[n] for n in ARGS), BETA_MAX, window, sinks, decays=decays, backend=backend)


def named(buffers: WindowBuffers) -> dict[str, torch.Tensor]:
    return dict(zip(BUFFERS, buffers.tensors()))


# ---- real states: a converted model, prefilled and decoded --------------------------------------------------
def converted(dtype, window, sinks, target="gdn"):
    """A tiny Llama converted with the window block, its new parameters moved off their identity init."""
    teacher = tiny_model("llama").to(dtype)
    model = linearize.convert(teacher, to=target, calibration_ids=calib(teacher),
                              options=GDNOptions(window=window, sinks=sinks))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, GDNAttention):
                m.mix_bias.normal_(0, 0.5)
                m.beta_proj.weight.normal_(0, 0.3)
                if m.decays:
                    m.gate_proj.weight.normal_(0, 0.3)
    return model


def layer_tensors(layer) -> dict[str, torch.Tensor]:
    s = layer.sums
    return dict(state=layer.state, sum_k=s.k, sum_v=s.v, count=s.count, **named(layer.window_buffers))


def composed_step(q, k, v, buffers, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mix_bias, beta_max,
                  window, sinks, decays=True, eps=1e-12):
    """The step as ``_attend_window`` composes it for one token (``cached_inputs``, ``sink_window_softmax``,
    ``taylor_front``, ``gated_delta_rule_step``, ``taylor_back``, ``mix_by_mass``), the results copied into the
    arguments: the model's own path, which the fused step's PyTorch body must reproduce."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q = q.to(dt)[:, None]  # (N, 1, G·H, D)
    inp, after = cached_inputs(k[:, None], v[:, None], buffers, window, sinks)
    o_exact, lse = sink_window_softmax(q, inp.k, inp.v, inp.key_doc, inp.query_doc, window, inp.sink_k, inp.sink_v,
                                       inp.sink_ok)
    front = taylor_front(q, inp.old_k.to(dt), inp.old_v.to(dt), form="stable", rho=rho.to(dt), beta_max=beta_max,
                         beta_factor=beta_factor.to(dt)[:, None], mask=inp.old_ok,
                         initial=RunningSums(sum_k, sum_v, count), eps=eps)
    front.g = scale_log_decay(front.g, gate_factor.to(dt)[:, None])
    q_old, front = (q, front) if decays else fold_decay(q, front)
    o_old, h = gated_delta_rule_step(q_old[:, 0], front.k[:, 0], front.v[:, 0], front.g[:, 0], front.beta[:, 0], state)
    o_old = taylor_back(o_old[:, None], front.v_mean)
    o = mix_by_mass(o_exact, lse, o_old, q, front.k_mean, front.count, mix_bias)
    for dst, src in zip(buffers.tensors(), after.tensors()):
        dst.copy_(src)
    for dst, src in ((state, h), (sum_k, front.sums.k), (sum_v, front.sums.v), (count, front.sums.count)):
        dst.copy_(src)
    return o[:, 0]


def fused_step(gdn, layer, hidden, pe, backend):
    """The step through :func:`sink_window_gdn_step_` (``backend="composed"``: :func:`composed_step`) on
    ``layer``'s own tensors, from the layer's inputs."""
    q, k, v, _ = gdn.project(hidden, pe)
    dt = torch.float64 if q.dtype == f64 else torch.float32
    beta_factor, gate_factor = correction_factors(*gdn._logits(hidden), dt)
    s, opt = layer.sums, gdn.options
    args = (q[:, 0].to(dt) * gdn.scaling, k[:, 0], v[:, 0], layer.window_buffers, layer.state, s.k, s.v, s.count,
            gdn.rho.to(dt), beta_factor[:, 0], gate_factor[:, 0], gdn.mix_bias, opt.beta_max, opt.window, opt.sinks)
    if backend == "composed":
        return composed_step(*args, decays=gdn.decays)
    return sink_window_gdn_step_(*args, decays=gdn.decays, backend=backend)


def decode_against_model(dtype, window, sinks, prefill, steps, pads, backends, target="gdn", tol=None):
    """Prefill ``len(pads)`` rows (row b left-padded by ``pads[b]``), then decode ``steps`` tokens through the
    model; copies of layer 1's cache layer continue through :func:`composed_step` (bit for bit the model's
    path) and through the fused step on each of ``backends``. Returns the largest errors of each backend
    against the composed step."""
    backends = ("composed", *backends)
    model = converted(dtype, window, sinks, target)
    B, T = len(pads), prefill + steps
    x = ids(model, B=B, T=T)
    mask = torch.ones_like(x)
    for b, p in enumerate(pads):
        mask[b, :p] = 0
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    gdn = model.model.layers[1].self_attn
    for layer in model.model.layers:  # the model decodes through the composed ops: the reference
        layer.self_attn.fused_step = False
    seen = {}
    hooks = [gdn.register_forward_pre_hook(lambda m, a, kw: seen.update(h=kw["hidden_states"],
                                                                         pe=kw["position_embeddings"]),
                                           with_kwargs=True),
             gdn.o_proj.register_forward_pre_hook(lambda m, a: seen.update(o=a[0]))]
    cache = DynamicCache(config=model.config)
    kw = cache_kwargs(cache)
    worst = {b: {"o": 0.0, "state": 0.0, "sum_k": 0.0, "sum_v": 0.0} for b in backends[1:]}
    try:
        with torch.no_grad():
            model(x[:, :prefill], attention_mask=mask[:, :prefill], position_ids=pos[:, :prefill], use_cache=True, **kw)
            ref = cache.layers[1]
            copies = {b: copy.deepcopy(ref) for b in backends}
            for t in range(prefill, T):
                model(x[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1], use_cache=True, **kw)
                want, o_ref = layer_tensors(ref), seen["o"][:, 0].view(B, -1, gdn.head_dim)
                outs = {b: fused_step(gdn, layer, seen["h"], seen["pe"], b) for b, layer in copies.items()}
                for b, o in outs.items():
                    assert o.dtype == (f64 if dtype == f64 else torch.float32)
                    got = layer_tensors(copies[b])
                    exact = tuple(want) if b == "composed" else BUFFERS  # the buffers are copies: bit for bit
                    for name in exact:
                        assert torch.equal(got[name], want[name]), (t, b, name)
                    if b == "composed":
                        assert torch.equal(o.to(dtype), o_ref), t  # the model rounds o to its dtype
                        continue
                    assert torch.isfinite(o).all()
                    errs = {"o": rel(o, outs["composed"]), **{n: rel(got[n], want[n]) for n in ("state", "sum_k", "sum_v")}}
                    assert torch.equal(got["count"], want["count"])
                    assert max(errs.values()) < tol, (t, b, errs)
                    worst[b] = {n: max(worst[b][n], e) for n, e in errs.items()}
    finally:
        for h in hooks:
            h.remove()
    tokens = named(ref.window_buffers)["tokens"]
    assert tokens.tolist() == [T - p for p in pads]  # the decode did cross the window and the sinks
    return worst


MODEL_CASES = [  # (window, sinks, prefill, steps, left padding per row)
    (4, 2, 1, 12, [0, 0]),  # prefill shorter than the sinks: they fill while decoding, then the window fills
    (3, 2, 8, 10, [0, 2, 5]),  # prefill longer than window + sinks, rows ≠ counts
    (3, 5, 2, 12, [0, 1]),  # more sinks than the window
    (1, 0, 4, 8, [0, 3]),  # a window of one token, no sinks
]


@pytest.mark.parametrize("case", MODEL_CASES)
def test_torch_step_equals_the_model_in_float64(case):
    decode_against_model(f64, *case, backends=("torch",), tol=1e-12)


@pytest.mark.parametrize("case", MODEL_CASES)
def test_triton_step_equals_the_model_in_float32(poisoned, case):
    decode_against_model(torch.float32, *case, backends=("torch", "triton"), tol=1e-6)


def test_triton_step_equals_the_model_in_float16(poisoned):
    """fp16 keys, values and window buffers (the model's dtype); the state and the step in float32."""
    decode_against_model(torch.float16, 4, 2, 7, 12, [0, 3], backends=("torch", "triton"), tol=1e-6)


def test_steps_equal_the_model_without_a_decay(poisoned):
    """The ``deltanet`` target: fold_decay's α = 1, u ← t·u and the read with q/t."""
    decode_against_model(f64, 4, 2, 7, 10, [0, 3], backends=("torch",), target="deltanet", tol=1e-12)
    decode_against_model(torch.float32, 4, 2, 7, 10, [0, 3], backends=("torch", "triton"), target="deltanet", tol=1e-6)


# ---- random states -------------------------------------------------------------------------------------------
def random_step(N, H, G, D, W, S, counts, pads, holes=False, seed=0):
    """Float64 inputs of one step: rows of ``counts`` real tokens after ``pads`` padding positions, laid out as
    ``cached_inputs`` leaves them (the window the last W row positions, the sinks the first S real tokens);
    ``holes``: some window slots padding (a mask with holes). Keys share an offset, as real keys do."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=f64)  # noqa: E731
    c, p = torch.tensor(counts), torch.tensor(pads)
    r = c + p
    x = r[:, None] - W + torch.arange(W)  # the row position of each window slot
    win_pos = torch.where(x >= p[:, None], x - p[:, None] + 1, 0)
    if holes:
        win_pos = win_pos * (torch.rand(N, W, generator=gen) > 0.3)
    j = torch.arange(S)
    sink_index = torch.where(j < c[:, None], p[:, None] + j, -1)
    old = (c - W - S).clamp_min(0).to(f64)  # old-stream tokens so far
    spread = old.clamp_min(1).sqrt()[:, None, None]
    buffers = WindowBuffers(rn(N, S, H, D) + 0.5, rn(N, S, H, D), sink_index, rn(N, W, H, D) + 0.5, rn(N, W, H, D),
                            win_pos, c, r)
    return dict(q=rn(N, H * G, D) * D**-0.5, k=rn(N, H, D) + 0.5, v=rn(N, H, D), buffers=buffers,
                state=0.1 * rn(N, H, D, D), sum_k=old[:, None, None] * (0.5 + rn(N, H, D) / spread),
                sum_v=old[:, None, None] * rn(N, H, D) / spread, count=old,
                rho=0.5 + torch.rand(H, generator=gen, dtype=f64), beta_factor=2 * torch.sigmoid(rn(N, H)),
                gate_factor=torch.exp(0.3 * rn(N, H)), mix_bias=rn(H * G))


def cast(x, dtype, state_dtype=torch.float32, device="cpu"):
    """q, k, v and the window buffers' keys/values in ``dtype``; the state, sums and factors in ``state_dtype``."""
    out = {}
    for n, t in x.items():
        if n == "buffers":
            out[n] = WindowBuffers(*(b.to(device, dtype if b.is_floating_point() else b.dtype).clone()
                                     for b in t.tensors()))
        else:
            out[n] = t.to(device, dtype if n in ("q", "k", "v") else state_dtype).clone()
    return out


def dense_step(x, W, S, decays=True, eps=1e-12):
    """The step restated in float64 loops (see ``ops/window_step.py``): ``(o, state, sum_k, sum_v, count, buffers)``."""
    b = x["buffers"]
    N, H, D = x["k"].shape
    G = x["q"].shape[1] // H
    o, state = torch.zeros(N, H * G, D, dtype=f64), x["state"].clone()
    sum_k, sum_v, count = x["sum_k"].clone(), x["sum_v"].clone(), x["count"].clone()
    after = {n: t.clone() for n, t in named(b).items()}
    for n in range(N):
        c, r = int(b.count[n]), int(b.rows[n])
        if c < S and b.sink_index[n, c] < 0:  # the new token becomes sink c
            after["sink_k"][n, c], after["sink_v"][n, c], after["sink_index"][n, c] = x["k"][n], x["v"][n], r
        sinks = [j for j in range(S) if 0 <= int(after["sink_index"][n, j]) <= r - W]
        window = [j for j in range(1, W) if b.win_pos[n, j] > 0]
        m = float(b.win_pos[n, 0] > S)  # the token leaving the window enters the state
        t = float(x["count"][n]) + m
        live, ts = m > 0 and t > 1, max(t, 1.0)
        for h in range(H):
            keys = torch.stack([b.win_k[n, j, h] for j in window] + [x["k"][n, h]] + [b.sink_k[n, j, h] for j in sinks])
            vals = torch.stack([b.win_v[n, j, h] for j in window] + [x["v"][n, h]] + [b.sink_v[n, j, h] for j in sinks])
            k_old, v_old = b.win_k[n, 0, h], b.win_v[n, 0, h]
            sk, sv_before = sum_k[n, h] + m * k_old, sum_v[n, h].clone()
            kc = k_old - sk / ts if live else torch.zeros(D, dtype=f64)
            nk = float(kc.norm())
            khat = kc / max(nk, eps)
            beta = min(max(float(x["rho"][h]) * nk / max(t - 1, 1) * float(x["beta_factor"][n, h]), 0.0), BETA_MAX)
            beta = beta if live else 0.0
            u = nk * (v_old - sv_before / max(t - 1, 1)) / (ts * beta) if beta > 0 else torch.zeros(D, dtype=f64)
            alpha = (1 - 1 / ts) ** float(x["gate_factor"][n, h]) if live and decays else 1.0
            if not decays:
                u = u * ts
            hh = alpha * (torch.eye(D, dtype=f64) - beta * torch.outer(khat, khat)) @ state[n, h]
            state[n, h] = hh + beta * torch.outer(khat, u)
            sum_k[n, h], sum_v[n, h] = sk, sv_before + m * v_old
            for g in range(G):
                qg = x["q"][n, h * G + g]
                logits = keys @ qg
                o_exact, lse = torch.softmax(logits, 0) @ vals, torch.logsumexp(logits, 0)
                o_old = state[n, h].T @ (qg if decays else qg / ts) + sum_v[n, h] / ts
                log_z = math.log(ts) + float(qg @ sk) / ts + float(x["mix_bias"][h * G + g])
                w = 1 / (1 + math.exp(log_z - float(lse))) if t > 0 else 1.0
                o[n, h * G + g] = w * o_exact + (1 - w) * o_old
        count[n] = t
        for name, new, pos in (("win_k", x["k"][n], None), ("win_v", x["v"][n], None), ("win_pos", None, c + 1)):
            after[name][n] = torch.cat([b.tensors()[BUFFERS.index(name)][n, 1:],
                                        (new if new is not None else torch.tensor(pos))[None]])
        after["tokens"][n], after["rows"][n] = c + 1, r + 1
    return o, state, sum_k, sum_v, count, after


CASES = [  # (N, H, G, D, W, S, counts, pads, holes)
    (1, 1, 1, 16, 1, 0, [5], [0], False),  # a window of one, no sinks
    (2, 2, 2, 16, 4, 2, [0, 9], [0, 3], False),  # an empty cache: only the new token; a padded row
    (4, 1, 1, 16, 2, 2, [0, 1, 2, 3], [0, 0, 1, 1], False),  # the sinks filling, then full
    (3, 3, 3, 64, 64, 4, [1, 70, 200], [5, 0, 2], False),  # SmolLM2's shape
    (2, 1, 4, 40, 5, 3, [3, 30], [0, 1], True),  # D not a power of two; padding inside the window
    (2, 2, 1, 32, 3, 7, [4, 20], [2, 0], False),  # more sinks than the window
    (2, 2, 2, 128, 16, 4, [17, 300], [0, 4], True),
    (1, 2, 8, 64, 40, 1, [60], [0], False),  # G = 8; several blocks of window slots
    (1, 1, 2, 256, 4, 1, [12], [3], False),  # Gemma 3's head_dim: several state tiles
]


def check_against(x, ref, W, S, backend, tol, decays=True):
    """One step on ``x`` against ``ref`` = (o, state, sum_k, sum_v, count, buffers); returns the errors."""
    o = run_step(x, W, S, backend, decays)
    assert o.shape == ref[0].shape and torch.isfinite(o).all()
    errs = {"o": rel(o, ref[0]), **{n: rel(x[n], r) for n, r in zip(("state", "sum_k", "sum_v"), ref[1:4])}}
    assert torch.equal(x["count"].double(), ref[4].double())
    for name, t in named(x["buffers"]).items():  # copies, bit for bit
        assert torch.equal(t.cpu().double(), ref[5][name].cpu().double()), name
    assert max(errs.values()) < tol, errs
    return errs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("decays", [True, False])
def test_torch_step_equals_dense_reference(case, decays):
    N, H, G, D, W, S, counts, pads, holes = case
    x = random_step(N, H, G, D, W, S, counts, pads, holes, seed=D + W)
    ref = dense_step(x, W, S, decays)
    check_against(cast(x, f64, f64), ref, W, S, "torch", 1e-13, decays)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("decays", [True, False])
def test_triton_step_equals_torch_step(poisoned, case, dtype, decays):
    """The kernel in float32 against the PyTorch body in float64 on the same rounded inputs, three steps on."""
    N, H, G, D, W, S, counts, pads, holes = case
    x = cast(random_step(N, H, G, D, W, S, counts, pads, holes, seed=3 * D + W), dtype)
    for _ in range(3):  # consecutive launches: the buffers move on, the tickets start from the last reset
        y = cast(x, f64, f64)
        ref = (run_step(y, W, S, "torch", decays), y["state"], y["sum_k"], y["sum_v"], y["count"], named(y["buffers"]))
        check_against(x, ref, W, S, "triton", 1e-6, decays)


def test_auto_is_torch_off_cuda_and_bad_inputs_are_refused():
    x = cast(random_step(2, 2, 2, 16, 4, 2, [3, 9], [0, 1], seed=0), torch.float32)
    assert run_step(x, 4, 2, "auto").dtype == torch.float32
    with pytest.raises(ValueError, match="backend"):
        run_step(x, 4, 2, "cuda")
    with pytest.raises(ValueError, match="window"):
        run_step(x, 0, 2, "torch")
    x = cast(random_step(2, 2, 2, 16, 4, 2, [3, 9], [0, 1], seed=0), torch.float32)
    x["state"] = x["state"].transpose(-1, -2)  # not contiguous: the kernel could not update it in place
    with pytest.raises(ValueError, match="contiguous"):
        run_step(x, 4, 2, "triton")
    x = cast(random_step(2, 2, 2, 16, 4, 2, [3, 9], [0, 1], seed=0), torch.float32)
    with pytest.raises(ValueError, match="win_k"):
        run_step(x, 5, 2, "triton")  # the buffers hold a window of 4


# ---- on a GPU: the compiled kernel ---------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_CASES = [  # many programs at once, so the last-arriver update of each sequence's counters runs concurrently
    (64, 8, 4, 128, 64, 4),
    (8, 3, 3, 64, 64, 4),
    (16, 2, 2, 256, 32, 0),
    (32, 4, 2, 64, 8, 8),
]


def gpu_inputs(case, seed):
    N, H, G, D, W, S = case
    counts = [(i * 7919) % 500 for i in range(N)]  # empty, filling and long rows mixed
    pads = [i % 3 for i in range(N)]
    return random_step(N, H, G, D, W, S, counts, pads, holes=True, seed=seed)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_step_on_gpu(compiled, case, dtype):
    N, H, G, D, W, S = case
    x = cast(gpu_inputs(case, seed=N + D), dtype, device="cuda")
    for _ in range(3):
        y = cast(x, f64, f64, device="cpu")
        ref = (run_step(y, W, S, "torch"), y["state"], y["sum_k"], y["sum_v"], y["count"], named(y["buffers"]))
        o = run_step(x, W, S, "auto")
        assert o.is_cuda and torch.isfinite(o).all()
        assert rel(o.cpu(), ref[0]) < 1e-5
        for n, r in zip(("state", "sum_k", "sum_v"), ref[1:4]):
            assert rel(x[n].cpu(), r) < 1e-5, n
        assert torch.equal(x["count"].cpu().double(), ref[4])
        for name, t in named(x["buffers"]).items():
            assert torch.equal(t.cpu().double(), ref[5][name].double()), name


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_step_in_a_cuda_graph(compiled, dtype):
    """The step captured once and replayed: the same buffers, states and outputs as eager steps."""
    case = (4, 2, 2, 64, 8, 2)
    W, S = case[4], case[5]
    eager, graphed = (cast(gpu_inputs(case, seed=5), dtype, device="cuda") for _ in range(2))
    run_step(graphed, W, S, "triton")  # compiles the kernel and makes the tickets outside the capture
    run_step(eager, W, S, "triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_step(graphed, W, S, "triton")
    for _ in range(12):  # across the window: the shift register and the sinks move on every replay
        graph.replay()
        o = run_step(eager, W, S, "triton")
        torch.cuda.synchronize()
        assert torch.equal(out, o)
        for n in ("state", "sum_k", "sum_v", "count"):
            assert torch.equal(graphed[n], eager[n]), n
        for (name, a), b in zip(named(graphed["buffers"]).items(), eager["buffers"].tensors()):
            assert torch.equal(a, b), name


def test_outgrown_ticket_counters_stay_allocated():
    """The step kernels' ticket counters grow with the batch; the ones a larger batch replaces stay allocated,
    because a CUDA graph captured at the smaller batch still counts on them when it replays."""
    import weakref

    from linearize.ops.triton import decode

    dev = torch.device("cpu")
    small = decode._tickets(dev, 8)
    old, ptr = weakref.ref(small), small.data_ptr()
    del small
    big = decode._tickets(dev, decode._tickets(dev, 8).numel() + 1)
    assert big.numel() > 8 and big.data_ptr() != ptr and not big.any()
    assert old() is not None and old().data_ptr() == ptr
