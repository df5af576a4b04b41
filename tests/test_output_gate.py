"""OutputGate (linearize/layers/output_gate.py): the identity at init, and against an independent
float64 reference (written here, per head, from the formulas) in output and every gradient."""

import math

import pytest
import torch

from linearize.layers.output_gate import OutputGate

B, T, HIDDEN, H, D = 2, 7, 12, 3, 5


def reference(o, x, weight, bias, norm_weight, norm_mix, eps=1e-6):
    """Float64, head by head: ``n = o_h / sqrt(mean(o_h²) + eps) · w_h``, ``y_h = o_h + λ_h·(n − o_h)``,
    times the gate ``2 / (1 + exp(−(x Wᵀ + b)))``."""
    o, x = o.double(), x.double()
    heads = []
    for h in range(H):
        oh = o[..., h * D:(h + 1) * D]
        rms = torch.sqrt((oh * oh).sum(-1, keepdim=True) / D + eps)
        n = oh / rms * norm_weight[h].double()
        heads.append(oh + norm_mix[h].double() * (n - oh))
    gate = 2.0 / (1.0 + torch.exp(-(x @ weight.double().T + bias.double())))
    return torch.cat(heads, -1) * gate


def randomized(module, seed=1):
    """``module`` with random non-zero parameters (λ on both sides of 0 and 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        module.norm_mix.copy_(torch.tensor([0.3, -0.7, 1.4]))
    return module


def inputs(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(B, T, H * D, generator=gen, dtype=torch.float64) * 3
    x = torch.randn(B, T, HIDDEN, generator=gen, dtype=torch.float64)
    return o.to(dtype), x.to(dtype)


def test_output_gate_parameters_at_init():
    g = OutputGate(HIDDEN, H, D)
    assert isinstance(g.gate_proj, torch.nn.Linear)
    assert g.gate_proj.weight.shape == (H * D, HIDDEN) and g.gate_proj.bias.shape == (H * D,)
    assert not g.gate_proj.weight.any() and not g.gate_proj.bias.any()
    assert torch.equal(g.norm_weight, torch.ones(H, D))
    assert torch.equal(g.norm_mix, torch.zeros(H)) and g.norm_mix.dtype == torch.float32
    assert {n for n, _ in g.named_parameters()} == {"gate_proj.weight", "gate_proj.bias", "norm_weight", "norm_mix"}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_output_gate_is_the_identity_at_init(dtype):
    o, x = inputs(dtype)
    o[0, 0, :D] = 0  # an all-zero head stays zero
    out = OutputGate(HIDDEN, H, D, dtype=dtype)(o, x)
    assert out.dtype == dtype and out.shape == o.shape
    assert torch.equal(out, o)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_output_gate_equals_reference(dtype, tol):
    g = randomized(OutputGate(HIDDEN, H, D, dtype=dtype))
    o, x = inputs(dtype)
    ref = reference(o, x, g.gate_proj.weight, g.gate_proj.bias, g.norm_weight, g.norm_mix)
    out = g(o, x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    # the reference is not trivially near o: the norm and the gate both change it
    assert (ref - o.double()).abs().max() > 0.1


def test_output_gate_bf16_in_bf16_out():
    g = randomized(OutputGate(HIDDEN, H, D, dtype=torch.bfloat16))
    assert g.norm_mix.dtype == torch.float32
    o, x = inputs(torch.bfloat16)
    out = g(o, x)
    assert out.dtype == torch.bfloat16 and out.shape == (B, T, H * D)
    ref = reference(o, x, g.gate_proj.weight, g.gate_proj.bias, g.norm_weight, g.norm_mix)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_output_gate_bf16_norm_in_float32():
    """With the gate at 1, a bf16 output is the float64 reference rounded once to bf16 (±1 ulp): the norm
    and the mix run in float32, not bf16."""
    g = randomized(OutputGate(HIDDEN, H, D, dtype=torch.bfloat16))
    with torch.no_grad():
        g.gate_proj.weight.zero_()
        g.gate_proj.bias.zero_()
    o, x = inputs(torch.bfloat16)
    ref = reference(o, x, g.gate_proj.weight, g.gate_proj.bias, g.norm_weight, g.norm_mix).to(torch.bfloat16)
    torch.testing.assert_close(g(o, x).double(), ref.double(), rtol=2 ** -8, atol=1e-5)


def test_output_gate_gradcheck():
    """float64 gradcheck of every input and parameter, random non-zero parameters."""
    g = randomized(OutputGate(HIDDEN, H, D, dtype=torch.float64)).double()
    o, x = (t.requires_grad_() for t in inputs(torch.float64))
    names = ["gate_proj.weight", "gate_proj.bias", "norm_weight", "norm_mix"]
    params = [dict(g.named_parameters())[n].detach().clone().requires_grad_() for n in names]

    def f(o, x, *ps):
        return torch.func.functional_call(g, dict(zip(names, ps)), (o, x))

    assert torch.autograd.gradcheck(f, (o, x, *params))


def test_output_gate_gradients_equal_reference():
    """Every gradient (o, x, each parameter) equals the float64 reference's, random non-zero parameters."""
    g = randomized(OutputGate(HIDDEN, H, D, dtype=torch.float64)).double()
    o, x = (t.requires_grad_() for t in inputs(torch.float64))
    dy = torch.randn(B, T, H * D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    leaves = [o, x, g.gate_proj.weight, g.gate_proj.bias, g.norm_weight, g.norm_mix]
    got = torch.autograd.grad((g(o, x) * dy).sum(), leaves)
    want = torch.autograd.grad((reference(o, x, *leaves[2:]) * dy).sum(), leaves)
    for name, a, b in zip(["o", "x", "gate_proj.weight", "gate_proj.bias", "norm_weight", "norm_mix"], got, want):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)


