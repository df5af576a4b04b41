"""The exact part of a sink + sliding-window block: softmax over the attention sinks and a window.

A converted block with ``GDNOptions.window = W`` and ``sinks = S`` splits the keys a query ``t``
attends to in two (SPEC §2, "What the student could not learn"):

- exact: its window — itself and the ``W − 1`` tokens before it — and its document's first ``S``
  tokens (the sinks), through softmax with their exact normalizer ``Z_E``;
- old: every other earlier token of its document, through the Taylor-GDN, which stands for the softmax
  over those tokens alone; its normalizer to first order of log-sum-exp, ``log Z_O ≈ log n_O + q·k̄_O``.

:func:`mix_by_mass` combines the two by their share of the softmax mass, ``Z_E / (Z_E + Z_O)``. While
there are no old tokens (``t ≤ W + S``) the share is 1 and the block is softmax attention exactly.

:func:`sink_window_softmax` is written for training and decoding alike: its keys come as the ``W``
keys before the first query followed by one key per query, so a decode step passes the cached window
and the new token, and a fresh sequence passes ``W`` empty slots. It runs in blocks of ``min(T, W)`` queries
against the ``W`` keys before each block and the block's own (a band), so its cost is linear in ``T``
and a decode step scores ``W + 1`` keys; PyTorch computes and differentiates it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import compute_dtype
from .linear import linear_attention


def sink_window_softmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_doc: torch.Tensor,
    query_doc: torch.Tensor,
    window: int,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    sink_ok: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over its window and its sinks; ``(o, lse)``.

    Args:
        q: ``(B, T, G·H, D)``, the softmax scale folded in.
        k, v: ``(B, W + T, H, D)``: the ``W`` keys before the first query, then one per query. Query
            ``t`` sees keys ``t + 1 … t + W`` of this array (itself and the ``W − 1`` before it) whose
            ``key_doc`` ``(B, W + T)`` equals its ``query_doc`` ``(B, T)`` — so empty slots and padding
            take a document id no query has, and packed documents do not see each other.
        sink_k, sink_v: ``(B, T or 1, S, H, D)``: the sinks each query sees beside its window, where
            ``sink_ok`` ``(B, T, S)`` — the caller leaves out sinks that are inside the window already.

    Returns ``o (B, T, G·H, D)`` and the log-normalizer ``lse (B, T, G·H)``, both float32 (float64 for
    float64 inputs); ``lse`` is −inf for a query that sees no key (padding), whose ``o`` is 0.
    """
    B, T, Hq, D = q.shape
    H, W = k.shape[2], window
    G = Hq // H
    if k.shape[1] != W + T or key_doc.shape != (B, W + T) or query_doc.shape != (B, T):
        raise ValueError(f"keys must be the {W} before the first query and one per query: k {tuple(k.shape)}, "
                         f"key_doc {tuple(key_doc.shape)}, query_doc {tuple(query_doc.shape)} for q {tuple(q.shape)}")
    acc = compute_dtype(q.dtype)
    C = min(T, W)  # queries per block: a decode step (T = 1) scores W + 1 keys, not 2W per padded block
    nb = -(-T // C)  # block b of C queries sees keys [bC, bC + C + W) of the array
    pad = nb * C - T
    qb = F.pad(q.to(acc), (0, 0, 0, 0, 0, pad)).view(B, nb, C, H, G, D)
    blocks = lambda x: x.unfold(1, C + W, C).movedim(-1, 2)  # noqa: E731  (B, nb, C + W, ...): overlapping
    kb, vb = (blocks(F.pad(x.to(acc), (0, 0, 0, 0, 0, pad))) for x in (k, v))  # (B, nb, C + W, H, D)
    kd = blocks(F.pad(key_doc, (0, pad), value=-1))  # (B, nb, C + W)
    qd = F.pad(query_doc, (0, pad), value=-2).view(B, nb, C)
    i = torch.arange(C, device=q.device)[:, None]
    r = torch.arange(C + W, device=q.device)[None]
    band = (r > i) & (r <= i + W)  # query i of a block sees its keys r in (i, i + W]
    seen = band & (kd[:, :, None, :] == qd[:, :, :, None])  # (B, nb, C, C + W)
    scores = torch.einsum("bnihgd,bnrhd->bnihgr", qb, kb)
    scores = scores.masked_fill(~seen[:, :, :, None, None, :], float("-inf"))
    parts = [scores]
    if sink_k is not None:
        sk, sv = sink_k.to(acc).expand(B, T, -1, -1, -1), sink_v.to(acc).expand(B, T, -1, -1, -1)
        S = sk.shape[2]
        ss = torch.einsum("bthgd,btshd->bthgs", q.to(acc).view(B, T, H, G, D), sk)
        ss = ss.masked_fill(~sink_ok[:, :, None, None, :], float("-inf"))
        parts.append(F.pad(ss, (0, 0, 0, 0, 0, 0, 0, pad), value=float("-inf")).view(B, nb, C, H, G, S))
    logits = torch.cat(parts, dim=-1) if len(parts) > 1 else scores
    lse = torch.logsumexp(logits, dim=-1)  # (B, nb, C, H, G)
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    o = torch.einsum("bnihgr,bnrhd->bnihgd", p[..., : C + W], vb)
    o = o.reshape(B, nb * C, Hq, D)[:, :T]
    if sink_k is not None:
        ps = p[..., C + W:].reshape(B, nb * C, H, G, -1)[:, :T]
        o = o + torch.einsum("bthgs,btshd->bthgd", ps, sv).reshape(B, T, Hq, D)
    return o, lse.reshape(B, nb * C, Hq)[:, :T]


def mix_by_mass(
    o_exact: torch.Tensor,
    lse_exact: torch.Tensor,
    o_old: torch.Tensor,
    q: torch.Tensor,
    k_mean_old: torch.Tensor,
    n_old: torch.Tensor,
    bias: torch.Tensor | None = None,
    square_sum: torch.Tensor | None = None,
    backend: str = "auto",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``w·o_exact + (1 − w)·o_old`` with ``w = Z_E / (Z_E + Z_O)`` the exact part's share of the mass.

    ``log Z_O ≈ log n_O + q·k̄_O + bias``: the first-order log-sum-exp of the old tokens' logits (Jensen:
    their mean logit, plus the log of their count), with a learnable per-query-head ``bias`` ``(G·H,)`` on
    top (0 at init). q: ``(B, T, G·H, D)`` scaled; ``k_mean_old`` ``(B, T, H, D)`` the old tokens' mean key;
    ``n_old`` ``(B, T)`` their count — where it is 0, ``w = 1``. Outputs ``(B, T, G·H, D)``.

    ``square_sum`` ``(B, T, G·H)``: each query's ``Σ_s (q·k_s)²`` over its old tokens
    (:func:`old_square_sums`); given, the second-order form (the cumulant expansion, exact for Gaussian
    logits) adds half their variance, ``log Z_O ≈ log n_O + mean + ½·var``. A head that picks one token out
    of thousands has a large variance there, where the first-order form puts the old share near 0.

    Returns ``out_dtype`` (default ``lse_exact``'s, in which it computes). Where no gradient is wanted and
    Triton runs (:func:`window_triton_usable` with ``backend``: a prefill, scoring) one kernel does it all,
    :func:`linearize.ops.triton.mix.mix_by_mass_triton`.
    """
    if window_triton_usable(q, backend):
        from .triton.mix import mix_by_mass_triton

        return mix_by_mass_triton(o_exact, lse_exact, o_old, q, k_mean_old, n_old, bias, square_sum, out_dtype)
    B, T, Hq, D = q.shape
    H = k_mean_old.shape[2]
    acc = lse_exact.dtype
    mean_logit = torch.einsum("bthgd,bthd->bthg", q.to(acc).view(B, T, H, Hq // H, D),
                              k_mean_old.to(acc)).reshape(B, T, Hq)
    has_old = (n_old > 0)[..., None]  # (B, T, 1)
    n = n_old.to(acc).clamp_min(1)[..., None]
    log_z_old = torch.log(n) + mean_logit
    if square_sum is not None:  # var = E[l²] − E[l]², never negative (rounding can make it so)
        log_z_old = log_z_old + 0.5 * (square_sum.to(acc) / n - mean_logit.square()).clamp_min(0)
    if bias is not None:
        log_z_old = log_z_old + bias.to(acc)
    lse = torch.where(torch.isfinite(lse_exact), lse_exact, torch.zeros_like(lse_exact))
    w = torch.where(has_old, torch.sigmoid(lse - log_z_old), torch.ones_like(lse))[..., None]
    o = w * o_exact.to(acc) + (1 - w) * o_old.to(acc)
    return o if out_dtype is None else o.to(out_dtype)


def old_square_sums(q: torch.Tensor, old_k: torch.Tensor, old_ok: torch.Tensor, initial: torch.Tensor | None = None,
                    output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                    backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each query's ``Σ_s (q·k_s)²`` over the old stream so far, ``(B, T, G·H)``, and the running moment
    ``M = Σ_s k_s k_sᵀ`` ``(N, H, D, D)`` it is read from (``qᵀ M q``), for :func:`mix_by_mass`'s
    second-order form. A decayless linear attention whose values are its keys: ``o_t = M_t q_t``, so
    ``q_t·o_t = Σ_s (q_t·k_s)²``, through :func:`linearize.ops.linear.linear_attention` (its kernels,
    packed documents and states). q ``(B, T, G·H, D)`` scaled; ``old_k`` ``(B, T, H, D)``: the old stream
    (the token leaving the window at each step); ``old_ok`` ``(B, T)``: which of its steps write;
    ``initial``: the moment after the tokens before these."""
    w = old_ok.to(old_k.dtype)[..., None].expand(*old_ok.shape, old_k.shape[2])
    o, moment = linear_attention(q.to(old_k.dtype), old_k, old_k, torch.zeros_like(w), w, initial_state=initial,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend)
    return (o * q.to(o.dtype)).sum(-1), moment


def normalizer_gap(q: torch.Tensor, k: torch.Tensor, window: int, sinks: int, order: int = 1) -> torch.Tensor:
    """Per query head, the mean gap between the older tokens' true log-normalizer ``log Z_O`` and the form
    :func:`mix_by_mass` estimates it with — ``log n_O + q·k̄_O`` (order 1; Jensen: never negative), plus
    ``½·var(q·k)`` over those tokens (order 2; either sign) — over the queries that have older tokens: the
    ``bias`` of :func:`mix_by_mass` that calibrates the mix on these rows. q ``(B, T, G·H, D)`` scaled,
    k ``(B, T, H, D)``, each row one document from its start. Returns ``(G·H,)`` float64 (zeros when no
    query has older tokens)."""
    if order not in (1, 2):
        raise ValueError(f"order must be 1 or 2; got {order!r}")
    B, T, Hq, D = q.shape
    H = k.shape[2]
    q64 = q.double().view(B, T, H, Hq // H, D)
    logits = torch.einsum("bthgd,bshd->bhgts", q64, k.double())  # (B, H, G, T, T)
    t = torch.arange(T, device=q.device)[:, None]
    s = torch.arange(T, device=q.device)[None]
    old = (s <= t - window) & (s >= sinks)  # 0-based: older than the window, not a sink
    n = old.sum(1)  # (T,)
    has = n > 0
    if not bool(has.any()):
        return torch.zeros(Hq, dtype=torch.float64, device=q.device)
    lz = torch.logsumexp(logits.masked_fill(~old, float("-inf")), -1)  # (B, H, G, T)
    mean_logit = (logits * old).sum(-1) / n.clamp_min(1)
    estimate = torch.log(n.clamp_min(1).double()) + mean_logit
    if order == 2:
        estimate = estimate + 0.5 * ((logits.square() * old).sum(-1) / n.clamp_min(1) - mean_logit.square()).clamp_min(0)
    gap = (lz - estimate)[..., has]  # (B, H, G, tokens with older ones)
    return gap.mean(dim=(0, 3)).reshape(Hq)


_FLEX = {}
_MASK = {}  # the last block mask: every layer of one forward sees the same documents


def _held(t: torch.Tensor) -> tuple:
    """What names a tensor's current contents without reading them: its storage, place in it and version
    (the version counter is its base's: an in-place write through any view changes it)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
            0 if t.is_inference() else t._version)


def _block_mask(key_doc, query_doc, pos, window, sinks, compiled):
    # the layers of one forward pass views of the same tensors (``window_inputs.fresh_layout``): the last
    # mask is kept with references to its tensors (so no other tensor can take their storage) and found
    # again by storage and version, without a read back from the GPU (a sync a layer, three a layer before)
    key = (window, sinks, compiled, *(_held(t) for t in (key_doc, query_doc, pos)))
    last = _MASK.get("last")
    if last is not None and last[0] == key:
        return last[2]

    def seen(b, h, t, s):
        return (query_doc[b, t] == key_doc[b, s]) & (s <= t) & ((t - s < window) | (pos[b, s] <= sinks))

    B, T = query_doc.shape
    mask = block_mask(seen, B, None, T, query_doc.device, compiled)
    _MASK["last"] = (key, (key_doc, query_doc, pos), mask)
    return mask


def flex_usable(x: torch.Tensor) -> bool:
    """Whether the fresh exact part runs through FlexAttention: on CUDA, where it compiles to one kernel
    each way, and when a backward will follow (training). Without gradients (scoring, evaluation) the
    banded path serves: it is linear in T too, and lengths that vary call by call do not recompile."""
    return x.is_cuda and torch.is_grad_enabled()


def window_triton_usable(x: torch.Tensor, backend: str = "auto") -> bool:
    """Whether the exact part runs through the Triton forward kernel (``ops/triton/window_fwd.py``): where no
    gradient is wanted (a prefill, scoring, evaluation; it has no backward), with ``backend="auto"`` on CUDA
    (checked against the reference on an H200, ``tests/test_window_triton.py -m gpu``: a 32K x 16 prefill of
    the SmolLM2 architecture 1.31 s, ``results/prefill_window_kernel_32kx16.json``, against 2.37 s on the
    banded form, ``results/prefill_kernels_32kx16.json``)
    and with ``backend="triton"`` also under the interpreter (the CPU tests)."""
    from . import _triton_usable  # CUDA, or the interpreter (the CPU tests)

    if torch.is_grad_enabled() or backend not in ("auto", "triton"):
        return False
    return _triton_usable(x) and (backend == "triton" or x.is_cuda)


def block_mask(mask_mod, B: int, H: int | None, T: int, device: torch.device, compiled: bool):
    """FlexAttention's block mask of ``mask_mod`` over a T x T grid; ``compiled``: built by ``create_block_mask``
    compiled once (the dense mask is never materialized; torch now asks for this in place of its ``_compile``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if compiled and "mask" not in _FLEX:
        _FLEX["mask"] = torch.compile(create_block_mask)
    fn = _FLEX["mask"] if compiled else create_block_mask
    return fn(mask_mod, B, H, T, T, device=device)


def _flex_attention():
    """``flex_attention`` compiled once (on CUDA it becomes one Triton kernel each way); eager elsewhere."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def sink_window_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_doc: torch.Tensor,
                     query_doc: torch.Tensor, pos: torch.Tensor, window: int, sinks: int,
                     compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sink_window_softmax` for a fresh sequence through PyTorch's FlexAttention: one fused kernel
    with a block-sparse mask (the band and the sinks' columns), GQA native, returning the log-normalizer.

    q ``(B, T, G·H, D)`` scaled; k, v ``(B, T, H, D)`` — the sequence itself, no slots before it;
    ``key_doc``/``query_doc`` ``(B, T)`` document ids (padding: −1 / −2); ``pos`` ``(B, T)`` each token's
    position in its document from 1. Query t sees key s of its document with ``s ≤ t`` and either
    ``t − s < W`` or ``pos_s ≤ S``. Returns ``(o (B, T, G·H, D) float32, lse (B, T, G·H) float32)``.
    ``compiled=False`` runs FlexAttention eagerly (its reference path: for tests on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    B, T, Hq, D = q.shape
    mask = _block_mask(key_doc, query_doc, pos, window, sinks, compiled)
    dt = k.dtype if k.dtype in (torch.bfloat16, torch.float16) else torch.float32
    fn = _flex_attention() if compiled else flex_attention
    o, lse = fn(q.to(dt).transpose(1, 2), k.to(dt).transpose(1, 2), v.to(dt).transpose(1, 2), block_mask=mask,
                scale=1.0, enable_gqa=Hq != k.shape[2], return_lse=True)
    return o.transpose(1, 2).float(), lse.transpose(1, 2).float()
