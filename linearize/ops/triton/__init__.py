"""Triton kernels for the chunkwise gated delta rule (CUDA; on the CPU only under TRITON_INTERPRET=1).

Forward: the three kernels of ``chunk_fwd.py``. Backward: the hand-written chunkwise backward of
``linearize/ops/chunk_bwd.py`` (PyTorch ops batched over chunks, one short loop for the state
gradient) — tested against the reference; its Triton port is the next step.
"""

from .function import chunk_gated_delta_rule_triton

__all__ = ["chunk_gated_delta_rule_triton"]
