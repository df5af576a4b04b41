"""The GDN operator and the Taylor front against independent references (float64, CPU).

Each check names its reference: the seed's equations written out as loops here, or the
recurrent definition in ``linearize.ops.reference``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linearize.ops import (
    gated_delta_rule,
    gated_delta_rule_step,
    prefix_mean,
    softmax_attention,
    taylor_attention,
    taylor_front,
    vala_attention,
)

SEEDS = [0, 1, 2]
f64 = torch.float64


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def gdn_inputs(B, T, H, G, K, V, seed, dtype=f64, beta_scale=1.0):
    """Fresh random GDN inputs (never zeros): unit keys, decays in (0.37, 1), β in (0, beta_scale)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * G, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, H, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype) * beta_scale
    return q, k, v, g, beta


def qkv(B, T, H, G, D, seed, dtype=f64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * G, D, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, D, generator=gen, dtype=dtype) + 0.5  # a shared offset, as real keys have
    v = torch.randn(B, T, H, D, generator=gen, dtype=dtype)
    return q, k, v


# (i) seed 000, eq. attn-rnn: softmax attention is an RNN in o for a fixed query ------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_softmax_attention_equals_its_rnn_form(seed):
    q, k, v = qkv(1, 40, 2, 1, 8, seed)
    s = 8**-0.5
    ref = softmax_attention(q, k, v, scale=s)  # (1, T, 2, 8)
    T = q.shape[1]
    for h in range(2):
        for t in range(T):
            qt = q[0, t, h] * s
            o = torch.zeros(8, dtype=f64)
            z = torch.tensor(0.0, dtype=f64)
            for i in range(t + 1):
                w = torch.exp(qt @ k[0, i, h])
                z = z + w
                alpha_ii = w / z  # α_{i,i} = e^{q·k_i} / Z_i
                o = o + alpha_ii * (v[0, i, h] - o)
            torch.testing.assert_close(o, ref[0, t, h], rtol=1e-12, atol=1e-12)


# (ii) seed 000: eq. va-la equals eq. va-la-2 --------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_vala_equals_vala2(seed):
    q, k, v = qkv(2, 50, 2, 3, 8, seed)
    s = 0.3
    out = vala_attention(q, k, v, scale=s)
    # eq. va-la-2, written out: A_t = (1/t) Σ_{i≤t} (v_i − v̄_{i−1})(k_i − k̄_i)ᵀ, o_t = v̄_t + A_t q_t
    B, T, H, D = k.shape
    ref = torch.empty_like(out)
    for b in range(B):
        for h in range(H):
            A = torch.zeros(D, D, dtype=f64)
            ksum = torch.zeros(D, dtype=f64)
            vsum = torch.zeros(D, dtype=f64)
            for t in range(1, T + 1):
                v_prev_mean = vsum / (t - 1) if t > 1 else torch.zeros(D, dtype=f64)
                ksum, vsum = ksum + k[b, t - 1, h], vsum + v[b, t - 1, h]
                A = A * (t - 1) / t + torch.outer(v[b, t - 1, h] - v_prev_mean, k[b, t - 1, h] - ksum / t) / t
                for gq in range(3):
                    ref[b, t - 1, h * 3 + gq] = vsum / t + A @ (s * q[b, t - 1, h * 3 + gq])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


# (iii) the stable Taylor form through the GDN operator equals the A_t recursion of SPEC §2 -----


