"""The Triton mix of the window block's two parts (ops/triton/mix.py) against :func:`linearize.ops.window.mix_by_mass`
composed in PyTorch, in float64 on the same rounded inputs: under the Triton interpreter on the CPU (fp32, fp16
inputs), and compiled on a CUDA GPU (``-m gpu``, bf16 too). The inputs cover what a prefill hands over: tokens
with no old token yet (``n = 0``, the exact part alone), queries that see no key (``lse = −inf``), the learnt
bias and the second-order form's square sums."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_interpreter

from linearize.ops.triton.mix import mix_by_mass_triton
from linearize.ops.window import mix_by_mass

TOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # the output's rounding
CASES = [  # (B, T, H, G, D, with bias, with square sums)
    (2, 37, 3, 3, 64, True, False),  # SmolLM2's heads
    (1, 50, 2, 1, 48, False, False),  # D not a power of two, no GQA
    (2, 20, 1, 4, 128, True, True),
    (1, 9, 2, 2, 256, False, True),  # the widest heads
]


def mix_args(B, T, H, G, D, with_bias, with_squares, seed=0) -> list:
    """``mix_by_mass``'s arguments as a prefill lays them out (float32)."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q = rn(B, T, G * H, D) * 0.3
    k_mean = rn(B, T, H, D) * 0.5
    n = (torch.arange(T) - 6).clamp_min(0).expand(B, T).clone()  # the first 7 tokens have no old token
    if B > 1:  # a second row: a new document half way, whose first 7 tokens have none again
        n[1, T // 2:] = (torch.arange(T - T // 2) - 6).clamp_min(0)
    lse = rn(B, T, G * H) * 2 + 3
    lse[0, 3, 0] = lse[-1, T - 1, -1] = float("-inf")  # queries that see no key (padding)
    bias = rn(G * H) if with_bias else None
    squares = None
    if with_squares:  # Σ (q·k)² over n old tokens: at least n·mean², so the variance is mostly positive
        mean = torch.einsum("bthgd,bthd->bthg", q.view(B, T, H, G, D), k_mean).reshape(B, T, G * H)
        squares = n[..., None] * (mean.square() + rn(B, T, G * H).abs() * 0.5)
        squares[0, T - 1] = 0.0  # a negative variance by rounding: clamped to 0
    return [rn(B, T, G * H, D), lse, rn(B, T, G * H, D), q, k_mean, n, bias, squares]


def check(dtype, device, case, seed=0) -> float:
    args = mix_args(*case, seed)
    # the kernel's inputs: the outputs and q in dtype, lse and the sums in float32, as the block hands them over
    low = [a.to(dtype) if i in (0, 2, 3) else a for i, a in enumerate(args)]
    f64 = [a.double() if torch.is_tensor(a) and a.is_floating_point() else a for a in low]
    ref = mix_by_mass(*f64)
    out = mix_by_mass_triton(*(a.to(device) if torch.is_tensor(a) else a for a in low), out_dtype=dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    out = out.double().cpu()
    assert torch.isfinite(out).all()
    n0 = args[5] == 0  # no old token: the exact part alone, to the output's rounding
    assert torch.allclose(out[n0], low[0][n0].double(), rtol=TOL[dtype], atol=TOL[dtype])
    error = ((out - ref).norm() / ref.norm()).item()
    assert error <= TOL[dtype], error
    return error


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_mix_triton_interpreted_equals_reference(dtype, case, poisoned):
    needs_interpreter()
    check(dtype, "cpu", case)


def test_mix_by_mass_takes_the_kernel_only_without_gradients(monkeypatch):
    """``mix_by_mass`` runs the kernel where no gradient is wanted and Triton runs (here the interpreter with
    ``backend="triton"``), its composed form otherwise — which differentiates."""
    needs_interpreter()
    import linearize.ops.triton.mix as mix

    calls = []
    monkeypatch.setattr(mix, "mix_by_mass_triton", lambda *a, **k: calls.append(1) or torch.zeros(()))
    args = mix_args(*CASES[0])
    with torch.no_grad():
        mix_by_mass(*args, backend="triton")
        mix_by_mass(*args, backend="auto")  # auto: the kernel on CUDA only
    assert calls == [1]
    q = args[3].requires_grad_()
    args[3] = q
    out = mix_by_mass(*args, backend="triton")
    out.sum().backward()
    assert calls == [1] and q.grad is not None and q.grad.abs().sum() > 0


def test_mix_triton_rejects_bad_shapes():
    args = mix_args(*CASES[0])
    with pytest.raises(ValueError, match="do not fit"):
        mix_by_mass_triton(*args[:4], args[4][:, :, :2], *args[5:])
    with pytest.raises(ValueError, match="do not fit"):
        mix_by_mass_triton(*args[:5], args[5][:, 1:], *args[6:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", CASES + [(16, 4096, 3, 3, 64, True, False)], ids=str)
def test_mix_triton_gpu_equals_reference(dtype, case):
    check(dtype, "cuda", case)
