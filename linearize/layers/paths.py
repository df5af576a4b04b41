"""Which path a converted block's call takes: the fused Triton front or the layer-by-layer PyTorch one, and
the precision its operator runs in."""

from __future__ import annotations

import torch

from ..ops import _triton_usable
from .options import GDNOptions


def fused_path(options: GDNOptions, hidden_states: torch.Tensor, mask=None, initial=None,
               output_final_state: bool = False) -> bool:
    """Whether a call takes the fused Triton path (the Taylor front as one kernel each way, RoPE in one
    pass): the stable form, asked for (``fused_front=True``) or by default on CUDA, on fp16/bf16/fp32
    inputs where Triton runs, with no padding mask, no carried running sums and no final state wanted
    (decoding and padded prefill take the PyTorch front), and no short convolution, window or output gate
    (the layer-by-layer PyTorch path, which also keeps the align stage off its batched path). The one
    place that decides it."""
    want = options.fused_front
    plain = (not (options.short_conv or options.window or options.output_gate or options.write_gate)
             and options.target == "gdn")
    return (options.form == "stable" and plain and mask is None and initial is None and not output_final_state
            and _triton_usable(hidden_states) and (want is True or (want is None and hidden_states.is_cuda)))


def fused_window_path(options: GDNOptions, hidden_states: torch.Tensor, mask=None, fresh: bool = True) -> bool:
    """Whether the window block's old stream takes the fused Triton front (:mod:`linearize.layers.window_front`),
    and its RoPE the Triton pass (:mod:`linearize.modules.rope`):
    the stable form, Triton usable, no padding mask, on a fresh sequence (training, scoring, a prompt's prefill
    into an empty cache), without a write gate (the kernels know no write strength) and with the first-order
    mix (the second order stays on the PyTorch path it is tested on). Asked for (``fused_front=True``), or by
    default (None) on CUDA where no gradient is wanted — a prefill or scoring, where it is the faster path
    (32K × 16 tokens: 0.93 s against the PyTorch front's 1.28 s on an H100,
    ``results/prefill_mix_kernel_32kx16_h100.json``). Training takes it only where asked: faster there too
    (align steps 0.26 against 0.37 s, distill 0.36 against 0.40 s on an H200,
    ``results/bench_distill_variants_window64.json``), but no training run has used it yet."""
    want = options.fused_front
    return (bool(options.window) and options.form == "stable" and not options.write_gate and options.mix_order == 1
            and mask is None and fresh and _triton_usable(hidden_states)
            and (want is True or (want is None and hidden_states.is_cuda and not torch.is_grad_enabled())))


def operator_dtype(activations: torch.dtype, fallback: torch.dtype) -> torch.dtype:
    """The dtype the chunkwise operator runs in: the model's own where it is 16-bit (bf16/fp16 tensor cores on
    the GPU, float32 state inside), as the softmax attention it replaces; else ``fallback``, the float32 front's
    (prefix sums over long documents). Decays, β and write weights stay float32 whatever this is."""
    return activations if activations in (torch.bfloat16, torch.float16) else fallback