def test_output_gate_gradients_at_init():
    """At init the gate and the mix get their gradient; norm_weight none until λ leaves 0."""
    g = OutputGate(HIDDEN, H, D, dtype=torch.float64)
    o, x = inputs(torch.float64)
    dy = torch.randn(B, T, H * D, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (g(o, x) * dy).sum().backward()
    # d/dλ_h = Σ (n − o_h)·dy, d/db = o·dy·2·σ'(0) = o·dy/2, d/dW = (o·dy/2)ᵀ x (by hand, float64)
    oh = o.view(B, T, H, D)
    n = oh / torch.sqrt(oh.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(g.norm_mix.grad, ((n - oh) * dy.view(B, T, H, D)).sum((0, 1, 3)).float())
    torch.testing.assert_close(g.gate_proj.bias.grad, (o * dy / 2).sum((0, 1)))
    torch.testing.assert_close(g.gate_proj.weight.grad, torch.einsum("bto,bti->oi", o * dy / 2, x))
    assert not g.norm_weight.grad.any()


@pytest.mark.parametrize("o_shape, x_shape, bad", [
    ((B, T, H * D + 1), (B, T, HIDDEN), "o"),
    ((B, T, H, D), (B, T, HIDDEN), "o"),
    ((B, T, H * D), (B, T, HIDDEN - 1), "x"),
    ((B, T, H * D), (B, T + 1, HIDDEN), "x"),
])
def test_output_gate_rejects_bad_shapes(o_shape, x_shape, bad):
    g = OutputGate(HIDDEN, H, D)
    with pytest.raises(ValueError, match=f"OutputGate: {bad} must be"):
        g(torch.randn(o_shape), torch.randn(x_shape))


def test_output_gate_sigmoid_scale():
    """A constant gate logit c scales the output by exactly 2σ(c) (e.g. c = ln 3: 2·3/4 = 1.5)."""
    g = OutputGate(HIDDEN, H, D, dtype=torch.float64)
    with torch.no_grad():
        g.gate_proj.bias.fill_(math.log(3.0))
    o, x = inputs(torch.float64)
    torch.testing.assert_close(g(o, x), 1.5 * o, rtol=1e-14, atol=1e-14)
