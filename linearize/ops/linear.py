"""Linear attention with a scalar decay per head and token: the operator of the ``linear`` (VaLA) target.

    h_t = exp(g_t) h_{t−1} + w_t k_t v_tᵀ,   o_t = h_tᵀ (scale·q_t)   (+ v_offset_t)

with ``h`` the ``[K, V]`` state of one sequence and KV head (``Sᵀ`` of SPEC §2, as in the GDN operator),
``g`` a finite log-decay and ``w`` a write weight, both ``[B, T, H_kv]``. Layout, GQA (``q`` has
``G·H_kv`` heads reading their KV head's state), ``initial_state``, ``output_final_state`` and packed
documents (``cu_seqlens``) follow the gated delta rule's contract (:func:`linearize.ops.gated_delta_rule`).

Three implementations, each tested against the first:

- :func:`linear_attention_reference`: the loop over time that defines the op (float64-capable);
- :func:`linear_attention_chunk`: chunkwise PyTorch. Inside a chunk with ``G_r = Σ_{s≤r} g_s``,

      o_r = exp(G_r) h_0ᵀ q_r + Σ_{j≤r} exp(G_r − G_j) w_j (q_r·k_j) v_j
      h_C = exp(G_C) h_0 + Σ_j exp(G_C − G_j) w_j k_j v_jᵀ

  every exponent is ≤ 0 (the differences are masked before ``exp`` above the diagonal), so nothing
  overflows whatever the decay; autograd differentiates it as it stands;
- :func:`linear_attention_step`: one decode step;
- the Triton forward and backward (``ops/triton/linear_fwd.py``, ``linear_bwd.py``), for CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import G_FLOOR, TRITON_MAX_K, check_inputs, chunked_over_sequences, recurrent_over_sequences, wants_grad
from .taylor import taylor_back

CHUNK = 64
BACKENDS = ("auto", "torch", "triton", "reference")
_NAMES = ("g", "w")


def linear_attention_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    state: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch of sequences: ``h ← exp(g) h + w k vᵀ``, ``o = hᵀ (scale·q)``.

    Args:
        q: ``[N, Hq, K]``; k: ``[N, H, K]``; v: ``[N, H, V]``; g, w: ``[N, H]``;
        state: ``[N, H, K, V]`` (float32 or float64).
    Returns:
        ``(o [N, Hq, V] in v's dtype, new_state [N, H, K, V])``.

    Example:
        >>> N, H, G, K, V = 2, 3, 3, 8, 8
        >>> o, s = linear_attention_step(torch.randn(N, H * G, K), torch.randn(N, H, K), torch.randn(N, H, V),
        ...                              -torch.rand(N, H), torch.rand(N, H), torch.zeros(N, H, K, V))
        >>> o.shape, s.shape
        (torch.Size([2, 9, 8]), torch.Size([2, 3, 8, 8]))
    """
    N, Hq, K = q.shape
    H = k.shape[1]
    if Hq % H:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({H})")
    if state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(f"state must be [N, H, K, V] = {[N, H, K, v.shape[-1]]}; got {tuple(state.shape)}")
    dt = state.dtype
    q, k, v, g, w = (x.to(dt) for x in (q, k, v, g, w))
    h = state * g.exp()[..., None, None] + (w[..., None] * k)[..., :, None] * v[..., None, :]  # (N, H, K, V)
    qg = (q * scale).view(N, H, Hq // H, K)  # (N, H, G, K)
    o = torch.einsum("nhkv,nhgk->nhgv", h, qg).reshape(N, Hq, -1)
    return o.to(v.dtype), h


def linear_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The definition, one step at a time. Same contract as :func:`linear_attention`."""
    check_inputs(q, k, v, g, w, initial_state, cu_seqlens, _NAMES)
    return recurrent_over_sequences(linear_attention_step, q, k, v, g, w, scale, initial_state, output_final_state,
                                    cu_seqlens)


def _chunk_one(q, k, v, g, w, h, chunk):
    """One sequence (or the batch folded into the heads). q: (L, Hq, K); k: (L, H, K); v: (L, H, V);
    g, w: (L, H); h: (H, K, V). Returns o (L, Hq, V) and the state after the last position."""
    L, Hq, K = q.shape
    H, V = v.shape[1], v.shape[2]
    G = Hq // H
    if L == 0:
        return q.new_zeros(0, Hq, V), h
    pad = (-L) % chunk
    if pad:  # w = 0 and g = 0 leave the state untouched
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, w = (F.pad(x, (0, 0, 0, pad)) for x in (g, w))
    n, C = (L + pad) // chunk, chunk
    q = q.view(n, C, H, G, K).permute(0, 2, 3, 1, 4)  # (n, H, G, C, K)
    k = k.view(n, C, H, K).transpose(1, 2)  # (n, H, C, K)
    v = v.view(n, C, H, V).transpose(1, 2)  # (n, H, C, V)
    Gc = g.view(n, C, H).transpose(1, 2).cumsum(-1)  # (n, H, C): G_r
    w = w.view(n, C, H).transpose(1, 2)  # (n, H, C)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (Gc[..., :, None] - Gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (n, H, C, C)
    scores = (q @ k[:, :, None].transpose(-1, -2)) * (decay * w[..., None, :])[:, :, None]  # (n, H, G, C, C)
    o_intra = scores @ v[:, :, None]  # (n, H, G, C, V)
    q_decayed = q * Gc.exp()[:, :, None, :, None]  # (n, H, G, C, K)
    k_to_end = k * (w * (Gc[..., -1:] - Gc).exp())[..., None]  # (n, H, C, K)
    writes = k_to_end.transpose(-1, -2) @ v  # (n, H, K, V): the chunk's own contribution to its end state
    chunk_decay = Gc[..., -1, None, None].exp()  # (n, H, 1, 1)

    entering = []
    for i in range(n):  # the only sequential part: carry the state across chunks
        entering.append(h)
        h = chunk_decay[i] * h + writes[i]
    h0 = torch.stack(entering)  # (n, H, K, V)
    o = o_intra + q_decayed @ h0[:, :, None]  # (n, H, G, C, V)
    return o.permute(0, 3, 1, 2, 4).reshape(n * C, Hq, V)[:L], h


def linear_attention_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise linear attention in PyTorch. Same contract as :func:`linear_attention`."""
    check_inputs(q, k, v, g, w, initial_state, cu_seqlens, _NAMES)
    return chunked_over_sequences(_chunk_one, q, k, v, g, w, scale, initial_state, output_final_state, cu_seqlens,
                                  chunk_size)


def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    w: torch.Tensor,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    v_offset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decayed linear attention: ``h_t = exp(g_t) h_{t−1} + w_t k_t v_tᵀ``, ``o_t = h_tᵀ (scale·q_t)``.

    Args:
        q: ``[B, T, G·H, K]`` — G query heads read each KV head's state (GQA-native).
        k: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        g: ``[B, T, H]`` log-decay (finite); w: ``[B, T, H]`` write weight.
        initial_state: ``[N, H, K, V]``, N = B or the number of packed documents.
        output_final_state: also return the ``[N, H, K, V]`` state after the last token.
        cu_seqlens: ``[N + 1]`` document offsets ``[0, ..., T]`` (B must be 1); every document
            starts from its own initial state (zero by default).
        backend: ``"reference"`` (the loop that defines the op), ``"torch"`` (chunkwise PyTorch),
            ``"triton"`` (the kernels of ``ops/triton/linear_fwd.py``, and of ``linear_bwd.py`` for every
            input's gradient when one is needed) or ``"auto"`` (Triton on CUDA, else torch).
        v_offset: ``[B, T, H, V]`` or None — added to the output of every query head of its KV head
            (the VaLA back ``+ v̄``).
    Returns:
        ``(o [B, T, G·H, V] in v's dtype, final_state or None)``; states are float32 (float64 for
        float64 inputs).

    Example:
        >>> B, T, H, G, K, V = 2, 100, 3, 3, 16, 16
        >>> o, h = linear_attention(torch.randn(B, T, H * G, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V),
        ...                         -torch.rand(B, T, H), torch.rand(B, T, H), output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 9, 16]), torch.Size([2, 3, 16, 16]))
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    grad = wants_grad(q, k, v, g, w, initial_state, v_offset)
    if backend == "auto":
        backend = "triton" if q.is_cuda and _triton_ok(q) else "torch"
    if backend != "reference":  # the chunkwise forms: see G_FLOOR
        g = g.clamp_min(G_FLOOR)
    if backend == "triton":
        check_inputs(q, k, v, g, w, initial_state, cu_seqlens, _NAMES)
        if not _triton_ok(q):
            raise ValueError("backend='triton' needs float16/bfloat16/float32 CUDA tensors (or TRITON_INTERPRET=1) "
                             f"and key heads up to {TRITON_MAX_K} wide; use backend='torch'")
        if v_offset is not None and v_offset.shape != v.shape:
            raise ValueError(f"v_offset must be shaped like v {tuple(v.shape)}; got {tuple(v_offset.shape)}")
        if grad:  # the forward kernels, then the backward kernels of ops/triton/linear_bwd.py
            from .triton.linear_bwd import linear_attention_triton_train as fn
        else:
            from .triton.linear_fwd import linear_attention_triton as fn
        return fn(q, k, v, g, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, v_offset=v_offset)
    fn = linear_attention_reference if backend == "reference" else linear_attention_chunk
    o, state = fn(q, k, v, g, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens)
    return (o if v_offset is None else taylor_back(o, v_offset).to(o.dtype)), state


def _triton_ok(q: torch.Tensor) -> bool:
    from . import _triton_usable

    return _triton_usable(q) and q.shape[-1] <= TRITON_MAX_K
