"""The fused RMSNorm (``linearize/modules/norm.py``): the kernel under TRITON_INTERPRET=1 against float64 and
against the families' own modules, what :func:`fuse_norms` recognizes, and where a fused model takes it."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from _poison import poisoned_outputs
from conftest import needs_interpreter, tiny_model

from linearize.modules.norm import KEY, fuse_norms, norm_form, rms_norm_triton, unfuse_norms


def reference(x, w, eps, form):
    """The module's formula in float64 on the inputs as given (rounded to their dtypes)."""
    x, w = x.double(), w.double()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h * (1 + w) if form == "gemma" else w * h


@pytest.mark.parametrize("form", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(5, 576), (2, 3, 64), (1, 4096), (7, 100)])
def test_rms_norm_kernel_against_float64_and_the_module(form, dtype, shape, device="cpu"):
    """Every row written (outputs NaN-poisoned), float32 to 1e-6 of float64, and in 16 bits no farther from
    float64 than the family's own module in that dtype is, plus one rounding: the kernel computes what the
    module computes, in its order of roundings. (bf16 on the GPU only: the interpreter truncates to bf16
    where the GPU rounds.)"""
    if device == "cpu":
        needs_interpreter()
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(sum(shape))
    N = shape[-1]
    x = (torch.randn(shape, generator=g) * 3).to(device, dtype)
    module = (Gemma3RMSNorm(N, eps=1e-6) if form == "gemma" else LlamaRMSNorm(N, eps=1e-5)).to(device, dtype)
    with torch.no_grad():
        module.weight.copy_((torch.randn(N, generator=g) * 0.5 + (0 if form == "gemma" else 1)).to(device))
    eps = module.eps if form == "gemma" else module.variance_epsilon
    with poisoned_outputs():
        got = rms_norm_triton(x, module.weight, eps, gemma=form == "gemma")
    with torch.no_grad():
        theirs = module(x)
    want = reference(x, module.weight, eps, form)
    assert got.dtype == theirs.dtype == dtype and got.shape == x.shape
    assert torch.isfinite(got).all()
    err, err_theirs = (got.double() - want).abs().max(), (theirs.double() - want).abs().max()
    if dtype == torch.float32:
        assert err <= 1e-6 * want.abs().max(), err
    else:
        ulp = torch.finfo(dtype).eps * want.abs().max()
        assert err <= err_theirs + ulp, (err, err_theirs)
        # the same roundings: all but a few elements equal the module's to the bit
        assert (got != theirs).float().mean() < 0.01


def test_rms_norm_promotes_like_the_module():
    """Llama's ``weight · x.to(dtype)``: a float32 weight on fp16 rows gives float32, as the module does."""
    needs_interpreter()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(32)
    x = torch.randn(3, 32).to(torch.float16)
    got = rms_norm_triton(x, module.weight, module.variance_epsilon)
    with torch.no_grad():
        theirs = module(x)
    assert got.dtype == theirs.dtype == torch.float32
    assert torch.allclose(got, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3_text"])
def test_fuse_norms_recognizes_every_family(family):
    """Each family's norms are recognized by what they compute (Gemma's as ``(1 + w)``), Qwen 3's per-head
    q/k norms too; a LayerNorm is not; and off CUDA a fused model computes exactly what it did."""
    model = tiny_model(family)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and {norm_form(m) for m in norms} == {"gemma" if family == "gemma3_text" else "llama"}
    assert norm_form(torch.nn.LayerNorm(8)) is None and norm_form(torch.nn.Linear(8, 8)) is None
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(ids).logits
        n = fuse_norms(model)
        after = model(ids).logits
    assert n == len(norms) and {id(m) for m in model.modules() if hasattr(m, KEY)} == {id(m) for m in norms}
    assert torch.equal(before, after)  # the CPU takes the module's own forward
    assert fuse_norms(model) == n  # again: the same modules, not fused twice
    fused = copy.deepcopy(model)  # each copy's forward is bound to the copy
    assert all(m.forward.args[0] is m for m in fused.modules() if hasattr(m, KEY))
    buffer = io.BytesIO()  # and to the loaded model, pickled whole
    torch.save(fused, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    assert all(m.forward.args[0] is m for m in loaded.modules() if hasattr(m, KEY))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
    assert unfuse_norms(model) == n and not any("forward" in m.__dict__ for m in norms)


def test_other_norms_are_left_alone():
    """A LayerNorm, a GroupNorm and a BatchNorm (bias, running statistics) are no candidates, and the probe
    tells a BatchNorm's and a LayerNorm's outputs from RMSNorm's even in bf16 over 8,192 channels; a forward
    set on a module's instance since fusing stays when unfusing."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.GroupNorm(4, 64), torch.nn.BatchNorm1d(64))
    assert fuse_norms(model) == 0
    for module in (torch.nn.BatchNorm1d(8192).eval(), torch.nn.LayerNorm(8192, bias=False)):
        assert norm_form(module.to(torch.bfloat16)) is None, module
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = torch.nn.Sequential(LlamaRMSNorm(8))
    assert fuse_norms(norm) == 1
    norm[0].forward = lambda x: x  # someone else's, set later
    assert unfuse_norms(norm) == 0 and "forward" in norm[0].__dict__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 576), (4096, 576), (2, 3, 64), (1, 4096), (7, 100)])
def test_rms_norm_kernel_on_gpu(form, dtype, shape):
    """The same checks on the compiled kernel, bf16 included."""
    test_rms_norm_kernel_against_float64_and_the_module(form, dtype, shape, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_fused_norms_on_gpu(family):
    """On CUDA without gradients a fused model's norms take the kernel (recognized at their first call) and its
    logits are the unfused model's to bf16 rounding; with gradients it takes the module's forward, bit for bit."""
    model = tiny_model(family).to("cuda", torch.bfloat16)
    fused = copy.deepcopy(model)
    assert fuse_norms(fused) > 0
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0)).to("cuda")
    with torch.no_grad():
        want, got = model(ids).logits.float(), fused(ids).logits.float()
    forms = {getattr(m, KEY) for m in fused.modules() if type(m).__name__.endswith("RMSNorm")}
    assert forms == {"gemma" if family == "gemma3_text" else "llama"}
    assert ((got - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(model(ids).logits, fused(ids).logits)  # gradients on: the module's own forward
