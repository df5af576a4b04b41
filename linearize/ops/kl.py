"""The distillation loss on one chunk of logits, with its gradient computed in the forward.

For student logits ``s`` and teacher logits ``t`` (rows of the vocabulary), temperature ``T`` and labels
``y`` (−100: none), the loss of a chunk is

    kl_weight · Σ_rows T² KL(softmax(t/T) ‖ softmax(s/T))  +  ce_weight · Σ_rows CE(s, y)

and its gradient with respect to ``s`` is ``kl_weight·T·(p_s − p_t) + ce_weight·(softmax(s) − onehot(y))``.
Autograd of the textbook expression keeps several float32 copies of every ``[rows, vocab]`` tile alive
until the backward (the float cast, both log-softmaxes, ``p_t``); here the forward computes the gradient
at once and keeps only it, in the logits' dtype. On CUDA one Triton kernel does it in two passes over
each row (:mod:`linearize.ops.triton.kl`); elsewhere PyTorch does the same arithmetic in float32.
"""

from __future__ import annotations

import torch


def kl_loss_rows_torch(s, t, labels, temperature: float, kl_weight: float, ce_weight):
    """The PyTorch path of :func:`linearize.ops.triton.kl.kl_loss_rows` (same returns)."""
    s32, t32 = s.float(), t.float()
    lps = torch.log_softmax(s32 / temperature, -1)
    lpt = torch.log_softmax(t32 / temperature, -1)
    pt = lpt.exp()
    kl = (pt * (lpt - lps)).sum(-1)
    grad = (lps.exp() - pt) * (kl_weight * temperature)
    ce = None
    if ce_weight is not None:
        valid = labels >= 0
        y = labels.clamp_min(0)
        lpc = torch.log_softmax(s32, -1)
        ce = -lpc.gather(-1, y[:, None])[:, 0] * valid
        gc = lpc.exp()
        gc.scatter_add_(-1, y[:, None], -torch.ones_like(gc[:, :1]))
        grad += gc * (ce_weight * valid)[:, None]
    return kl, ce, grad.to(s.dtype)


class _KLLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, t, labels, temperature, kl_weight, ce_weight, use_triton):
        if use_triton:
            from .triton.kl import kl_loss_rows
        else:
            kl_loss_rows = kl_loss_rows_torch
        kl, ce, grad = kl_loss_rows(s.detach(), t.detach(), labels, temperature, kl_weight, ce_weight)
        ctx.save_for_backward(grad)
        loss = kl.sum() * (kl_weight * temperature * temperature)
        if ce is not None:
            loss = loss + ce.sum() * ce_weight
        return loss

    @staticmethod
    def backward(ctx, dloss):
        (grad,) = ctx.saved_tensors
        return grad * dloss.to(grad.dtype), None, None, None, None, None, None


def kl_loss(student_logits, teacher_logits, labels=None, temperature: float = 1.0, kl_weight: float = 1.0,
            ce_weight: torch.Tensor | float | None = None, backend: str = "auto") -> torch.Tensor:
    """``kl_weight·Σ T²·KL(teacher ‖ student) + ce_weight·Σ CE`` over the rows of 2-D logits (see the module
    docstring); differentiable in ``student_logits`` only. ``ce_weight`` None (or labels None): no CE.
    ``backend``: "auto" (Triton on CUDA), "triton" or "torch"."""
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(f"kl_loss takes two [rows, vocab] logits of one shape; got {tuple(student_logits.shape)} "
                         f"and {tuple(teacher_logits.shape)}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"kl_loss backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if labels is None or ce_weight is None:
        labels, ce_weight = None, None
    else:  # a float32 0-dim tensor on the logits' device (the kernel reads it from memory)
        ce_weight = torch.as_tensor(ce_weight).detach().to(device=student_logits.device, dtype=torch.float32).reshape(())
    use_triton = backend == "triton" or (backend == "auto" and student_logits.is_cuda)
    return _KLLoss.apply(student_logits, teacher_logits, labels, float(temperature), float(kl_weight), ce_weight,
                         use_triton)
