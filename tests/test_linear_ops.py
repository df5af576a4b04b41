"""The decayed linear attention operator (linearize.ops.linear): the chunkwise form and the decode step
against the recurrent definition, in float64 — output, final state and every gradient."""

from __future__ import annotations

import pytest
import torch

from linearize.ops.linear import (
    linear_attention,
    linear_attention_chunk,
    linear_attention_reference,
    linear_attention_step,
)

f64 = torch.float64


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def inputs(B, T, H, G, K, V, seed, dtype=f64, N=None):
    """Fresh random inputs (never zeros): decays in (0.37, 1), write weights in (0, 1), a random initial
    state for each of N sequences (default B)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * G, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype)
    w = torch.rand(B, T, H, generator=gen, dtype=dtype)
    h0 = torch.randn(N or B, H, K, V, generator=gen, dtype=dtype)
    return q, k, v, g, w, h0


def run_with_grads(fn, q, k, v, g, w, h0, seed=7, **kw):
    """``fn``'s output, final state and the gradients of q, k, v, g, w, h0 under a random loss on both."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, w, h0)]
    o, h = fn(*leaves[:5], initial_state=leaves[5], output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=f64).to(o.dtype)).sum()  # the same weights in any dtype
    loss = loss + (h * torch.randn(h.shape, generator=gen, dtype=f64).to(h.dtype)).sum()
    loss.backward()
    return [o.detach(), h.detach()] + [x.grad for x in leaves]


NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dw", "dh0"]


@pytest.mark.parametrize("B,T,H,G,K,V", [(2, 63, 2, 1, 8, 8), (1, 75, 2, 3, 16, 8), (2, 130, 1, 4, 8, 16),
                                         (1, 1, 2, 2, 8, 8)])
@pytest.mark.parametrize("chunk", [16, 64])
def test_linear_attention_chunk_equals_reference_float64(B, T, H, G, K, V, chunk):
    args = inputs(B, T, H, G, K, V, seed=T + G)
    ref = run_with_grads(linear_attention_reference, *args, scale=0.7)
    got = run_with_grads(lambda *a, **kw: linear_attention_chunk(*a, chunk_size=chunk, **kw), *args, scale=0.7)
    for name, a, b in zip(NAMES, got, ref):
        assert a.dtype == f64 and not a.isnan().any(), name
        assert rel(a, b) <= 1e-10, (name, rel(a, b))


def test_linear_attention_strong_decay_stays_finite():
    """Decays of exp(−30) per step: the chunkwise form never divides by a cumulative decay."""
    q, k, v, g, w, h0 = inputs(1, 100, 2, 2, 8, 8, seed=3)
    g = g * 30 - 1
    ref = run_with_grads(linear_attention_reference, q, k, v, g, w, h0)
    got = run_with_grads(linear_attention_chunk, q, k, v, g, w, h0)
    for name, a, b in zip(NAMES, got, ref):
        assert torch.isfinite(a).all() and rel(a, b) <= 1e-10, (name, rel(a, b))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_attention_exact_with_huge_log_decays(backend):
    """Log-decays near −1e9 (a decay correction run wild): the fp32 chunk form's cumsum differences were off by
    hundreds (output 270% off); floored at −30 (``G_FLOOR``) every backend equals the float64 reference."""
    from linearize.ops.common import G_FLOOR

    q, k, v, g, w, h0 = inputs(1, 130, 2, 1, 16, 16, seed=5)
    g = g.clone()
    g[0, [3, 70, 71, 100], 0] = torch.tensor([-2.4e9, -5e8, -1e3, -1e9], dtype=f64)
    ref = run_with_grads(linear_attention_reference, q, k, v, g, w, h0)
    fp32 = [x.float() for x in (q, k, v, g, w, h0)]
    got = run_with_grads(lambda *a, **kw: linear_attention(*a, backend=backend, **kw), *fp32)
    for name, a, b in zip(NAMES, got, ref):
        a = a.double()
        if name == "dg":  # below the floor the gradient is 0 (the reference's is ~α ≈ 0 there too)
            a, b = a[g > G_FLOOR], b[g > G_FLOOR]
        assert torch.isfinite(a).all() and rel(a, b) <= 1e-5, (name, rel(a, b))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_linear_attention_chunk_low_precision(dtype, tol):
    args64 = inputs(2, 90, 2, 2, 16, 16, seed=5)
    ref = run_with_grads(linear_attention_reference, *args64)
    got = run_with_grads(linear_attention_chunk, *(x.to(dtype) for x in args64))
    for name, a, b in zip(NAMES, got, ref):
        assert rel(a.double(), b) <= tol, (name, rel(a.double(), b))


