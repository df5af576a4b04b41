"""The Triton kernels compiled for a CUDA GPU, against float64 references on the GPU, on fresh random inputs
(never zeros), with NaN-poisoned outputs so an element a kernel never writes fails.

    TRITON_INTERPRET=0 python -m pytest -q -m "gpu and not slow"   # a few minutes on an H200
    TRITON_INTERPRET=0 python -m pytest -q -m gpu                  # also the long shapes and slow compiles

Skipped without CUDA. ``conftest.py`` turns the Triton interpreter on unless ``TRITON_INTERPRET`` is set,
so on a GPU machine set it to 0. Tolerances (SPEC §7): relative error ``‖out − ref‖/‖ref‖`` of every output
and gradient, fp32 ≤ 1e-5, bf16 ≤ 1e-2; NaN or Inf never passes. The operator's reference is the chunkwise
PyTorch operator in float64 (tested against the recurrent definition on the CPU) on the *same* rounded
inputs, so the error is the kernels' own.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from _poison import poisoned_outputs

from linearize.ops import gated_delta_rule

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
OPERATOR_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
slow = pytest.mark.slow


@pytest.fixture(autouse=True)
def compiled_and_poisoned():
    """The kernels must be compiled (not interpreted) and every buffer their launchers allocate starts as NaN."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 interprets the kernels; run the gpu tests with TRITON_INTERPRET=0")
    with poisoned_outputs():
        yield


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖ in float64; inf where ``a`` holds a NaN or an Inf."""
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item() if torch.isfinite(a).all() else math.inf


def assert_within(errors: dict, tol: float) -> None:
    worst = max(errors.values())
    assert worst <= tol, f"max relative error {worst:.2e} > {tol:.0e}: " + ", ".join(
        f"{k}={v:.1e}" for k, v in errors.items())


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def operator_errors(B, T, H, G, K, V, dtype, beta_mode="uniform", cu=None, grads=True, seed=0, v_offset=False,
                    decay=True):
    """Relative errors of ``o``, the final state and every gradient (with ``v_offset``: the Taylor back fused
    in the output kernel, a float32 ``[B, T, H, V]`` offset, and its gradient; without ``decay``: the kernels
    given ``g=None``, the reference g = 0, and no g gradient)."""
    N = B if cu is None else len(cu) - 1
    gen = _gen(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q = r(B, T, H * G, K)
    k = F.normalize(r(B, T, H, K), dim=-1)  # unit keys, as the Taylor form feeds them
    v = r(B, T, H, V)
    g = -torch.rand(B, T, H, device="cuda", generator=gen) * 0.2 * decay
    beta = {"uniform": torch.rand(B, T, H, device="cuda", generator=gen),
            "bound": torch.ones(B, T, H, device="cuda"),  # β at the stable form's bound β_max = 1
            "bound2": 2 * torch.ones(B, T, H, device="cuda")}[beta_mode]  # erase eigenvalue −1
    inputs = [x.to(dtype) for x in (q, k, v, g, beta)] + [r(N, H, K, V) * 0.1]
    if v_offset:
        inputs.append(torch.randn(B, T, H, V, device="cuda", generator=_gen(seed + 2)))
    cu_t = torch.tensor(cu, device="cuda") if cu is not None else None
    outs = {}
    for name, dt, backend in (("ref", torch.float64, "torch"), ("ours", dtype, "triton")):
        state_dt = torch.float64 if name == "ref" else torch.float32
        leaves = [x.detach().to(dt if i < 5 else state_dt).clone().requires_grad_(grads) for i, x in enumerate(inputs)]
        if not decay and name == "ours":
            leaves[3] = None
        o, ht = gated_delta_rule(*leaves[:5], scale=K**-0.5, initial_state=leaves[5], output_final_state=True,
                                 cu_seqlens=cu_t, backend=backend, v_offset=leaves[6] if v_offset else None)
        got = [o.detach(), ht.detach()]
        if grads:
            g2 = _gen(seed + 1)
            do = torch.randn(o.shape, device="cuda", generator=g2, dtype=torch.float64)
            dht = torch.randn(ht.shape, device="cuda", generator=g2, dtype=torch.float64)
            ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
            got += [x.grad if x is not None else None for x in leaves]
        outs[name] = got
    names = ("o", "ht", *OPERATOR_GRADS, "dv_offset")
    return {n: rel_err(a, b) for n, a, b in zip(names, outs["ours"], outs["ref"]) if a is not None}


STANDARD = [  # SPEC §7's kernel shapes: bf16, H=16, K=V=128
    pytest.param(8, 2048, id="8x2048"), pytest.param(4, 4096, id="4x4096", marks=slow),
    pytest.param(2, 8192, id="2x8192"), pytest.param(1, 16384, id="1x16384", marks=slow),
    pytest.param(1, 32768, id="1x32768", marks=slow),
]


@pytest.mark.parametrize("B, T", STANDARD)
def test_gated_delta_rule_triton_standard_shapes(B, T):
    assert_within(operator_errors(B, T, 16, 1, 128, 128, torch.bfloat16, grads=T <= 8192), TOL[torch.bfloat16])


MODEL_CASES = [  # (B, T, H, G, K, V, cu_seqlens, beta mode) of real teachers and edge cases
    pytest.param(2, 4096, 3, 3, 64, 64, None, "uniform", id="smollm2"),
    pytest.param(1, 4096, 8, 4, 128, 128, None, "uniform", id="llama3-8b"),
    pytest.param(1, 3000, 1, 4, 256, 256, None, "uniform", id="gemma3", marks=slow),  # minutes to compile in fp32
    pytest.param(1, 5000, 4, 2, 64, 64, [0, 1, 63, 64, 65, 2000, 4999, 5000], "uniform", id="packed"),
    pytest.param(2, 1000, 4, 1, 128, 128, None, "bound", id="beta-bound", marks=slow),
    pytest.param(2, 1000, 4, 1, 128, 128, None, "bound2", id="beta-bound2"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B, T, H, G, K, V, cu, beta_mode", MODEL_CASES)
def test_gated_delta_rule_triton_model_shapes(B, T, H, G, K, V, cu, beta_mode, dtype):
    errors = operator_errors(B, T, H, G, K, V, dtype, beta_mode=beta_mode, cu=cu)
    assert_within(errors, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B, T, H, G, K, V, cu", [
    pytest.param(2, 4096, 3, 3, 64, 64, None, id="smollm2"),
    pytest.param(1, 5000, 4, 2, 64, 64, [0, 1, 63, 64, 65, 2000, 4999, 5000], id="packed"),
    pytest.param(2, 8192, 16, 1, 128, 128, None, id="2x8192"),
])
def test_gated_delta_rule_triton_without_decay(B, T, H, G, K, V, cu, dtype):
    """``g=None`` (the deltanet target): the kernels compiled without their decay against the float64 reference
    with g = 0, output, final state and every gradient but g's."""
    errors = operator_errors(B, T, H, G, K, V, dtype, cu=cu, decay=False)
    assert "dg" not in errors and "dq" in errors
    assert_within(errors, TOL[dtype])


