"""The fused gated-MLP activation (``linearize/modules/swiglu.py``): the kernel under TRITON_INTERPRET=1 against
float64 and against the module's own activation and product, what :func:`fuse_mlps` recognizes, and where a
fused model takes it."""

from __future__ import annotations

import copy

import pytest
import torch
from _poison import poisoned_outputs
from conftest import needs_interpreter, tiny_model

from linearize.modules.swiglu import KEY, fuse_mlps, mlp_form, silu_mul_triton, unfuse_mlps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 1536), (2, 3, 100), (4099,)])
def test_silu_mul_kernel_against_float64_and_torch(dtype, shape, device="cpu"):
    """Every element written (outputs NaN-poisoned; 4,099 elements: a partial last block), float32 to 1e-6 of
    float64, and in 16 bits no farther from float64 than PyTorch's ``silu(g) * u`` in that dtype, plus one
    rounding. (bf16 on the GPU only: the interpreter truncates to bf16 where the GPU rounds.)"""
    if device == "cpu":
        needs_interpreter()
    gen = torch.Generator().manual_seed(len(shape))
    g, u = ((torch.randn(shape, generator=gen) * 4).to(device, dtype) for _ in range(2))
    with poisoned_outputs():
        got = silu_mul_triton(g, u)
    theirs = torch.nn.functional.silu(g) * u
    gd, ud = g.double(), u.double()
    want = gd * torch.sigmoid(gd) * ud
    assert got.dtype == dtype and got.shape == g.shape and torch.isfinite(got).all()
    err, err_theirs = (got.double() - want).abs().max(), (theirs.double() - want).abs().max()
    if dtype == torch.float32:
        assert err <= 1e-6 * want.abs().max(), err
    else:
        assert err <= err_theirs + torch.finfo(dtype).eps * want.abs().max(), (err, err_theirs)
        assert (got != theirs).float().mean() < 0.01  # the module's roundings: equal to the bit but for a few


def test_silu_mul_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="must match"):
        silu_mul_triton(torch.zeros(2, 3), torch.zeros(2, 4))


@pytest.mark.parametrize("family, gated", [("llama", True), ("qwen2", True), ("mistral", True), ("gemma3_text", False)])
def test_fuse_mlps_recognizes_silu_mlps_only(family, gated):
    """Llama, Qwen 2 and Mistral's MLPs compute ``down(silu(gate) · up)``; Gemma 3's (GELU) does not and keeps
    its forward, in float32 and in bf16; off CUDA a fused model computes exactly what it did."""
    model = tiny_model(family)
    mlps = [layer.mlp for layer in model.model.layers]
    assert {mlp_form(m) for m in mlps} == {gated}
    assert mlp_form(copy.deepcopy(mlps[0]).to(torch.bfloat16)) == gated  # in bf16 too: the activation decides
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        n = fuse_mlps(model)
        after = model(ids).logits
    assert n == len(mlps) and torch.equal(before, after)
    assert all(m.forward.args[0] is m for m in copy.deepcopy(model).modules() if hasattr(m, KEY))
    assert unfuse_mlps(model) == n and not any("forward" in m.__dict__ for m in mlps)


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fused_modules_take_the_kernels_where_wanted(family, monkeypatch):
    """The whole dispatch on the interpreter, "wanted" made true on the CPU: a converted model's norms and MLPs
    are recognized at their first call (Gemma's MLPs refused) and then run the kernels, whose float32 logits
    are the module's own to 1e-5; with gradients on, the modules' own forwards run."""
    needs_interpreter()
    import linearize
    from linearize.conversion import unfuse_inference_kernels
    from linearize.layers.options import GDNOptions
    from linearize.modules import norm, swiglu
    from linearize.ops.common import TRITON_DTYPES

    calls = []
    for mod, fn in ((norm, "rms_norm_triton"), (swiglu, "silu_mul_triton")):
        monkeypatch.setattr(mod, "wanted",  # as patch.wanted, but on the CPU
                            lambda x, *others: not any(others) and x.dtype in TRITON_DTYPES and not torch.is_grad_enabled())
        real = getattr(mod, fn)
        monkeypatch.setattr(mod, fn, lambda *a, _real=real, _fn=fn, **k: calls.append(_fn) or _real(*a, **k))
    teacher = tiny_model(family)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model = linearize.convert(teacher, calibration_ids=ids, options=GDNOptions(window=4, sinks=2))
    plain = copy.deepcopy(model)
    unfuse_inference_kernels(plain)
    assert not any(hasattr(m, norm.KEY) or hasattr(m, swiglu.KEY) for m in plain.modules())
    with torch.no_grad():
        want, got = plain(ids).logits, model(ids).logits
    assert "rms_norm_triton" in calls and ("silu_mul_triton" in calls) == (family == "llama")
    assert {getattr(m, norm.KEY) for m in model.modules() if hasattr(m, norm.KEY)} == \
        {"gemma" if family == "gemma3_text" else "llama"}
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    calls.clear()
    model(ids).logits.sum().backward()  # training: the modules' own forwards
    assert not calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 1536), (4096, 1536), (4099,)])
def test_silu_mul_kernel_on_gpu(dtype, shape):
    """The same checks on the compiled kernel, bf16 included."""
    test_silu_mul_kernel_against_float64_and_torch(dtype, shape, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_mlps_on_gpu():
    """On CUDA without gradients a fused Llama's MLPs take the kernel (recognized at their first call) and its
    logits are the unfused model's to bf16 rounding; with gradients it takes the module's forward, bit for bit."""
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    fused = copy.deepcopy(model)
    assert fuse_mlps(fused) == len(model.model.layers)
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)).to("cuda")
    with torch.no_grad():
        want, got = model(ids).logits.float(), fused(ids).logits.float()
    assert {getattr(layer.mlp, KEY) for layer in fused.model.layers} == {True}
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(model(ids).logits, fused(ids).logits)  # gradients on: the module's own forward