def test_linear_attention_gqa_equals_repeated_kv_heads():
    """G query heads reading one KV head's state equal G copies of that head, each read by one query head."""
    B, T, H, G, K, V = 2, 70, 2, 3, 8, 8
    q, k, v, g, w, h0 = inputs(B, T, H, G, K, V, seed=11)
    o, h = linear_attention(q, k, v, g, w, initial_state=h0, output_final_state=True)
    rep = lambda x: x.repeat_interleave(G, dim=2)  # noqa: E731  KV head h → query heads h·G … h·G + G − 1
    o2, h2 = linear_attention(q, rep(k), rep(v), rep(g), rep(w), initial_state=h0.repeat_interleave(G, 1),
                              output_final_state=True)
    assert rel(o, o2) <= 1e-12
    assert rel(h, h2[:, ::G]) <= 1e-12


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_linear_attention_packed_equals_documents_run_separately(backend):
    lens = [17, 1, 64, 40]
    T, H, G, K, V = sum(lens), 2, 2, 8, 8
    q, k, v, g, w, h0 = inputs(1, T, H, G, K, V, seed=13, N=len(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    o, h = linear_attention(q, k, v, g, w, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(s, e)
        o_n, h_n = linear_attention_reference(q[:, sl], k[:, sl], v[:, sl], g[:, sl], w[:, sl],
                                              initial_state=h0[n : n + 1], output_final_state=True)
        assert rel(o[:, sl], o_n) <= 1e-12 and rel(h[n : n + 1], h_n) <= 1e-12, n


def test_linear_attention_packed_gradients_equal_reference():
    lens = [30, 5, 70]
    q, k, v, g, w, h0 = inputs(1, sum(lens), 2, 2, 8, 8, seed=17, N=len(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    ref = run_with_grads(linear_attention_reference, q, k, v, g, w, h0, cu_seqlens=cu)
    got = run_with_grads(linear_attention_chunk, q, k, v, g, w, h0, cu_seqlens=cu)
    for name, a, b in zip(NAMES, got, ref):
        assert rel(a, b) <= 1e-10, (name, rel(a, b))


def test_linear_attention_step_by_step_equals_full_sequence():
    B, T, H, G, K, V = 2, 40, 2, 3, 8, 8
    q, k, v, g, w, h0 = inputs(B, T, H, G, K, V, seed=19)
    o, h = linear_attention(q, k, v, g, w, scale=0.5, initial_state=h0, output_final_state=True,
                            v_offset=v.cumsum(1))
    # prefill the first 25 tokens, then one step per token
    o_pre, state = linear_attention(q[:, :25], k[:, :25], v[:, :25], g[:, :25], w[:, :25], scale=0.5,
                                    initial_state=h0, output_final_state=True)
    steps = [o_pre]
    for t in range(25, T):
        o_t, state = linear_attention_step(q[:, t], k[:, t], v[:, t], g[:, t], w[:, t], state, scale=0.5)
        steps.append(o_t[:, None])
    stepped = torch.cat(steps, 1)
    offset = v.cumsum(1).repeat_interleave(G, dim=2)  # v_offset: per KV head, shared by its query heads
    assert rel(stepped + offset, o) <= 1e-12
    assert rel(state, h) <= 1e-12


def test_linear_attention_checks_its_inputs():
    q, k, v, g, w, h0 = inputs(1, 10, 2, 2, 8, 8, seed=0)
    with pytest.raises(ValueError, match=r"w must be \[B, T, H_kv\]"):
        linear_attention(q, k, v, g, w[..., :1])
    with pytest.raises(ValueError, match="backend must be one of auto, torch, triton, reference"):
        linear_attention(q, k, v, g, w, backend="fla")
    with pytest.raises(ValueError, match=r"initial_state must be \[N, H_kv, K, V\]"):
        linear_attention(q, k, v, g, w, initial_state=h0[:, :1])
