"""Triton kernels for the chunkwise gated delta rule (CUDA; on the CPU only under TRITON_INTERPRET=1).

Forward: the host pipeline ``chunk_fwd.py`` over four kernel stages (``solve``, ``prepare``, ``state_fwd``,
``output``). Backward: ``chunk_bwd.py`` (after recomputing the forward's intermediates) over four more
(``dv_local``, ``state_bwd``, ``dqk``, ``wy_bwd``), the Triton port of ``linearize/ops/chunk_bwd.py``. One
module per stage, each kernel with its launcher; shared: ``layout``, ``settings``, ``tiles``. The Taylor
front's kernels: ``front.py``. Beside them, on the same layout, the kernels of two more operators: the
decayed linear attention of the linear target (``linear_fwd.py``, ``linear_bwd.py``) and KDA, the gated
delta rule with a decay per key channel (``kda_fwd.py``, ``kda_bwd.py``, helpers in ``kda_tiles.py``).
"""

from .function import chunk_gated_delta_rule_triton

__all__ = ["chunk_gated_delta_rule_triton"]
