"""The Triton kernels under TRITON_INTERPRET=1 (set in conftest.py), fp32 and fp16, against the
float64 reference: odd lengths, packed documents, GQA, initial state. Outputs are allocated
NaN-poisoned, so an element the kernels never write fails the test."""

from __future__ import annotations

import pytest
import torch
from test_ops import gdn_inputs, rel

from linearize.ops import gated_delta_rule

CASES = [  # (B, T, H, G, K, V, cu_seqlens)
    (2, 63, 2, 1, 16, 16, None),
    (1, 150, 2, 3, 32, 16, None),  # GQA, three chunks, ragged tail
    (1, 200, 1, 2, 16, 32, [0, 1, 65, 130, 200]),  # packed, a one-token document
    (1, 70, 1, 1, 256, 64, None),  # Gemma 3 head_dim
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_gated_delta_rule_triton_equals_reference(poisoned, case, dtype, tol):
    B, T, H, G, K, V, cu = case
    q, k, v, g, beta = gdn_inputs(B, T, H, G, K, V, seed=T + K, dtype=torch.float64, beta_scale=2.0)
    cu = torch.tensor(cu) if cu else None
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref_o, ref_h = gated_delta_rule(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True,
                                    cu_seqlens=cu, backend="reference")
    o, h = gated_delta_rule(*(x.to(dtype) for x in (q, k, v, g, beta)), scale=0.5, initial_state=h0.float(),
                            output_final_state=True, cu_seqlens=cu, backend="triton")
    assert o.dtype == dtype and h.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    assert rel(o, ref_o) < tol and rel(h, ref_h) < tol


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
def test_gated_delta_rule_triton_gradients_equal_reference(poisoned, case, dtype, tol):
    """The Triton backward kernels: every gradient (q, k, v, g, β, initial state) against float64
    autograd through the reference loop, with a loss on both the output and the final state."""
    B, T, H, G, K, V, cu = case
    inputs = gdn_inputs(B, T, H, G, K, V, seed=T + 7, dtype=torch.float64, beta_scale=2.0)
    cu = torch.tensor(cu) if cu else None
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = {}
    for backend, dt in (("reference", torch.float64), ("triton", dtype)):
        leaves = [x.detach().to(dt).clone().requires_grad_(True) for x in inputs]
        leaves.append(h0.to(torch.float64 if dt == torch.float64 else torch.float32).detach().clone().requires_grad_(True))
        o, h = gated_delta_rule(*leaves[:5], scale=0.7, initial_state=leaves[5], output_final_state=True,
                                cu_seqlens=cu, backend=backend)
        gen = torch.Generator().manual_seed(5)
        loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
        loss = loss + (h.double() * torch.randn(h.shape, generator=gen, dtype=torch.float64)).sum()
        loss.backward()
        grads[backend] = [x.grad for x in leaves]
    for name, a, b in zip("q k v g beta h0".split(), grads["triton"], grads["reference"]):
        assert a.dtype == (dtype if name != "h0" else torch.float32), name
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, (name, rel(a, b))


@pytest.mark.parametrize("case", CASES[:3])
@pytest.mark.parametrize("backend, dtype, tol", [("triton", torch.float32, 1e-5), ("triton", torch.float16, 5e-3),
                                                 ("torch", torch.float32, 1e-5)])
def test_no_decay_equals_zero_log_decays(poisoned, case, backend, dtype, tol):
    """``g=None`` (the deltanet target: α ≡ 1): the kernels read no g and take no exp of it, and give the float64
    reference's output, final state and gradients with ``g = 0``; there is no g gradient."""
    B, T, H, G, K, V, cu = case
    q, k, v, _, beta = gdn_inputs(B, T, H, G, K, V, seed=T + 3, dtype=torch.float64, beta_scale=2.0)
    cu = torch.tensor(cu) if cu else None
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    got = {}
    for name, dt in (("reference", torch.float64), (backend, dtype)):
        leaves = [x.detach().to(dt).clone().requires_grad_(True) for x in (q, k, v, beta)]
        leaves.append(h0.to(torch.float64 if dt == torch.float64 else torch.float32).clone().requires_grad_(True))
        g = torch.zeros_like(beta) if name == "reference" else None
        o, h = gated_delta_rule(*leaves[:3], g, leaves[3], scale=0.7, initial_state=leaves[4],
                                output_final_state=True, cu_seqlens=cu, backend=name)
        gen = torch.Generator().manual_seed(5)
        loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
        (loss + (h.double() * torch.randn(h.shape, generator=gen, dtype=torch.float64)).sum()).backward()
        got[name] = [o.detach(), h.detach()] + [x.grad for x in leaves]
    for name, a, b in zip("o h q k v beta h0".split(), got[backend], got["reference"]):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, (name, rel(a, b))


@pytest.mark.parametrize("case", [CASES[1], CASES[2]])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
def test_triton_output_with_v_offset_equals_taylor_back(poisoned, case, dtype, tol):
    """``v_offset`` (the Taylor back ``+ v̄`` fused into the output kernel): the output and every gradient,
    the offset's included, against float64 ``taylor_back`` over the reference loop; GQA and packed."""
    from linearize.ops import taylor_back
    from linearize.ops.triton import chunk_gated_delta_rule_triton

    B, T, H, G, K, V, cu = case
    inputs = gdn_inputs(B, T, H, G, K, V, seed=T + 3, dtype=torch.float64, beta_scale=2.0)
    vm = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor(cu) if cu else None
    got = {}
    for backend, dt in (("reference", torch.float64), ("triton", dtype)):
        leaves = [x.detach().to(dt).clone().requires_grad_(True) for x in inputs]
        off = vm.to(torch.float64 if dt == torch.float64 else torch.float32).clone().requires_grad_(True)
        if backend == "reference":
            o = taylor_back(gated_delta_rule(*leaves, scale=0.6, cu_seqlens=cu, backend=backend)[0], off)
        else:
            o, _ = chunk_gated_delta_rule_triton(*leaves, scale=0.6, cu_seqlens=cu, v_offset=off)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
        (o.double() * w).sum().backward()
        got[backend] = [o.detach()] + [x.grad for x in leaves] + [off.grad]
    for name, a, b in zip("o q k v g beta v_offset".split(), got["triton"], got["reference"]):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < tol, (name, rel(a, b))
    assert got["triton"][0].dtype == dtype and got["triton"][-1].dtype == torch.float32


GROUP_CASES = [CASES[1], (3, 200, 2, 1, 16, 16, None), (1, 600, 2, 2, 16, 32, [0, 37, 37, 101, 600])]


@pytest.mark.parametrize("group, dtype, tol", [(1, torch.float32, 1e-5), (2, torch.float32, 1e-5),
                                               (3, torch.float32, 1e-5), (8, torch.float32, 1e-5),
                                               (3, torch.float16, 1e-2)])
@pytest.mark.parametrize("case", GROUP_CASES)
def test_triton_output_groups_carry_the_state(poisoned, monkeypatch, case, group, dtype, tol):
    """The output kernel reads one state per ``group`` chunks and carries it across the group's other
    chunks itself: output (with the Taylor back ``v_offset``) and final state against the float64
    reference, on GQA rows, a dense batch of three, and packed documents — one empty, one whose first
    chunk is not a multiple of the group — with groups that end mid-sequence and one-chunk tail groups;
    group 1 is the one-chunk kernel (every state kept); fp16 takes the carry's non-IEEE products."""
    from linearize.ops import taylor_back
    from linearize.ops.triton import chunk_fwd, chunk_gated_delta_rule_triton

    monkeypatch.setattr(chunk_fwd, "output_group", lambda K: group)
    B, T, H, G, K, V, cu = case
    q, k, v, g, beta = gdn_inputs(B, T, H, G, K, V, seed=T + group, dtype=torch.float64, beta_scale=2.0)
    vm = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    cu = torch.tensor(cu) if cu else None
    N = B if cu is None else len(cu) - 1
    h0 = torch.randn(N, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref_o, ref_h = gated_delta_rule(q, k, v, g, beta, scale=0.5, initial_state=h0, output_final_state=True,
                                    cu_seqlens=cu, backend="reference")
    o, h = chunk_gated_delta_rule_triton(*(x.to(dtype) for x in (q, k, v, g, beta)), scale=0.5,
                                         initial_state=h0.float(), output_final_state=True, cu_seqlens=cu,
                                         v_offset=vm.float())
    assert torch.isfinite(o).all() and torch.isfinite(h).all()
    assert rel(o, taylor_back(ref_o, vm)) < tol and rel(h, ref_h) < tol


def test_launch_settings_are_cached_read_only_and_follow_output_group(monkeypatch):
    """The launchers' settings tables are built once per shape and shared, so they are read-only; the output
    group is read on every call, so a changed ``output_group`` (as the group test above patches it) is obeyed."""
    from linearize.ops.triton import chunk_bwd, chunk_fwd

    S = chunk_fwd.launch_settings(16, 1, 128, 128, False)
    assert chunk_fwd.launch_settings(16, 1, 128, 128, False) is S
    assert chunk_bwd.launch_settings(16, 1, 128, 128, False) is chunk_bwd.launch_settings(16, 1, 128, 128, False)
    assert S["output"][1]["E"] == chunk_fwd.output_group(128)
    with pytest.raises(TypeError):
        S["output"][1]["E"] = 1
    with pytest.raises(TypeError):
        S["output"] = S["solve"]
    monkeypatch.setattr(chunk_fwd, "output_group", lambda K: 3)
    assert chunk_fwd.launch_settings(16, 1, 128, 128, False)["output"][1]["E"] == 3


def test_gated_delta_rule_triton_gradients_without_state_inputs(poisoned):
    """No initial state and no final-state gradient: the kernels' other branch."""
    inputs = gdn_inputs(2, 70, 2, 2, 16, 16, seed=11, dtype=torch.float64)
    grads = {}
    for backend, dt in (("reference", torch.float64), ("triton", torch.float32)):
        leaves = [x.detach().to(dt).clone().requires_grad_(True) for x in inputs]
        o, _ = gated_delta_rule(*leaves, backend=backend)
        (o.double() * torch.randn(o.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)).sum().backward()
        grads[backend] = [x.grad for x in leaves]
    for name, a, b in zip("q k v g beta".split(), grads["triton"], grads["reference"]):
        assert rel(a, b) < 1e-5, name


def test_triton_backward_recomputes_t_when_not_given(poisoned):
    """The backward launcher called without the forward's T = (I + A)⁻¹ (``tm=None``) solves for it again;
    its gradients equal those of the float64 reference, as autograd's (which passes T on) do."""
    from linearize.ops.triton.chunk_bwd import chunk_gated_delta_rule_bwd

    B, T, H, G, K, V, cu = CASES[2]
    cu = torch.tensor(cu)
    inputs = gdn_inputs(B, T, H, G, K, V, seed=3, dtype=torch.float64, beta_scale=2.0)
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    o, _ = gated_delta_rule(*leaves, scale=0.7, cu_seqlens=cu, backend="reference")
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (o * do).sum().backward()
    q, k, v, g, beta = (x.float() for x in inputs)
    got = chunk_gated_delta_rule_bwd(q=q, k=k, v=v, g=g, beta=beta, scale=0.7, initial_state=None, do=do.float(),
                                     dht=None, cu_seqlens=cu, tm=None)
    for name, a, x in zip("q k v g beta".split(), got, leaves):
        assert rel(a, x.grad) < 1e-5, name


def test_gated_delta_rule_triton_rejects_float64():
    q, k, v, g, beta = gdn_inputs(1, 8, 1, 1, 16, 16, seed=0)
    with pytest.raises(ValueError, match="Triton backend takes"):
        gated_delta_rule(q, k, v, g, beta, backend="triton")


FRONT_CASES = [  # (B, T, H, K, V, cu_seqlens, beta_factor, rho scale)
    (2, 70, 2, 16, 32, None, True, 1.0),
    (1, 150, 2, 16, 16, [0, 1, 64, 65, 150], True, 1.0),  # packed, one-token documents
    (1, 100, 1, 32, 16, None, False, 20.0),  # β mostly clipped at β_max
    (1, 40, 1, 256, 256, None, True, 1.0),  # Gemma 3 head_dim
    (1, 200, 2, 64, 64, [0, 70, 200], True, 1.0),  # SmolLM2 head size: 32-row sub-blocks, several chunks
    (1, 150, 1, 256, 128, [0, 100, 150], True, 1.0),  # wide heads over several chunks (8-row sub-blocks)
]


@pytest.mark.parametrize("k_mean", [False, True])
@pytest.mark.parametrize("case", FRONT_CASES)
def test_fused_taylor_front_equals_pytorch_front(poisoned, case, k_mean):
    """The fused front kernels (fp32) against the PyTorch front in float64: k̂, u, g, β, v̄ (and k̄, which
    the window block's mix reads) and the gradients of k, v, ρ and the β factor."""
    from linearize.ops.taylor import taylor_front
    from linearize.ops.triton.front import taylor_front_triton

    B, T, H, K, V, cu, with_f, rho_scale = case
    gen = torch.Generator().manual_seed(T + K)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) + 0.3
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    rho = (torch.rand(H, generator=gen, dtype=torch.float64) + 0.5) * rho_scale
    f = 2 * torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64)) if with_f else None
    cu = torch.tensor(cu) if cu else None
    got = {}
    for name, dt in (("torch", torch.float64), ("triton", torch.float32)):
        leaves = [x.to(dt).clone().requires_grad_(True) for x in (k, v, rho) + ((f,) if with_f else ())]
        fk = leaves[3] if with_f else None
        if name == "torch":
            fr = taylor_front(k.new_zeros(B, T, H, K), *leaves[:2], rho=leaves[2], beta_factor=fk, cu_seqlens=cu)
            outs = (fr.k, fr.v, fr.g, fr.beta, fr.v_mean) + ((fr.k_mean,) if k_mean else ())
        else:
            outs = taylor_front_triton(*leaves[:2], leaves[2], 1.0, beta_factor=fk, cu_seqlens=cu, k_mean=k_mean)
            assert len(outs) == 5 + k_mean
        g2 = torch.Generator().manual_seed(9)
        sum((o.double() * torch.randn(o.shape, generator=g2, dtype=torch.float64)).sum() for o in outs).backward()
        got[name] = ([o.detach().double() for o in outs], [x.grad.double() for x in leaves])
    for what, mine, ref in zip("k̂ u g β v̄ k̄".split(), *(got[n][0] for n in ("triton", "torch"))):
        assert torch.isfinite(mine).all() and rel(mine, ref) < 1e-5, what
    for what, mine, ref in zip("dk dv dρ df".split(), *(got[n][1] for n in ("triton", "torch"))):
        assert torch.isfinite(mine).all() and rel(mine, ref) < 1e-5, what


