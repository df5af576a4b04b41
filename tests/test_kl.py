"""The fused distillation loss (linearize.modules.kl): value and gradient against float64 autograd of the textbook
expression, on the PyTorch path and on the Triton kernel (under TRITON_INTERPRET=1, set in conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from linearize.modules.kl import kl_loss


def reference(s, t, y, T, kl_w, ce_w):
    """float64 autograd: kl_w·Σ T²·KL(softmax(t/T) ‖ softmax(s/T)) + ce_w·Σ CE(s, y)."""
    s = s.double().detach().requires_grad_(True)
    lt, ls = (t.double() / T).log_softmax(-1), (s / T).log_softmax(-1)
    loss = kl_w * T * T * (lt.exp() * (lt - ls)).sum()
    if ce_w is not None:
        loss = loss + ce_w * F.cross_entropy(s, y, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), s.grad


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("T, ce_w, scale", [(1.0, None, 1.0), (2.0, 0.3, 1.0), (0.7, 0.5, 30.0)])
def test_kl_loss_matches_float64_autograd(backend, T, ce_w, scale):
    gen = torch.Generator().manual_seed(int(T * 10) + int(scale))
    R, V = 6, 5000  # two 4096-wide blocks per row, the second ragged
    s = torch.randn(R, V, generator=gen) * scale
    t = torch.randn(R, V, generator=gen) * scale
    y = torch.randint(0, V, (R,), generator=gen)
    y[1] = -100  # an ignored target
    y[2] = V - 1  # the last column
    ref_loss, ref_grad = reference(s, t, y, T, 1 / R, ce_w)
    s_ = s.clone().requires_grad_(True)
    loss = kl_loss(s_, t, y, temperature=T, kl_weight=1 / R, ce_weight=ce_w, backend=backend)
    (loss * 3).backward()  # the stored gradient is scaled by the incoming one
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_.grad.double(), 3 * ref_grad, rtol=1e-4, atol=1e-7)


def test_kl_loss_triton_half_logits():
    """fp16 logits (as bf16 on the GPU; the interpreter's fp16 is exact IEEE): fp32 arithmetic inside, the
    gradient stored in the logits' dtype."""
    gen = torch.Generator().manual_seed(3)
    s, t = (torch.randn(4, 3000, generator=gen) * 4).half(), (torch.randn(4, 3000, generator=gen) * 4).half()
    y = torch.randint(0, 3000, (4,), generator=gen)
    ref_loss, ref_grad = reference(s, t, y, 1.0, 0.25, 0.5)
    s_ = s.clone().requires_grad_(True)
    loss = kl_loss(s_, t, y, kl_weight=0.25, ce_weight=0.5, backend="triton")
    loss.backward()
    assert s_.grad.dtype == torch.float16
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s_.grad.double(), ref_grad, rtol=2e-3, atol=2e-6)


def test_kl_loss_is_zero_with_zero_gradient_when_student_equals_teacher():
    s = torch.randn(3, 700, generator=torch.Generator().manual_seed(0))
    for backend in ("torch", "triton"):
        s_ = s.clone().requires_grad_(True)
        loss = kl_loss(s_, s.clone(), temperature=1.5, backend=backend)
        loss.backward()
        assert abs(loss.item()) < 1e-6 and s_.grad.abs().max().item() < 1e-7


def test_kl_loss_rejects_mismatched_logits():
    with pytest.raises(ValueError, match="one shape"):
        kl_loss(torch.zeros(2, 5), torch.zeros(2, 6))