def taylor_direct(q, k, v, scale, form, rho=None, beta_max=1.0):
    """SPEC §2 literally: A_t = A_{t−1}((1 − 1/t) I − e_t k̂_t k̂_tᵀ) + (1/t) ṽ_t k̃_tᵀ, o_t = v̄_t + A_t q_t.

    seed: e_t = ‖k̃_t‖²/t.  stable: e_t = ρ‖k̃_t‖/t, bounded so that the erase factor
    (1 − 1/t)(1 − β_t) keeps β_t ≤ β_max, i.e. e_t ≤ (1 − 1/t) β_max.
    """
    B, T, Hq, D = q.shape
    H = k.shape[2]
    G = Hq // H
    out = torch.empty(B, T, Hq, v.shape[-1], dtype=f64)
    for b in range(B):
        for h in range(H):
            A = torch.zeros(v.shape[-1], D, dtype=f64)
            ksum = torch.zeros(D, dtype=f64)
            vsum = torch.zeros(v.shape[-1], dtype=f64)
            for t in range(1, T + 1):
                kt, vt = k[b, t - 1, h], v[b, t - 1, h]
                v_prev_mean = vsum / (t - 1) if t > 1 else torch.zeros_like(vsum)
                ksum, vsum = ksum + kt, vsum + vt
                kc, vc = kt - ksum / t, vt - v_prev_mean
                n = kc.norm()
                khat = kc / n if n > 0 else kc
                if form == "seed":
                    e = n * n / t
                else:
                    e = min(rho[h] * n / t, (1 - 1 / t) * beta_max)
                eye = torch.eye(D, dtype=f64)
                A = A @ ((1 - 1 / t) * eye - e * torch.outer(khat, khat)) + torch.outer(vc, kc) / t
                for gq in range(G):
                    out[b, t - 1, h * G + gq] = vsum / t + A @ (scale * q[b, t - 1, h * G + gq])
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("rho_value", [0.3, 5.0])  # small ρ: β stays inside the bound; large: clipped
def test_taylor_attention_stable_equals_direct_recursion(seed, backend, rho_value):
    q, k, v = qkv(2, 70, 2, 3, 8, seed)
    s = 8**-0.5
    rho = torch.tensor([rho_value, 1.7 * rho_value], dtype=f64)
    out = taylor_attention(q, k, v, scale=s, form="stable", rho=rho, beta_max=1.0, backend=backend)
    ref = taylor_direct(q, k, v, s, "stable", rho=rho, beta_max=1.0)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_taylor_attention_seed_form_equals_seed_recursion(seed):
    q, k, v = qkv(1, 30, 2, 2, 8, seed)
    k = 0.1 * k  # the literal seed form only stays finite for small keys
    out = taylor_attention(q, k, v, scale=0.5, form="seed")
    ref = taylor_direct(q, k, v, 0.5, "seed")
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-9)


def test_taylor_front_packed_restarts_every_document():
    q, k, v = qkv(1, 90, 2, 2, 8, 3)
    cu = torch.tensor([0, 20, 21, 64, 90])
    rho = torch.tensor([0.7, 1.1], dtype=f64)
    packed = taylor_attention(q, k, v, cu_seqlens=cu, rho=rho)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        alone = taylor_attention(q[:, s:e], k[:, s:e], v[:, s:e], rho=rho)
        torch.testing.assert_close(packed[:, s:e], alone, rtol=1e-10, atol=1e-10)


def test_prefix_mean_packed_float32_keeps_late_documents_exact():
    """Packed means come from one cumsum over the row minus its value at each document start; done
    in float32 that subtraction would lose ~1e-3 on late documents of a long pack (sums ~3e6)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 30000, 2, dtype=f64, generator=gen) + 100.0
    cu = torch.tensor([0, 7, 5000, 5001, 17000, 29990, 30000])
    packed = prefix_mean(x.float(), cu)
    assert packed.dtype == torch.float32
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        exact = prefix_mean(x[:, s:e])
        assert ((packed[:, s:e].double() - exact).abs() / exact.abs()).max() < 1e-6


def test_taylor_front_float32_gradients_match_float64():
    """k̃ ≡ 0 at each document's first token; its normalization must not leak 1/eps into the gradient
    (it did: float32 gradients of k were garbage at document starts, float64 ones off in the 4th digit)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 90, 2, 8, dtype=f64, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 1, 30, 90])
    rho, w = torch.tensor([0.3, 0.8], dtype=f64), torch.randn(1, 90, 2, 8, dtype=f64, generator=gen)
    grads = {}
    for dt in (f64, torch.float32):
        kk, vv = (x.to(dt).detach().clone().requires_grad_(True) for x in (k, v))
        fr = taylor_front(q.to(dt), kk, vv, rho=rho.to(dt), cu_seqlens=cu)
        ((fr.k.double() * w).sum() + (fr.v.double() * w).sum() + fr.beta.double().sum()).backward()
        grads[dt] = (kk.grad.double(), vv.grad.double())
    for a, b in zip(grads[torch.float32], grads[f64]):
        assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_taylor_front_terms_match_definitions():
    q, k, v = qkv(1, 12, 1, 1, 4, 4)
    front = taylor_front(q, k, v, rho=0.5)
    t = torch.arange(1, 13, dtype=f64)
    kbar = k.cumsum(1) / t[None, :, None, None]
    torch.testing.assert_close(prefix_mean(k), kbar)
    assert front.beta[0, 0, 0] == 0 and front.g[0, 0, 0] == 0  # t = 1: α = 1, β = 0
    torch.testing.assert_close(front.g[0, 1:, 0].exp(), 1 - 1 / t[1:])
    assert torch.all(front.beta <= 1.0) and torch.all(front.beta >= 0)
    torch.testing.assert_close(front.k[0, 1:].norm(dim=-1), torch.ones(11, 1, dtype=f64))