@pytest.mark.parametrize("decay", [True, False], ids=["gdn", "deltanet"])
@pytest.mark.parametrize("B, T, H, G, K, V, cu", [
    pytest.param(2, 8192, 16, 1, 128, 128, None, id="2x8192"),  # output groups of 8 read out of every state
    pytest.param(1, 4096, 8, 4, 128, 128, None, id="llama3-8b"),
    pytest.param(1, 5000, 4, 2, 64, 64, [0, 1, 63, 64, 65, 2000, 4999, 5000], id="packed"),
])
def test_gated_delta_rule_triton_kept_forward(monkeypatch, B, T, H, G, K, V, cu, decay):
    """``function.KEEP_FORWARD``: the backward from the forward's W, states and Δ, in bf16, against float64."""
    from linearize.ops.triton import function

    monkeypatch.setattr(function, "KEEP_FORWARD", True)
    assert_within(operator_errors(B, T, H, G, K, V, torch.bfloat16, cu=cu, decay=decay), TOL[torch.bfloat16])


@slow
def test_gated_delta_rule_triton_forward_at_65536_tokens():
    assert_within(operator_errors(1, 65536, 16, 1, 128, 128, torch.bfloat16, grads=False), TOL[torch.bfloat16])


@pytest.mark.parametrize("B, T, H, G, cu", [
    pytest.param(2, 2048, 90, 3, None, id="smollm2-30-layers"),  # every layer's heads side by side
    pytest.param(1, 3000, 6, 3, [0, 1, 700, 2048, 3000], id="packed"),
])
def test_gated_delta_rule_triton_with_v_offset(B, T, H, G, cu):
    """The operator with the Taylor back fused in its output kernel, at the batched align shape."""
    errors = operator_errors(B, T, H, G, 64, 64, torch.bfloat16, cu=cu, v_offset=True)
    assert_within(errors, TOL[torch.bfloat16])


