"""Input checks and small helpers shared by every implementation of the GDN operator.

Layout everywhere: ``[B, T, H, D]``. ``q`` has ``G * H_kv`` heads, ``k``/``v``/``g``/``beta``
have ``H_kv`` heads. The recurrent state of one sequence and KV head is a ``[K, V]`` matrix
``h`` (the transpose of ``S`` in SPEC §2), so ``o_t = h_tᵀ q_t``.
"""

from __future__ import annotations

import weakref

import torch

TRITON_MAX_K = 256  # the Triton state kernels hold the state as at most four 64-row K blocks
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what the Triton kernels read and write
# The chunkwise forms (PyTorch and Triton; GDN, KDA and the linear attention) take the decay between two tokens
# of a chunk from differences of in-chunk cumulative log-decays in fp32. A huge |g| (−2.4e9 from a block whose
# decay correction ran wild) leaves those differences off by hundreds: outputs 95-270% off (relative) in the
# PyTorch chunk forms and the KDA kernels, exp(+hundreds) = inf in the GDN kernels on a GPU. A token's log-decay
# below −30 (α < 1e-13, a state wiped to below fp32's resolution either way) is taken as −30 by every backend but
# the reference: |G| ≤ 1,920 in a chunk of 64, exponent errors ~1e-4. Its gradient there is 0 (dα/dg = α ≈ 0).
G_FLOOR = -30.0


def check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    names: tuple[str, str] = ("g", "beta"),
) -> tuple[int, int]:
    """Validate shapes; return ``(num_sequences, group_size)``. Raises ``ValueError``. ``names``: what the
    two per-head scalars are called in the messages (the linear attention's are ``g`` and ``w``)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, T, H, D]; got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    B, T, Hq, K = q.shape
    Hkv = k.shape[2]
    if k.shape != (B, T, Hkv, K):
        raise ValueError(f"k must be [B, T, H_kv, K] = [{B}, {T}, H_kv, {K}]; got {tuple(k.shape)}")
    if v.shape[:3] != (B, T, Hkv):
        raise ValueError(f"v must be [B, T, H_kv, V] = [{B}, {T}, {Hkv}, V]; got {tuple(v.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({Hkv}) for grouped-query attention")
    for name, x in zip(names, (g, beta)):
        if x.shape != (B, T, Hkv):
            raise ValueError(f"{name} must be [B, T, H_kv] = [{B}, {T}, {Hkv}]; got {tuple(x.shape)}")
    N = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1 (packed documents); got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be a 1-D tensor [0, ..., T]; got shape {tuple(cu_seqlens.shape)}")
        _CHECKED.get(cu_seqlens, lambda: _check_rising(cu_seqlens, T), key=T)  # one GPU sync per tensor
        N = cu_seqlens.numel() - 1
    if initial_state is not None:
        want = (N, Hkv, K, v.shape[-1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [N, H_kv, K, V] = {list(want)}; got {tuple(initial_state.shape)}")
    return N, Hq // Hkv


def sequence_bounds(T: int, B: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """``(batch_index, start, end)`` of every sequence: one per row, or one per packed document."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cs = cu_seqlens.tolist()
    return [(0, s, e) for s, e in zip(cs[:-1], cs[1:])]