def test_taylor_attention_gradients_are_finite():
    q, k, v = qkv(1, 70, 2, 2, 8, 5)
    for x in (q, k, v):
        x.requires_grad_(True)
    taylor_attention(q, k, v).square().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


# (iv) chunkwise equals the reference: forward, final state, every gradient ---------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_gated_delta_rule_chunk_forward_equals_reference(seed, T):
    q, k, v, g, beta = gdn_inputs(2, T, 2, 3, 16, 8, seed, beta_scale=2.0)
    h0 = torch.randn(2, 2, 16, 8, dtype=f64, generator=torch.Generator().manual_seed(seed + 100))
    kw = dict(initial_state=h0, output_final_state=True)
    o_ref, s_ref = gated_delta_rule(q, k, v, g, beta, backend="reference", **kw)
    o, s = gated_delta_rule(q, k, v, g, beta, backend="torch", **kw)
    assert rel(o, o_ref) < 1e-10 and rel(s, s_ref) < 1e-10


@pytest.mark.parametrize("seed", SEEDS)
def test_gated_delta_rule_chunk_gradients_equal_reference(seed):
    inputs = list(gdn_inputs(1, 80, 2, 2, 8, 8, seed))
    h0 = torch.randn(1, 2, 8, 8, dtype=f64, generator=torch.Generator().manual_seed(seed + 7))
    grads = {}
    for backend in ("reference", "torch"):
        leaves = [x.clone().requires_grad_(True) for x in (*inputs, h0)]
        o, s = gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True, backend=backend)
        gen = torch.Generator().manual_seed(seed + 11)
        (o * torch.randn(o.shape, generator=gen, dtype=f64)).sum().backward(retain_graph=True)
        (s * torch.randn(s.shape, generator=gen, dtype=f64)).sum().backward()
        grads[backend] = [x.grad for x in leaves]
    for name, a, b in zip("q k v g beta h0".split(), grads["torch"], grads["reference"]):
        assert rel(a, b) < 1e-10, name


def test_gated_delta_rule_chunk_gradcheck():
    q, k, v, g, beta = gdn_inputs(1, 9, 1, 2, 3, 2, 5)
    h0 = torch.randn(1, 1, 3, 2, dtype=f64)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta, h0)]

    def f(q, k, v, g, beta, h0):
        o, s = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
        return o, s

    # chunk size 64 > T: exercises padding; a second call with T > 64 is covered by the test above
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


def test_gated_delta_rule_chunk_gradcheck_across_chunks():
    from linearize.ops.chunk import gated_delta_rule_chunk

    q, k, v, g, beta = gdn_inputs(1, 11, 1, 2, 3, 2, 6)
    h0 = torch.randn(1, 1, 3, 2, dtype=f64)
    leaves = [x.requires_grad_(True) for x in (q, k, v, g, beta, h0)]

    def f(q, k, v, g, beta, h0):  # chunk of 4 so that the state crosses three chunk boundaries
        return gated_delta_rule_chunk(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=4)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


# (v) packed sequences equal the same documents run separately ---------------------------------


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_gated_delta_rule_packed_equals_separate(backend):
    q, k, v, g, beta = gdn_inputs(1, 200, 2, 2, 8, 8, 9)
    cu = torch.tensor([0, 1, 65, 130, 131, 200])
    h0 = torch.randn(5, 2, 8, 8, dtype=f64)
    o, s = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, initial_state=h0, output_final_state=True, backend=backend)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        sl = slice(a, b)
        o1, s1 = gated_delta_rule(
            q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=h0[n : n + 1],
            output_final_state=True, backend="reference",
        )
        assert rel(o[:, sl], o1) < 1e-10 and rel(s[n : n + 1], s1) < 1e-10