FRONT_CASES = [  # SmolLM2 training rows, packed documents, Llama-3-8B and Gemma head sizes; bf16 k and v
    pytest.param(16, 2048, 3, 64, 64, None, torch.float32, id="smollm2-fp32"),
    pytest.param(1, 32768, 3, 64, 64, [0, 1, 700, 5000, 5001, 20000, 32768], torch.float32, id="packed-fp32"),
    pytest.param(2, 4096, 8, 128, 128, None, torch.float32, id="llama3-8b-fp32"),
    pytest.param(1, 3000, 1, 256, 256, None, torch.float32, id="gemma3-fp32", marks=slow),
    pytest.param(16, 2048, 3, 64, 64, None, torch.bfloat16, id="smollm2-bf16"),
    pytest.param(1, 32768, 3, 64, 64, [0, 1, 700, 5000, 5001, 20000, 32768], torch.bfloat16, id="packed-bf16"),
]


@pytest.mark.parametrize("B, T, H, K, V, cu, dtype", FRONT_CASES)
def test_taylor_front_triton_equals_pytorch_front(B, T, H, K, V, cu, dtype):
    """The fused Taylor front against the PyTorch front in float64: outputs and gradients. ``dtype``: of k and
    v (bf16 is what a bf16 model feeds it: k̂ and u come back in bf16, the rest in float32); the reference
    gets the same rounded k and v. Packed documents also return k̄ (the window block's old stream reads it)."""
    from linearize.ops.taylor import taylor_front
    from linearize.ops.triton.front import taylor_front_triton

    gen = _gen(0)
    k = (torch.randn(B, T, H, K, device="cuda", generator=gen) + 0.3).to(dtype).float()
    v = torch.randn(B, T, H, V, device="cuda", generator=gen).to(dtype).float()
    rho = torch.rand(H, device="cuda", generator=gen) + 0.5
    f = 2 * torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    cu_t = torch.tensor(cu, device="cuda") if cu is not None else None
    got = {}
    for name, dt in (("ref", torch.float64), ("ours", torch.float32)):
        leaves = [x.to(dt if i > 1 or name == "ref" else dtype).clone().requires_grad_(True)
                  for i, x in enumerate((k, v, rho, f))]
        if name == "ref":
            fr = taylor_front(torch.zeros_like(leaves[0]), *leaves[:2], rho=leaves[2], beta_factor=leaves[3],
                              cu_seqlens=cu_t)
            outs = (fr.k, fr.v, fr.g, fr.beta, fr.v_mean) + ((fr.k_mean,) if cu is not None else ())
        else:
            outs = taylor_front_triton(*leaves[:3], 1.0, beta_factor=leaves[3], cu_seqlens=cu_t, k_mean=cu is not None)
        g2 = _gen(1)
        sum((o.double() * torch.randn(o.shape, device="cuda", generator=g2, dtype=torch.float64)).sum()
            for o in outs).backward()
        got[name] = [x.grad for x in leaves] + [o.detach() for o in outs]
    names = ("dk", "dv", "drho", "dbeta_factor", "khat", "u", "g", "beta", "vbar", "kbar")
    assert_within({n: rel_err(a, b) for n, a, b in zip(names, got["ours"], got["ref"])}, TOL[dtype])


