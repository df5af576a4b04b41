"""RMSNorm in one Triton pass, for a converted model's inference on CUDA.

transformers' RMSNorm reads the hidden states in float32 and normalizes them in six element-wise launches
(the cast, the square, the mean, the reciprocal square root, the product, the cast back) before the
weight's: about ten passes over a float32 copy of the activations. At a prefill's size that is much of what
a model costs outside its attention (SmolLM2-135M at 32K × 16 tokens on an H100: the kernels launched once
per norm — the casts, the square, the mean, the product — took 0.23 s of the teacher's 2.06 s,
``results/prefill_fused_front_kernels_32kx16_h100.json``; the same work in the converted model).
Here one program reads a block of rows once and writes them once, computing in float32 what the module
computes, in the same order of roundings:

    Llama and most families   y = w · round(x · rsqrt(mean(x²) + ε))      (the product in w's and x's dtype)
    Gemma                     y = round(x · rsqrt(mean(x²) + ε) · (1 + w))

(``round``: to the input's dtype). Only the mean's order of summation differs from PyTorch's reduction, so an
output can differ from the module's by the rounding of one float32 reciprocal square root.

:func:`fuse_norms` puts it on a model (:mod:`.patch`): every RMSNorm module whose forward it recognizes —
checked by computing both formulas against the module on a random input at its first such call, not by its
class's name — takes the kernel where its input is on CUDA, in the weight's dtype, and no gradient is wanted (a
prefill, scoring, decoding, the held-out evaluation in training); elsewhere (training, the CPU, float64, inside
``torch.compile``) the module's own forward runs. ``tests/test_norm.py`` checks it under ``TRITON_INTERPRET=1`` against float64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.common import cdiv, next_pow2
from .patch import fuse, recognized, unfuse, wanted


@triton.jit
def _rms_norm_kernel(x, w, y, rows, eps, N: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                     GEMMA: tl.constexpr):
    o_r = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    o_n = tl.arange(0, BN)
    m = (o_r < rows)[:, None] & (o_n < N)[None, :]
    p = o_r[:, None] * N + o_n[None, :]
    b_x = tl.load(x + p, mask=m, other=0.0).to(tl.float32)
    b_w = tl.load(w + o_n, mask=o_n < N, other=0.0).to(tl.float32)[None, :]
    h = b_x * tl.math.rsqrt(tl.sum(b_x * b_x, 1) / N + eps)[:, None]
    if GEMMA:  # (x · r) · (1 + w) in float32, rounded once
        out = h * (1.0 + b_w)
    else:  # w · round(x · r): the normalized rows rounded to the input's dtype first, as the module does
        out = b_w * h.to(x.dtype.element_ty).to(tl.float32)
    tl.store(y + p, out.to(y.dtype.element_ty), mask=m)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (fp16, bf16 or fp32), as the module computes it: Llama's form,
    in the dtype ``weight · x`` promotes to, or with ``gemma`` Gemma's ``(1 + weight)`` in ``x``'s dtype. No
    gradient."""
    N = x.shape[-1]
    out_dtype = x.dtype if gemma else torch.promote_types(weight.dtype, x.dtype)
    x2 = x.reshape(-1, N)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    rows = x2.shape[0]
    if rows:
        BN = next_pow2(N)
        BR = max(1, min(16, 4096 // BN))  # several short rows a program; one long row a program
        _rms_norm_kernel[(cdiv(rows, BR),)](x2, weight, y, rows, float(eps), N=N, BN=BN, BR=BR, GEMMA=gemma,
                                            num_warps=4 if BN * BR >= 2048 else 2)
    return y.view(*x.shape[:-1], N)


def _eps(module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def norm_form(module: torch.nn.Module) -> str | None:
    """``"llama"`` or ``"gemma"`` where the module is an RMSNorm over its last dimension with a weight of that
    size that computes one of the two forms above (checked on a random float32 input against float32 math),
    else None."""
    w, eps = getattr(module, "weight", None), _eps(module)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or eps is None or w.is_meta:
        return None
    g = torch.Generator().manual_seed(0)  # rows off zero and of three scales: a LayerNorm differs from both forms
    x = (torch.randn(3, w.numel(), generator=g) + 1.5) * torch.tensor([[0.3], [1.0], [4.0]])
    wf = w.detach().float().cpu()
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    try:
        with torch.no_grad():
            got = type(module).forward(module, x.to(w.device, w.dtype)).float().cpu()
    except Exception:  # noqa: BLE001  (a module this does not know how to call is simply left as it is)
        return None
    tol = 1e-5 if w.dtype == torch.float32 else 1e-2
    for form, want in (("llama", wf * h), ("gemma", h * (1 + wf))):
        if got.shape == want.shape and torch.allclose(got, want.to(w.dtype).float(), rtol=tol, atol=tol):
            return form
    return None


KEY = "_fused_norm"  # the instance attribute fuse_norms marks a module with: its form, once recognized


def _fused_forward(self, x, *args, **kwargs):
    # rows in the weight's dtype only: the module's output dtype is then theirs whatever its form casts last
    if x.dtype == self.weight.dtype and wanted(x, args, kwargs):
        form = recognized(self, KEY, norm_form)
        if form:
            return rms_norm_triton(x, self.weight, _eps(self), gemma=form == "gemma")
    return type(self).forward(self, x, *args, **kwargs)


def _candidate(module: torch.nn.Module) -> bool:
    """A 1-D weight and an eps, and no bias and no buffers: not a LayerNorm, GroupNorm or BatchNorm (which
    a probe that normalizes random rows could not always tell apart, and whose running statistics it would
    move)."""
    w = getattr(module, "weight", None)
    return (isinstance(w, torch.Tensor) and w.dim() == 1 and _eps(module) is not None
            and getattr(module, "bias", None) is None and not any(True for _ in module.buffers(recurse=False)))


def fuse_norms(model: torch.nn.Module) -> int:
    """Give every module of ``model`` that may be an RMSNorm (a 1-D weight, an ``eps`` or ``variance_epsilon``,
    no bias, no buffers) the fused forward, on its instance (:mod:`.patch`; :func:`unfuse_norms` takes it
    off). What each computes is checked at its first call on CUDA without gradients (:func:`norm_form`); one
    that is neither form keeps its own forward. Returns how many modules took it."""
    return fuse(model, KEY, _candidate, _fused_forward)


def unfuse_norms(model: torch.nn.Module) -> int:
    """Take :func:`fuse_norms` off again; returns how many modules."""
    return unfuse(model, KEY, _fused_forward)