# (vi) GQA-native equals repeated K/V with one state per query head ------------------------------


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_gated_delta_rule_gqa_equals_repeated_kv(backend):
    G = 3
    q, k, v, g, beta = gdn_inputs(2, 70, 2, G, 8, 8, 4)
    o, s = gated_delta_rule(q, k, v, g, beta, output_final_state=True, backend=backend)
    rep = lambda x: x.repeat_interleave(G, dim=2)  # query head h·G + j reads KV head h
    o_rep, s_rep = gated_delta_rule(q, rep(k), rep(v), rep(g), rep(beta), output_final_state=True, backend="reference")
    assert rel(o, o_rep) < 1e-10
    assert rel(s.repeat_interleave(G, dim=1), s_rep) < 1e-10


# (vii) decode steps reproduce the full-sequence output and final state -------------------------


def test_gated_delta_rule_step_reproduces_full_sequence():
    q, k, v, g, beta = gdn_inputs(2, 40, 2, 3, 8, 4, 12)
    h0 = torch.randn(2, 2, 8, 4, dtype=f64)
    o_full, s_full = gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="torch")
    # prefill the first 25 tokens, then decode one at a time
    o_pre, h = gated_delta_rule(
        q[:, :25], k[:, :25], v[:, :25], g[:, :25], beta[:, :25], initial_state=h0, output_final_state=True
    )
    steps = []
    for t in range(25, 40):
        o_t, h = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], h)
        steps.append(o_t)
    o = torch.cat([o_pre, torch.stack(steps, dim=1)], dim=1)
    assert rel(o, o_full) < 1e-10 and rel(h, s_full) < 1e-10


# input checking --------------------------------------------------------------------------------


def test_gated_delta_rule_rejects_bad_shapes():
    q, k, v, g, beta = gdn_inputs(1, 10, 2, 2, 8, 8, 0)
    with pytest.raises(ValueError, match="multiple of k/v heads"):
        gated_delta_rule(q[:, :, :3], k, v, g, beta)
    with pytest.raises(ValueError, match="beta must be"):
        gated_delta_rule(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 3, 10]))
    with pytest.raises(ValueError, match="initial_state must be"):
        gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 8, 8, dtype=f64))
    with pytest.raises(ValueError, match="backend must be one of"):
        gated_delta_rule(q, k, v, g, beta, backend="cuda")


@pytest.mark.parametrize("cu", [None, [0, 1, 65, 130, 200]])
def test_gated_delta_rule_chunk_bwd_equals_reference_gradients(cu):
    """The hand-written backward (ops/chunk_bwd.py) against autograd through the recurrent definition."""
    from linearize.ops.chunk_bwd import gated_delta_rule_chunk_bwd

    B = 2 if cu is None else 1
    q, k, v, g, beta = gdn_inputs(B, 200, 2, 3, 8, 4, seed=21, beta_scale=2.0)
    cs = torch.tensor(cu) if cu else None
    h0 = torch.randn(B if cu is None else len(cu) - 1, 2, 8, 4, dtype=f64)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, h0)]
    o, ht = gated_delta_rule(*leaves[:5], scale=0.7, initial_state=leaves[5], output_final_state=True,
                             cu_seqlens=cs, backend="reference")
    gen = torch.Generator().manual_seed(3)
    do, dht = torch.randn(o.shape, generator=gen, dtype=f64), torch.randn(ht.shape, generator=gen, dtype=f64)
    torch.autograd.backward([o, ht], [do, dht])
    mine = gated_delta_rule_chunk_bwd(q, k, v, g, beta, 0.7, h0, do, dht, cu_seqlens=cs)
    for name, a, b in zip("q k v g beta h0".split(), mine, leaves):
        assert rel(a, b.grad) < 1e-10, name


@pytest.mark.parametrize("T", [7, 257, 1000])
def test_chunked_time_scan_equals_cumsum(T):
    """The Taylor front's prefix sums run in chunks (ops.taylor._scan): the same values and gradient as
    one float64 cumsum along time, for lengths below, at and past the chunking threshold."""
    from linearize.ops.taylor import _scan

    x = torch.randn(2, T, 3, 4, dtype=f64, requires_grad=True)
    g = torch.randn(2, T, 3, 4, dtype=f64)
    (a,) = torch.autograd.grad((_scan(x) * g).sum(), x)
    (b,) = torch.autograd.grad((x.cumsum(1) * g).sum(), x)
    assert (_scan(x) - x.cumsum(1)).abs().max() < 1e-10 and (a - b).abs().max() < 1e-10