@pytest.mark.parametrize("B, T, H, D, dtype", [
    *[pytest.param(16, 2048, H, 64, dt, id=f"smollm2-{H}-heads-{n}")
      for dt, n in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")) for H in (9, 3)],
    pytest.param(1, 4096, 32, 128, torch.bfloat16, id="llama3-8b-q"),
    pytest.param(4, 2048, 270, 64, torch.bfloat16, id="smollm2-30-layers-q"),
])
def test_apply_rope_triton_equals_transformers_rope(B, T, H, D, dtype):
    """RoPE in one Triton pass against transformers' apply_rotary_pos_emb in float64 on the same rounded x,
    cos, sin: output and the gradient of x."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from linearize.modules.rope import apply_rope_triton

    gen = _gen(0)
    x = torch.randn(B, T, H, D, device="cuda", generator=gen).to(dtype)
    ang = torch.arange(T, device="cuda")[:, None] * 10000.0 ** (-torch.arange(0, D, 2, device="cuda") / D)
    cos, sin = (fn(torch.cat([ang, ang], -1))[None].expand(B, T, D).to(dtype) for fn in (torch.cos, torch.sin))
    dy = torch.randn(B, T, H, D, device="cuda", generator=gen).to(dtype)
    xr = x.double().requires_grad_(True)
    want, _ = apply_rotary_pos_emb(xr, xr, cos.double(), sin.double(), unsqueeze_dim=2)
    want.backward(dy.double())
    xt = x.clone().requires_grad_(True)
    got = apply_rope_triton(xt, cos, sin)
    got.backward(dy)
    assert_within({"y": rel_err(got, want), "dx": rel_err(xt.grad, xr.grad)}, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_row_squared_errors_equal_float64(dtype):
    """The align loss's sums on SmolLM2's 30 layers' stacked (B, T, L, D) output, against float64 autograd."""
    from linearize.modules.rowsq import row_squared_errors

    B, T, L, D = 4, 2048, 30, 576
    gen = _gen(0)
    o = torch.randn(B, T, L, D, device="cuda", generator=gen).to(dtype)
    refs = [torch.randn(B, T, D, device="cuda", generator=gen).to(dtype) for _ in range(L)]
    w = torch.randn(L, B, device="cuda", generator=gen, dtype=torch.float64)
    o_ = o.clone().requires_grad_(True)
    sse, rsq = row_squared_errors(o_, refs)
    (sse.double() * w).sum().backward()
    o64 = o.double().requires_grad_(True)
    r64 = torch.stack([r.double() for r in refs], 2)
    want = (o64 - r64).pow(2).sum((1, 3)).T
    (want * w).sum().backward()
    errors = {"sse": rel_err(sse, want.detach()), "ref_sq": rel_err(rsq, r64.pow(2).sum((1, 3)).T),
              "do": rel_err(o_.grad, o64.grad)}
    assert_within(errors, TOL[dtype])


@pytest.mark.parametrize("T, ce_w", [(1.0, None), (2.0, 0.01)], ids=["kl", "kl+ce"])
def test_kl_loss_triton_equals_float64_autograd(T, ce_w):
    """The fused distillation loss on one chunk of SmolLM2-sized bf16 logits (some labels ignored)."""
    from linearize.modules.kl import kl_loss

    R, V = 4096, 49152
    gen = _gen(0)
    s = (torch.randn(R, V, device="cuda", generator=gen) * 3).bfloat16()
    t = (torch.randn(R, V, device="cuda", generator=gen) * 3).bfloat16()
    y = torch.randint(0, V, (R,), device="cuda", generator=gen)
    y[::7] = -100
    s64 = s.double().requires_grad_(True)
    lt, ls = (t.double() / T).log_softmax(-1), (s64 / T).log_softmax(-1)
    ref = (lt.exp() * (lt - ls)).sum() * T * T / R
    if ce_w is not None:
        ref = ref + ce_w * F.cross_entropy(s64, y, ignore_index=-100, reduction="sum")
    ref.backward()
    s_ = s.clone().requires_grad_(True)
    loss = kl_loss(s_, t, y, temperature=T, kl_weight=1 / R, ce_weight=ce_w, backend="triton")
    loss.backward()
    loss_err = abs(loss.item() - ref.item()) / abs(ref.item()) if math.isfinite(loss.item()) else math.inf
    assert_within({"loss": loss_err, "grad": rel_err(s_.grad, s64.grad)}, TOL[torch.bfloat16])
