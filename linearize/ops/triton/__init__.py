"""Triton kernels for the chunkwise gated delta rule (CUDA; on the CPU only under TRITON_INTERPRET=1).

Forward: the three kernels of ``chunk_fwd.py``. Backward: for now, gradients are recomputed through
the chunkwise PyTorch implementation (``linearize/ops/chunk.py``) — correct and tested against the
reference, but not yet a Triton kernel; see ``function.py``.
"""

from .function import chunk_gated_delta_rule_triton

__all__ = ["chunk_gated_delta_rule_triton"]