def test_fused_taylor_front_half_precision_inputs(poisoned):
    """fp16 k and v (a half-precision model's path): k̂, u and the gradients of k and v come back in fp16,
    each rounded once from the kernels' float32, within fp16 rounding of the float64 PyTorch front."""
    from linearize.ops.taylor import taylor_front
    from linearize.ops.triton.front import taylor_front_triton

    B, T, H, K, V = 1, 200, 2, 64, 64
    gen = torch.Generator().manual_seed(3)
    k = (torch.randn(B, T, H, K, generator=gen) + 0.3).half()
    v = torch.randn(B, T, H, V, generator=gen).half()
    rho = torch.rand(H, generator=gen) + 0.5
    cu = torch.tensor([0, 70, 200])
    got = {}
    for name, dt in (("torch", torch.float64), ("triton", torch.float16)):
        leaves = [k.to(dt).clone().requires_grad_(True), v.to(dt).clone().requires_grad_(True)]
        r = rho.to(torch.float64 if dt == torch.float64 else torch.float32)
        if name == "torch":
            fr = taylor_front(k.new_zeros(B, T, H, K).double(), *leaves, rho=r, cu_seqlens=cu)
            outs = (fr.k, fr.v, fr.g, fr.beta, fr.v_mean)
        else:
            outs = taylor_front_triton(*leaves, r, 1.0, cu_seqlens=cu)
            assert outs[0].dtype == outs[1].dtype == torch.float16
        g2 = torch.Generator().manual_seed(9)
        sum((o.double() * torch.randn(o.shape, generator=g2, dtype=torch.float64)).sum() for o in outs).backward()
        got[name] = [x.grad for x in leaves] + [outs[0].detach(), outs[1].detach()]
    for what, mine, ref in zip(("dk", "dv", "k̂", "u"), got["triton"], got["torch"]):
        assert mine.dtype == torch.float16 and torch.isfinite(mine).all() and rel(mine, ref) < 2e-3, what


