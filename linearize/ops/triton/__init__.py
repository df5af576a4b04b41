"""Triton kernels for the chunkwise gated delta rule (CUDA; on the CPU only under TRITON_INTERPRET=1).

Forward: the three kernels of ``chunk_fwd.py``. Backward: the four kernels of ``chunk_bwd.py`` (after
recomputing the forward's intermediates), the Triton port of ``linearize/ops/chunk_bwd.py``.
"""

from .function import chunk_gated_delta_rule_triton

__all__ = ["chunk_gated_delta_rule_triton"]
