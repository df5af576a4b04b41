"""Launch-settings helpers shared by the forward and backward kernels: block sizes, the state kernels'
V block, the output group, and the read-only entries every stage's settings are made of.

Each kernel stage's module holds its own settings function (cached per shape); ``chunk_fwd.launch_settings``
and ``chunk_bwd.launch_settings`` gather them into the one table the scripts read.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch

from ..common import cdiv, next_pow2


def block_k(K: int) -> int:
    """Tile width of a whole key row: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, next_pow2(K))


def state_bv(K: int, V: int, ieee: bool, programs: int | None, sms: int | None) -> int:
    """V block of the sequential state kernels: at most 64 (narrower for Gemma's 256-wide keys, whose
    fp32 state must fit in registers), halved (down to 16) while ``programs`` (sequence, head) pairs times
    V blocks would not reach half of the GPU's ``sms`` SMs (None off CUDA: not halved) — at long T with a
    small batch the sequential loop is the whole cost."""
    bv = min(64 if block_k(K) <= 128 else (16 if ieee else 32), max(16, next_pow2(V)))
    if programs is not None and sms is not None:
        while bv > 16 and programs * cdiv(V, bv) < sms // 2:
            bv //= 2
    return bv


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sms_for(programs: int | None, device: torch.device | None) -> int | None:
    """The SM count ``state_bv``'s rule reads: the device's when ``programs`` is given on CUDA, else None."""
    return _sm_count(device) if programs is not None and device is not None and device.type == "cuda" else None


def frozen(kernel, constexprs: dict, warps: int, stages: int) -> tuple:
    """One kernel's launch settings, ``(kernel, constexprs, num_warps, num_stages)``, with the constexprs made
    read-only (the entries are cached and shared by every call)."""
    return kernel, MappingProxyType(constexprs), warps, stages


def output_group(K: int) -> int:
    """Chunks per output program (``E``): 8 where the [K, V] states are large next to a chunk's q, k and Δ
    (K = 128), so the states cost 1/8 of their traffic; one at K = 64 and for Gemma's 256-wide keys
    (registers)."""
    return 8 if 64 < K <= 128 else 1


def qdo_outside(G: int) -> bool:
    """Whether the state gradient's q term ``Σ_g (γ⊙q_g)ᵀ do_g`` is computed per chunk in parallel
    (``_dv_local_kernel``, one fp32 [K, V] per chunk and KV head) rather than in the sequential chain of
    ``_state_bwd_kernel`` (G products per chunk there). GQA only: with one query head the chain's single
    product costs less than the buffer's traffic."""
    return G > 1