def time_spans(T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """``(start, end)`` along time of each document; the whole row when nothing is packed."""
    if cu_seqlens is None:
        return [(0, T)]
    cs = cu_seqlens.tolist()
    return list(zip(cs[:-1], cs[1:]))


def recurrent_over_sequences(step, q, k, v, g, b, scale, initial_state, output_final_state, cu_seqlens):
    """A reference operator's loop: ``step(q_t, k_t, v_t, g_t, b_t, h, scale) -> (o_t, h)`` token by token over
    every sequence (each row, or each packed document from its own initial state). Returns ``(o in v's dtype,
    final states or None)``; the state in :func:`compute_dtype`."""
    B, T, Hq, K = q.shape
    H, V = v.shape[2], v.shape[3]
    dt = compute_dtype(q.dtype)
    outs, finals = [], []
    for n, (r, start, end) in enumerate(sequence_bounds(T, B, cu_seqlens)):
        h = initial_state[n : n + 1].to(dt) if initial_state is not None else q.new_zeros(1, H, K, V, dtype=dt)
        steps = []
        for t in range(start, end):
            o_t, h = step(q[r : r + 1, t], k[r : r + 1, t], v[r : r + 1, t], g[r : r + 1, t], b[r : r + 1, t], h, scale)
            steps.append(o_t.to(dt))
        outs.append(torch.stack(steps, dim=1) if steps else q.new_zeros(1, 0, Hq, V, dtype=dt))
        finals.append(h)
    o = torch.cat(outs, dim=1 if cu_seqlens is not None else 0)  # (B, T, Hq, V)
    return o.to(v.dtype), (torch.cat(finals) if output_final_state else None)


def chunked_over_sequences(one, q, k, v, g, b, scale, initial_state, output_final_state, cu_seqlens, chunk_size):
    """A chunkwise operator's driver around ``one(q, k, v, g, b, h, chunk) -> (o, h)`` for one sequence
    ``(L, heads, D)``: all rows at once with the batch folded into the heads, or each packed document from its
    own initial state. Inputs are cast to :func:`compute_dtype` and q scaled first; returns ``(o in v's
    dtype, final states or None)``."""
    B, T, Hq, K = q.shape
    H, V = v.shape[2], v.shape[3]
    dt, out_dtype = compute_dtype(q.dtype), v.dtype
    q, k, v, g, b = (x.to(dt) for x in (q, k, v, g, b))
    q = q * scale
    if cu_seqlens is None:
        # all rows at once: fold the batch into the head axis, (B, T, H, D) -> (T, B·H, D)
        fold = lambda x: x.transpose(0, 1).reshape(T, B * x.shape[2], *x.shape[3:])  # noqa: E731
        h = initial_state.to(dt).reshape(B * H, K, V) if initial_state is not None else q.new_zeros(B * H, K, V)
        o, h = one(fold(q), fold(k), fold(v), fold(g), fold(b), h, chunk_size)
        o = o.view(T, B, Hq, V).transpose(0, 1)  # (B, T, Hq, V)
        return o.to(out_dtype), (h.view(B, H, K, V) if output_final_state else None)
    outs, finals = [], []
    for n, (start, end) in enumerate(time_spans(T, cu_seqlens)):
        h = initial_state[n].to(dt) if initial_state is not None else q.new_zeros(H, K, V)
        sl = slice(start, end)
        o, h = one(q[0, sl], k[0, sl], v[0, sl], g[0, sl], b[0, sl], h, chunk_size)
        outs.append(o)
        finals.append(h)
    o = torch.cat(outs, dim=0)[None]
    return o.to(out_dtype), (torch.stack(finals) if output_final_state else None)


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will differentiate a call on these tensors (None entries skipped)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulate in at least float32; float64 stays float64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ on the host (grid sizes): ``triton.cdiv`` does the same but, on recent Triton, through a
    wrapper that costs microseconds per call — and the launchers call it on every forward."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ≥ n (n ≥ 1), on the host: ``triton.next_power_of_2`` without its wrapper."""
    return 1 << (n - 1).bit_length()


class LastTensorMemo:
    """What was computed from the last tensor seen, while that very tensor (unmodified) comes back.

    Every layer of one forward passes the same ``position_ids`` / ``cu_seqlens``; reading them back
    from the GPU costs a sync, so it is done once per tensor, not once per layer."""

    def __init__(self):
        self._ref, self._key, self._value = None, None, None

    def get(self, t: torch.Tensor, compute, key=()):
        k = (0 if t.is_inference() else t._version, key)  # an inference-mode tensor keeps no version counter
        if self._ref is None or self._ref() is not t or self._key != k:
            self._value = compute()  # raises before anything is remembered
            self._ref, self._key = weakref.ref(t), k
        return self._value


def _check_rising(cu_seqlens: torch.Tensor, T: int) -> None:
    cs = cu_seqlens.tolist()
    if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}; got {cs}")


_CHECKED = LastTensorMemo()
