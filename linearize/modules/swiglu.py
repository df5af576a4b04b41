"""The gated MLP's ``silu(gate) · up`` in one Triton pass, for a converted model's inference on CUDA.

Llama, Qwen and Mistral compute ``down(silu(gate(x)) · up(x))``: between the projections, transformers runs
the activation and the product as two element-wise launches, the first writing ``silu(gate)`` in full for the
second to read back. Here one pass reads ``gate`` and ``up`` and writes the product, in the module's roundings:
``round(round(silu(g)) · u)``, ``silu(g) = g / (1 + exp(−g))`` in float32 (``round``: to the activations'
dtype). :func:`fuse_mlps` puts it on every such MLP of a model (:mod:`.patch`: recognized at its first call on
CUDA without gradients by what it computes; Gemma's GELU MLPs and any other keep their forward).
``tests/test_swiglu.py`` checks it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.common import cdiv
from .patch import fuse, recognized, unfuse, wanted

BLOCK = 2048
KEY = "_fused_mlp"  # the instance attribute fuse_mlps marks a module with


@triton.jit
def _silu_mul_kernel(g, u, y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_g = tl.load(g + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(u + o, mask=m, other=0.0).to(tl.float32)
    s = (b_g / (1.0 + tl.exp(-b_g))).to(g.dtype.element_ty).to(tl.float32)  # silu, rounded as the module does
    tl.store(y + o, (s * b_u).to(y.dtype.element_ty), mask=m)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` of two tensors of one shape and dtype (fp16, bf16 or fp32), as the module rounds it.
    No gradient."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match: {tuple(gate.shape)} {gate.dtype} against {tuple(up.shape)} {up.dtype}")
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(cdiv(n, BLOCK),)](gate, up, y, n, BLOCK=BLOCK, num_warps=4)
    return y


def _candidate(module: torch.nn.Module) -> bool:
    return all(isinstance(getattr(module, p, None), torch.nn.Module) for p in ("gate_proj", "up_proj", "down_proj")) \
        and callable(getattr(module, "act_fn", None))


def mlp_form(module: torch.nn.Module) -> bool:
    """Whether the module computes ``down(silu(gate(x)) · up(x))``: its ``act_fn`` is SiLU (on a float32 grid,
    to 1e-6: GELU's forms are far off) and its forward, on a random input with its own projections, is that
    formula in PyTorch (to its dtype's rounding)."""
    w = getattr(module.gate_proj, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.is_meta:
        return False
    t = torch.linspace(-8, 8, 257)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    try:
        with torch.no_grad():
            if not torch.allclose(module.act_fn(t), t * torch.sigmoid(t), rtol=1e-6, atol=1e-6):
                return False
            got = type(module).forward(module, x).float()
            g, u = module.gate_proj(x).float(), module.up_proj(x).float()
            want = module.down_proj((g * torch.sigmoid(g) * u).to(w.dtype)).float()
    except Exception:  # noqa: BLE001  (an MLP this does not know how to call keeps its forward)
        return False
    tol = 1e-4 if w.dtype == torch.float32 else 5e-2
    return got.shape == want.shape and torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())


def _fused_forward(self, x, *args, **kwargs):
    if wanted(x, args, kwargs) and recognized(self, KEY, mlp_form):
        return self.down_proj(silu_mul_triton(self.gate_proj(x), self.up_proj(x)))
    return type(self).forward(self, x, *args, **kwargs)


def fuse_mlps(model: torch.nn.Module) -> int:
    """Give every module with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn`` the fused forward, on its
    instance (:func:`unfuse_mlps` takes it off); one that turns out not to be a SiLU-gated MLP keeps its own.
    Returns how many modules took it."""
    return fuse(model, KEY, _candidate, _fused_forward)


def unfuse_mlps(model: torch.nn.Module) -> int:
    """Take :func:`fuse_mlps` off again; returns how many modules."""
    return unfuse(model, KEY, _fused_forward)