@pytest.mark.parametrize("B, T, H, D, cos_rows", [(2, 37, 3, 16, 2), (1, 50, 9, 64, 1), (3, 5, 1, 256, 3),
                                                  (2, 7, 40, 64, 1)])  # 40 heads: two head blocks
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 2e-3)])
def test_triton_rope_equals_transformers_rope(poisoned, B, T, H, D, cos_rows, dtype, tol):
    """RoPE in one Triton pass against transformers' apply_rotary_pos_emb in float64: output and the
    gradient of x, per-row and shared position embeddings, head counts that are not powers of two."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from linearize.modules.rope import apply_rope_triton, rope_usable

    gen = torch.Generator().manual_seed(B * T + D)
    x = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    ang = torch.rand(cos_rows, T, D // 2, generator=gen, dtype=torch.float64) * 6
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    dy = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    xr = x.to(dtype).double().requires_grad_(True)  # the reference sees the same rounded inputs
    want, _ = apply_rotary_pos_emb(xr, xr, cos.to(dtype).double(), sin.to(dtype).double(), unsqueeze_dim=2)
    want.backward(dy.to(dtype).double())
    xt = x.to(dtype).requires_grad_(True)
    assert rope_usable(xt, cos)
    got = apply_rope_triton(xt, cos, sin)
    got.backward(dy.to(dtype))
    assert got.dtype == dtype and xt.grad.dtype == dtype
    assert rel(got.double(), want) < tol and rel(xt.grad.double(), xr.grad) < tol
    assert not rope_usable(xt, cos[..., : D // 2])  # partial rotary: left to transformers


def _reference_and_backend(inputs, backend="triton", **kw):
    """``{backend: (output, [grads of q, k, v, g, β])}`` of the float64 reference and the fp32 ``backend`` (the
    Triton kernels by default), one random loss on the output."""
    got = {}
    for name, dt in (("reference", torch.float64), (backend, torch.float32)):
        leaves = [x.detach().to(dt).clone().requires_grad_(True) for x in inputs]
        o, _ = gated_delta_rule(*leaves, scale=0.5, backend=name, **kw)
        (o.double() * torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)).sum().backward()
        got[name] = (o.detach(), [x.grad for x in leaves])
    return got


def test_triton_backward_finite_with_strong_decay_in_a_partial_chunk(poisoned):
    """Rows past a document's end read g = 0; with a chunk's log-decay below −88.7 (exp overflows in fp32)
    the masked products must not turn 0·inf into NaN that reaches real rows (packed, partial chunks)."""
    B, T, H, G, K, V = 1, 150, 2, 2, 16, 16
    cu = torch.tensor([0, 40, 150])  # partial chunks: 40 tokens, then 64 + 46
    q, k, v, _, beta = gdn_inputs(B, T, H, G, K, V, seed=21, dtype=torch.float64)
    g = torch.full((B, T, H), -2.5, dtype=torch.float64)  # 40 tokens at −2.5: cumulative −100, exp(100) = inf
    got = _reference_and_backend((q, k, v, g, beta), cu_seqlens=cu)
    for name, a, b in zip("q k v g beta".split(), got["triton"][1], got["reference"][1]):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < 1e-5, (name, rel(a, b))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_chunk_forms_exact_with_huge_log_decays(poisoned, backend, per_channel):
    """Log-decays near −1e9 inside a chunk (a block's decay correction run wild; a GPU test of the window block
    met −2.4e9): in fp32 the in-chunk cumsum differences G_r − G_j are off by hundreds, and the chunkwise forms
    were wrong by 95-180% (the GDN kernels on a GPU: inf). With each token's g floored at −30 (``G_FLOOR``; α < 1e-13)
    they equal the float64 reference, whose exp(−1e9) is exactly 0, output and gradients."""
    from linearize.ops.common import G_FLOOR

    B, T, H, G, K, V = 1, 130, 2, 1, 16, 16
    q, k, v, g, beta = gdn_inputs(B, T, H, G, K, V, seed=5, dtype=torch.float64)
    if per_channel:  # KDA: one log-decay per key channel, the huge ones on a few channels only
        g = g[..., None].repeat(1, 1, 1, K)
    g = g.clone()
    huge = torch.tensor([-2.4e9, -5e8, -1e3, -1e9], dtype=torch.float64)
    if per_channel:
        g[0, [3, 70, 71, 100], 0, :5] = huge[:, None]
    else:
        g[0, [3, 70, 71, 100], 0] = huge
    g[0, 90, 1] = 10 * G_FLOOR
    got = _reference_and_backend((q, k, v, g, beta), backend)
    assert torch.isfinite(got[backend][0]).all() and rel(got[backend][0], got["reference"][0]) < 1e-5
    for name, a, b in zip("q k v g beta".split(), got[backend][1], got["reference"][1]):
        assert torch.isfinite(a).all(), name
        if name == "g":  # below the floor the gradient is 0 (the reference's is ~α ≈ 0 there too)
            assert (a[g < G_FLOOR] == 0).all(), "dg below the floor"
            a, b = a[g > G_FLOOR], b[g > G_FLOOR]
        assert rel(a, b) < 1e-5, (name, rel(a, b))


def test_triton_backend_rejects_key_heads_beyond_its_limit():
    """The state kernels hold at most 256 key dimensions: backend='triton' says so; 'auto' uses PyTorch."""
    q, k, v, g, beta = gdn_inputs(1, 8, 1, 1, 512, 16, seed=0, dtype=torch.float32)
    with pytest.raises(ValueError, match="up to 256"):
        gated_delta_rule(q, k, v, g, beta, backend="triton")
    o, _ = gated_delta_rule(q, k, v, g, beta, backend="auto")  # CPU: torch, as for any CPU tensor
    ref, _ = gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(), backend="reference")
    assert rel(o, ref) < 1e-5


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float16, 1e-3)])
def test_row_squared_errors_equal_float64(poisoned, dtype, tol):
    """The align loss's Triton sums: per row Σ(o − r)² and Σr², and the gradient 2g(o − r), on a strided
    (B, T, L, D) output (one layer's slice is not contiguous) with ragged T and D, against float64."""
    from linearize.modules.rowsq import row_squared_errors

    B, T, L, D = 3, 45, 2, 80
    gen = torch.Generator().manual_seed(8)
    o = torch.randn(B, T, L, D, generator=gen).to(dtype).requires_grad_(True)
    refs = [torch.randn(B, T, D, generator=gen).to(dtype) for _ in range(L)]
    sse, rsq = row_squared_errors(o, refs)
    w = torch.randn(L, B, generator=gen, dtype=torch.float64)
    (sse.double() * w).sum().backward()
    o64 = o.detach().double().requires_grad_(True)
    r64 = torch.stack([r.double() for r in refs], 2)
    want = (o64 - r64).pow(2).sum((1, 3)).T  # (L, B)
    (want * w).sum().backward()
    assert sse.dtype == rsq.dtype == torch.float32 and not rsq.requires_grad and o.grad.dtype == dtype
    assert rel(sse, want) < tol and rel(rsq, r64.pow(2).sum((1, 3)).T) < tol
    assert torch.isfinite(o.grad).all() and rel(o.grad, o64.grad) < tol
    with pytest.raises(ValueError, match="refs must be 2 tensors"):
        row_squared_errors(o, refs[:1])


@pytest.mark.parametrize("group", [1, 2])
def test_output_launches_sliced_past_the_grid_limit(poisoned, monkeypatch, group):
    """More chunks (or chunk groups) than CUDA's 65,535 programs on a grid's second dimension — a prompt of
    4M tokens in one call — go out as several launches, each from its own first chunk: with the limit
    patched down to 2, GDN's output (packed documents, GQA) and the linear operator's equal the float64
    reference, and more than one launch was made."""
    from linearize.ops.linear import linear_attention, linear_attention_reference
    from linearize.ops.triton import chunk_fwd, layout, linear_fwd, output

    monkeypatch.setattr(layout, "GRID_Y_MAX", 2)
    monkeypatch.setattr(chunk_fwd, "output_group", lambda K: group)
    slices = []
    for module in (output, linear_fwd):  # each launcher's own name for it, counted
        monkeypatch.setattr(module, "grid_slices", lambda n: slices.append(layout.grid_slices(n)) or slices[-1])
    B, T, H, G, K, V, cu = CASES[2]
    q, k, v, g, beta = gdn_inputs(B, T, H, G, K, V, seed=7, dtype=torch.float64, beta_scale=2.0)
    cu = torch.tensor(cu)
    ref_o, _ = gated_delta_rule(q, k, v, g, beta, scale=0.5, cu_seqlens=cu, backend="reference")
    o, _ = gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)), scale=0.5, cu_seqlens=cu, backend="triton")
    assert rel(o, ref_o) < 1e-5
    w = torch.rand(B, T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref_l, _ = linear_attention_reference(q, k, v, g, w, scale=0.5, cu_seqlens=cu)
    o_l, _ = linear_attention(q.float(), k.float(), v.float(), g.float(), w.float(), scale=0.5, cu_seqlens=cu,
                              backend="triton")
    assert rel(o_l, ref_l) < 1e-5
    assert len(slices) >= 2 and all(len(s) > 1 and all(n <= 2 for _, n in s) for s in slices)
