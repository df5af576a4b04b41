"""The gated delta rule (GDN) operator and the Taylor front/back that feed it softmax attention's q, k, v;
beside it its per-channel-decay form (KDA, :mod:`linearize.ops.kda`) and the decayed linear attention of the
``linear`` (VaLA) target (:mod:`linearize.ops.linear`).

Public entry point: :func:`gated_delta_rule` with ``backend="auto" | "torch" | "reference"``
or ``"triton"``. See SPEC §3 for the contract.
"""

from __future__ import annotations

import torch

from .chunk import gated_delta_rule_chunk
from .common import G_FLOOR, TRITON_DTYPES, TRITON_MAX_K, check_inputs, compute_dtype, wants_grad
from .kda import check_kda_inputs, kda_chunk, kda_reference, kda_step
from .linear import linear_attention, linear_attention_chunk, linear_attention_reference, linear_attention_step
from .reference import gated_delta_rule_reference, gated_delta_rule_step
from .taylor import (
    TaylorInputs,
    calibrate_rho,
    prefix_mean,
    softmax_attention,
    taylor_attention,
    taylor_back,
    taylor_front,
    uniform_attention,
    vala_attention,
)

BACKENDS = ("auto", "torch", "triton", "reference")
KDA_AUTO_MAX_K = 128  # the widest key head the KDA kernels have passed their GPU tests at


def _triton_usable(x: torch.Tensor) -> bool:
    """Triton on CUDA, or anywhere under TRITON_INTERPRET=1 (the CPU tests); fp16/bf16/fp32 only."""
    import os

    if x.dtype not in TRITON_DTYPES:
        return False
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    beta: torch.Tensor,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    v_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule: ``h_t = α_t (I − β_t k_t k_tᵀ) h_{t−1} + β_t k_t v_tᵀ``, ``o_t = h_tᵀ (scale·q_t)``.

    Args:
        q: ``[B, T, G·H, K]`` — G query heads read each KV head's state (GQA-native).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        g: ``[B, T, H]`` log-decay (``α_t = exp(g_t)``, finite), or ``[B, T, H, K]``: one per key channel
            (KDA, ``h_t = (I − β_t k_t k_tᵀ) Diag(α_t) h_{t−1} + β_t k_t v_tᵀ``, ``g ≤ 0``;
            :mod:`linearize.ops.kda`; its Triton kernels are ``ops/triton/kda_fwd.py`` and ``kda_bwd.py``;
            ``"auto"`` takes them for key heads up to 128 wide, and trains a 16-bit KDA through ``"torch"``
            where Triton's ptxas is older than 12.9, which miscompiles that backward); or None: no decay
            (α ≡ 1, the delta rule of the ``deltanet`` target), which the Triton kernels then skip (no g read,
            no exp of it, no g gradient); beta: ``[B, T, H]``.
        initial_state: ``[N, H, K, V]``, N = B or the number of packed documents.
        output_final_state: also return the ``[N, H, K, V]`` state after the last token.
        cu_seqlens: ``[N + 1]`` document offsets ``[0, ..., T]`` (B must be 1); every document
            starts from its own initial state (zero by default).
        backend: ``"reference"`` (the loop that defines the op), ``"torch"`` (chunkwise PyTorch),
            ``"triton"`` (the kernels of ``ops/triton``), or ``"auto"`` (Triton on CUDA, else torch).
        v_offset: ``[B, T, H, V]`` or None — added to the output of every query head of its KV head
            (the Taylor back ``+ v̄``, :func:`taylor_back`); the Triton backend adds it, in float32,
            inside its output kernel, before the output's one rounding to v's dtype.
    Returns:
        ``(o [B, T, G·H, V] in v's dtype, final_state or None)``; states are float32 (float64 for
        float64 inputs).

    Example:
        >>> B, T, H, G, K, V = 2, 100, 3, 3, 16, 16
        >>> q, k = torch.randn(B, T, H * G, K), torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> o, h = gated_delta_rule(q, k, torch.randn(B, T, H, V), -torch.rand(B, T, H), torch.rand(B, T, H),
        ...                         output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 9, 16]), torch.Size([2, 3, 16, 16]))
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    per_channel = g is not None and g.dim() == 4
    if backend == "auto":
        fits = q.is_cuda and _triton_usable(q) and q.shape[-1] <= TRITON_MAX_K
        if fits and per_channel:  # KDA: key heads up to the width its GPU tests passed at (128), and not
            from .triton.kda_bwd import backward_compiles, warn_torch_backward  # where ptxas would miscompile

            fits = q.shape[-1] <= KDA_AUTO_MAX_K  # … a 16-bit backward: then the PyTorch form, said once
            if fits and wants_grad(q, k, v, g, beta, initial_state, v_offset) and not backward_compiles(q.dtype, q.device):
                warn_torch_backward(q.dtype)
                fits = False
        backend = "triton" if fits else "torch"
    if g is None and backend != "triton":  # the PyTorch forms take the zeros the kernels skip
        g = torch.zeros_like(beta, dtype=compute_dtype(beta.dtype))
    elif g is not None and backend != "reference" and not (per_channel and backend == "triton"):
        g = g.clamp_min(G_FLOOR)  # the chunkwise forms: see G_FLOOR (the KDA kernels floor g as they read it)
    if backend == "triton":
        if per_channel:
            check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
        else:
            check_inputs(q, k, v, beta if g is None else g, beta, initial_state, cu_seqlens)
        if q.dtype not in TRITON_DTYPES:
            raise ValueError(f"the Triton backend takes float16, bfloat16 or float32; got {q.dtype} (use backend='torch')")
        if not _triton_usable(q):
            raise ValueError("backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1); use backend='torch'")
        if per_channel:
            from .triton.kda_bwd import kda_triton

            return kda_triton(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                              output_final_state=output_final_state, cu_seqlens=cu_seqlens, v_offset=v_offset)
        from .triton import chunk_gated_delta_rule_triton

        return chunk_gated_delta_rule_triton(
            q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
            cu_seqlens=cu_seqlens, v_offset=v_offset,
        )
    if per_channel:
        fn = kda_reference if backend == "reference" else kda_chunk
    else:
        fn = gated_delta_rule_reference if backend == "reference" else gated_delta_rule_chunk
    o, state = fn(
        q, k, v, g, beta,
        scale=scale, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )
    return (o if v_offset is None else taylor_back(o, v_offset).to(o.dtype)), state


__all__ = [
    "BACKENDS",
    "TaylorInputs",
    "calibrate_rho",
    "gated_delta_rule",
    "gated_delta_rule_chunk",
    "gated_delta_rule_reference",
    "gated_delta_rule_step",
    "kda_chunk",
    "kda_reference",
    "kda_step",
    "linear_attention",
    "linear_attention_chunk",
    "linear_attention_reference",
    "linear_attention_step",
    "prefix_mean",
    "softmax_attention",
    "taylor_attention",
    "taylor_back",
    "taylor_front",
    "uniform_attention",
    "vala_attention",
]
