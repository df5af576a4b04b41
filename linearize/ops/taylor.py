"""The Taylor front and back: softmax attention's q, k, v → GDN inputs, and ``+ v̄`` behind.

SPEC §2 in code. Per document (``t`` counts from 1 at every document start):

    k̄_t, v̄_t           prefix means;          k̃_t = k_t − k̄_t,  ṽ_t = v_t − v̄_{t−1}
    k̂_t = k̃_t/‖k̃_t‖    unit key the GDN operator sees
    α_t = 1 − 1/t       (α_1 = 1), passed as g = log α
    β_t = ρ‖k̃_t‖/(t−1)  clipped to [0, β_max]  ("stable");  ‖k̃_t‖²/(t−1) unclipped ("seed")
    u_t = ‖k̃_t‖ ṽ_t/(t β_t)  so that β_t u_t k̂_tᵀ = ṽ_t k̃_tᵀ / t exactly
    o_t = v̄_t + A_t q_t

``q`` must already carry the softmax scale (``q ← s·q``); :func:`taylor_attention` folds it in.
Besides the GDN forms, this module has the two closed-form baselines the report compares against:
``uniform`` (o_t = v̄_t) and VaLA (seed 000, eq. va-la), and exact causal softmax attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import time_spans

FORMS = ("stable", "seed")
# β ≤ 1 keeps the erase eigenvalue α(1 − β) in [0, 1]; on SmolLM2 it beat β ≤ 2 (median error 0.895 vs
# 0.923 at 256 tokens, 0.939 vs 0.945 at 1024): see notebooks/taylor_to_gdn.ipynb.
DEFAULT_BETA_MAX = 1.0


@dataclass
class TaylorInputs:
    """What the GDN operator consumes, plus the prefix mean of v added behind it."""

    k: torch.Tensor  # (B, T, H, K): unit keys k̂
    v: torch.Tensor  # (B, T, H, V): u
    g: torch.Tensor  # (B, T, H): log α
    beta: torch.Tensor  # (B, T, H)
    v_mean: torch.Tensor  # (B, T, H, V): v̄_t
    sums: RunningSums  # Σk, Σv and t after the last token (for decoding on)
    k_mean: torch.Tensor | None = None  # (B, T, H, K): k̄_t (the PyTorch front only)
    count: torch.Tensor | None = None  # (B, T): t, the tokens counted so far (the PyTorch front only)


@dataclass
class RunningSums:
    """The prefix-mean part of a decoding state: ``Σk (B, H, K)``, ``Σv (B, H, V)``, ``t (B,)``; with the
    window block's second-order mix (``GDNOptions.mix_order = 2``) also ``Σkkᵀ (B, H, K, K)`` of its old keys."""

    k: torch.Tensor
    v: torch.Tensor
    count: torch.Tensor
    kk: torch.Tensor | None = None


def _documents(T: int, cu_seqlens: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc, start)``: the document of every token ``(T,)`` and where each document starts ``(N,)``.
    Built on the device without reading ``cu_seqlens`` back, so packed batches cost no host sync."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    doc = torch.repeat_interleave(torch.arange(lens.numel(), device=device), lens, output_size=T)
    return doc, cu[:-1]


def positions(B: int, T: int, cu_seqlens: torch.Tensor | None, device=None, dtype=torch.float32) -> torch.Tensor:
    """``t`` of every token, counting from 1 at each sequence/document start: ``(B, T)``."""
    t = torch.arange(1, T + 1, device=device)
    if cu_seqlens is not None:
        doc, start = _documents(T, cu_seqlens, device)
        t = t - start[doc]
    return t.to(dtype).expand(B, T)


_SCAN_CHUNK = 64


def _scan(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(1)`` in chunks of 64 steps: within the chunks, then across their totals. A scan along a
    dimension that is not the last runs one GPU thread per column, serially over time; on a packed row
    (B = 1, 32K tokens, 192 columns) that took 1.35 of an align step's 1.85 s of kernels. Chunked, every
    chunk of every column scans in parallel, and the backward (flipped scans) likewise."""
    B, T = x.shape[:2]
    if T <= 4 * _SCAN_CHUNK:
        return x.cumsum(1)
    n = -(-T // _SCAN_CHUNK)
    pad = n * _SCAN_CHUNK - T
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], 1)
    c = x.view(B, n, _SCAN_CHUNK, *x.shape[2:]).cumsum(2)
    last = c[:, :, -1]
    before = last.cumsum(1) - last  # the totals of the chunks before each one
    return (c + before[:, :, None]).view(B, n * _SCAN_CHUNK, *x.shape[2:])[:, :T]


def _cumsum_docs(x: torch.Tensor, docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Cumulative sum along time (dim 1), restarting at each document. Packed: one float64 cumsum
    over the row minus its value before each document's start — float64 keeps the subtraction free
    of cancellation on long packs — with no loop over documents. That value is spread over the
    document's tokens as a cumsum of its steps at the starts, not gathered per token: the backward of a
    per-token gather adds every token into its document's row (atomics on few addresses; a float64
    indexing backward led the profile of the window block's training step on an H200, 44 ms of 484, and
    is gone from it since: results/bench_sparse_cache_training*.json)."""
    if docs is None:
        return _scan(x)
    _, start = docs  # from _documents
    c = _scan(x.to(torch.float64))
    before = torch.cat([torch.zeros_like(c[:, :1]), c[:, :-1]], 1)[:, start]  # (B, N, ...): before each start
    steps = before - torch.cat([torch.zeros_like(before[:, :1]), before[:, :-1]], 1)
    return (c - _scan(torch.zeros_like(c).index_add(1, start, steps))).to(x.dtype)  # add: empty documents


def prefix_mean(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Running mean over time, restarting at each document: ``x̄_t = (1/t) Σ_{i≤t} x_i``. x: (B, T, ...)."""
    B, T = x.shape[:2]
    t = positions(B, T, cu_seqlens, x.device, x.dtype).view(B, T, *([1] * (x.dim() - 2)))
    return _cumsum_docs(x, _documents(T, cu_seqlens, x.device) if cu_seqlens is not None else None) / t


def calibrate_rho(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Per-KV-head query-norm scale ρ: mean ‖q_t‖ over tokens and the G query heads of the group.

    q: ``(B, T, G·H, K)``, already scaled. Returns ``(H,)``.
    """
    B, T, Hq, K = q.shape
    norms = q.reshape(B, T, num_kv_heads, Hq // num_kv_heads, K).norm(dim=-1)  # (B, T, H, G)
    return norms.mean(dim=(0, 1, 3))


def correction_factors(beta_logit: torch.Tensor, gate_logit: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(β factor, decay exponent)`` from the ``beta_proj`` and ``gate_proj`` outputs ``(B, T, H)`` (the gate's
    ``(B, T, H, K)`` per key channel in the kda target): ``β ← β·2σ(b)`` ∈ (0, 2·β) and ``g ← g·exp(a)``
    (``α ← α^{exp(a)}``), both 1 at the zero init."""
    return 2 * torch.sigmoid(beta_logit.to(dtype)), torch.exp(gate_logit.to(dtype))


def taylor_front(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    form: str = "stable",
    rho: torch.Tensor | float | None = None,
    beta_max: float = DEFAULT_BETA_MAX,
    beta_factor: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    initial: RunningSums | None = None,
    write_factor: torch.Tensor | None = None,
    eps: float = 1e-12,
) -> TaylorInputs:
    """Teacher q (scaled), k, v after RoPE/norms → GDN inputs of the Taylor form (SPEC §2).

    Args:
        q: ``(B, T, G·H, K)``, with the softmax scale folded in; only used to calibrate ρ.
        k: ``(B, T, H, K)``; v: ``(B, T, H, V)``.
        form: ``"stable"`` (bounded ``c_t = ρ k̂_t``, the default) or ``"seed"`` (``c_t = k̃_t``).
        rho: per-KV-head ``(H,)`` tensor or a float; ``None`` calibrates it from ``q``.
        beta_max: upper clip of β in the stable form (≤ 2 keeps the erase eigenvalue in [−1, 1]).
        beta_factor: optional ``(B, T, H)`` multiplier on β before the clip (a learnable correction;
            the write term ``ṽ k̃ᵀ/t`` does not change with it).
        mask: optional ``(B, T)`` bool, False for padding: such tokens neither count in ``t`` and the
            means nor touch the state (α = 1, β = 0).
        initial: running sums carried over from earlier tokens (decoding); not with ``cu_seqlens``.
        write_factor: optional ``(B, T, H)`` multiplier on the written value ``u`` (so on the write term
            ``ṽ k̃ᵀ/t``; :mod:`linearize.layers.write_gate`); 1 (None) is the Taylor form.
    """
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}; got {form!r}")
    if initial is not None and cu_seqlens is not None:
        raise ValueError("initial running sums and cu_seqlens exclude each other: packed documents start fresh")
    B, T, H, K = k.shape
    pm = prefix_means(k, v, cu_seqlens=cu_seqlens, mask=mask, initial=initial)
    t, t_safe, live, v_mean, k_mean = pm.count, pm.count.clamp_min(1), pm.live, pm.v_mean, pm.k_mean
    # k̃_t; identically 0 at a document's first token (k − k): `where` keeps the 0/0 of its
    # normalization out of the gradient, which would otherwise pour ~1/eps into the prefix-sum backward
    k_c = torch.where(live[..., None], k - k_mean, 0.0)
    v_c = v - pm.v_prev  # ṽ_t
    n = k_c.norm(dim=-1)  # (B, T, H)
    k_hat = k_c / n.clamp_min(eps)[..., None]
    tm1 = (t - 1).clamp_min(1)
    if form == "seed":
        beta = n * n / tm1
    else:
        if rho is None:
            rho = calibrate_rho(q, H)
        rho = torch.as_tensor(rho, dtype=k.dtype, device=k.device)
        beta = rho * n / tm1
        if beta_factor is not None:
            beta = beta * beta_factor
        beta = beta.clamp(0.0, beta_max)
    beta = torch.where(live, beta, torch.zeros_like(beta))
    # u = ‖k̃‖ ṽ/(t β): the write term stays exactly ṽ k̃ᵀ/t whatever clipping did to β
    coef = torch.where(beta > 0, n / (t_safe * beta.clamp_min(eps)), torch.zeros_like(beta))
    if write_factor is not None:
        coef = coef * write_factor.to(coef.dtype)
    u = coef[..., None] * v_c
    alpha = torch.where(live, 1.0 - 1.0 / t_safe, torch.ones_like(t_safe)).expand(B, T, H)
    return TaylorInputs(k=k_hat, v=u, g=alpha.log(), beta=beta, v_mean=v_mean, sums=pm.sums, k_mean=k_mean,
                        count=t[..., 0])


@dataclass
class PrefixMeans:
    """The running means of one call, per token: what the Taylor front and the VaLA front both start from."""

    count: torch.Tensor  # (B, T, 1): t, the tokens counted so far, this one included
    k_mean: torch.Tensor  # (B, T, H, K): k̄_t (0 before a document's first counted token)
    v_mean: torch.Tensor  # (B, T, H, V): v̄_t
    v_prev: torch.Tensor  # (B, T, H, V): v̄_{t−1} (0 when t = 1)
    live: torch.Tensor  # (B, T, 1) bool: a counted token with t > 1, where the state moves at all
    sums: RunningSums | None  # Σk, Σv and t after the last token (``initial`` for T = 0)


def prefix_means(k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, initial: RunningSums | None = None) -> PrefixMeans:
    """k̄_t, v̄_t, v̄_{t−1} and t of every token, from prefix sums that restart at each document (``cu_seqlens``)
    and skip padding (``mask`` False), continuing ``initial`` (decoding). k ``(B, T, H, K)``, v ``(B, T, H, V)``."""
    B, T = k.shape[:2]
    m = torch.ones(B, T, dtype=k.dtype, device=k.device) if mask is None else mask.to(k.dtype)
    km, vm = k * m[..., None, None], v * m[..., None, None]
    docs = _documents(T, cu_seqlens, k.device) if cu_seqlens is not None else None  # once for the three sums
    t = _cumsum_docs(m, docs)  # (B, T): tokens counted so far, this one included
    sum_k, sum_v = _cumsum_docs(km, docs), _cumsum_docs(vm, docs)
    if initial is not None:
        t = t + initial.count[:, None]
        sum_k, sum_v = sum_k + initial.k[:, None], sum_v + initial.v[:, None]
    t = t[..., None]  # (B, T, 1)
    t_safe = t.clamp_min(1)
    # clone: a view of the last position would keep the whole (B, T, ...) cumsum alive in the cache
    sums = RunningSums(k=sum_k[:, -1].clone(), v=sum_v[:, -1].clone(), count=t[:, -1, 0].clone()) if T else initial
    return PrefixMeans(count=t, k_mean=sum_k / t_safe[..., None], v_mean=sum_v / t_safe[..., None],
                       v_prev=(sum_v - vm) / (t_safe - 1).clamp_min(1)[..., None], live=(m[..., None] > 0) & (t > 1),
                       sums=sums)


def fold_decay(q: torch.Tensor, front: TaylorInputs) -> tuple[torch.Tensor, TaylorInputs]:
    """The Taylor front as DeltaNet inputs (no decay, ``α ≡ 1``): ``(q/t, front)`` with ``g = 0`` and ``u ← t·u``.

    The GDN state of the Taylor form decays by ``α_t = 1 − 1/t`` (1 at a document's first token and at
    padding, where t does not move). Its scaled copy ``h'_t = t·h_t`` then follows the delta rule without
    a decay, ``h'_t = (I − β k̂k̂ᵀ) h'_{t−1} + β k̂ (t·u_t)ᵀ`` (since ``t·α_t = t − 1``), and the read is
    ``h_tᵀ q = h'_tᵀ (q/t)``: fixing α at 1 gives up nothing at initialization, and β needs no change. What
    is given up is the learnable decay on top (the GDN block's ``gate_proj``). ``front.count`` (the
    PyTorch front's t) is required; q ``(B, T, G·H, K)``."""
    if front.count is None:
        raise ValueError("fold_decay needs the token counts of the PyTorch Taylor front (front.count)")
    t = front.count.clamp_min(1).to(front.v.dtype)[..., None, None]  # (B, T, 1, 1)
    front.v, front.g = front.v * t, torch.zeros_like(front.g)
    return q / t.to(q.dtype), front


def taylor_back(o: torch.Tensor, v_mean: torch.Tensor) -> torch.Tensor:
    """``o_t + v̄_t``, with the KV head's mean shared by its G query heads. o: (B, T, G·H, V)."""
    B, T, Hq, V = o.shape
    H = v_mean.shape[2]
    return (o.view(B, T, H, Hq // H, V) + v_mean[:, :, :, None]).view(B, T, Hq, V)


def taylor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    form: str = "stable",
    rho: torch.Tensor | float | None = None,
    beta_max: float = DEFAULT_BETA_MAX,
    backend: str = "auto",
) -> torch.Tensor:
    """The linearized attention of SPEC §2, end to end: front → GDN operator → ``+ v̄``.

    Shapes as :func:`linearize.ops.gated_delta_rule`; returns ``(B, T, G·H, V)``.

    Example:
        >>> q, k, v = torch.randn(1, 50, 6, 16), torch.randn(1, 50, 2, 16), torch.randn(1, 50, 2, 16)
        >>> taylor_attention(q, k, v).shape
        torch.Size([1, 50, 6, 16])
    """
    from . import gated_delta_rule

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q = q * scale
    front = taylor_front(q, k, v, cu_seqlens=cu_seqlens, form=form, rho=rho, beta_max=beta_max)
    o, _ = gated_delta_rule(
        q=q, k=front.k, v=front.v, g=front.g, beta=front.beta, cu_seqlens=cu_seqlens, backend=backend
    )
    return taylor_back(o, front.v_mean)


def _group(q: torch.Tensor, H: int) -> torch.Tensor:
    B, T, Hq, K = q.shape
    return q.view(B, T, H, Hq // H, K)  # (B, T, H, G, K)


def uniform_attention(v: torch.Tensor, num_q_heads: int, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Zeroth order: every key weighs the same, ``o_t = v̄_t``. Returns ``(B, T, num_q_heads, V)``."""
    B, T, H, V = v.shape
    return taylor_back(v.new_zeros(B, T, num_q_heads, V), prefix_mean(v, cu_seqlens))


def vala_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """First order (seed 000, eq. va-la): ``o_t = v̄_t + ((1/t) Σ_{i≤t} v_i k_iᵀ − v̄_t k̄_tᵀ) q_t``.

    Computed in the quadratic causal form ``(1/t) Σ_{i≤t} v_i (k_i − k̄_t)·q_t``, per document.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, T, H, K = k.shape
    out = []
    for s, e in time_spans(T, cu_seqlens):
        qs, ks, vs = _group(q[:, s:e] * scale, H), k[:, s:e], v[:, s:e]
        L = e - s
        t = torch.arange(1, L + 1, dtype=k.dtype, device=k.device)
        k_mean = ks.cumsum(1) / t[None, :, None, None]  # (B, L, H, K)
        scores = torch.einsum("bthgk,bshk->bhgts", qs, ks)  # q_t·k_s
        scores = scores - torch.einsum("bthgk,bthk->bhgt", qs, k_mean)[..., None]  # q_t·(k_s − k̄_t)
        scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=k.device).tril(), 0.0)
        o = torch.einsum("bhgts,bshv->bthgv", scores, vs) / t[None, :, None, None, None]
        o = o + (vs.cumsum(1) / t[None, :, None, None])[:, :, :, None]
        out.append(o.reshape(o.shape[0], L, -1, v.shape[-1]))
    return torch.cat(out, dim=1)


def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact causal softmax attention with grouped KV heads, per document, in the input dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    B, T, H, K = k.shape
    out = []
    for s, e in time_spans(T, cu_seqlens):
        qs, ks, vs = _group(q[:, s:e] * scale, H), k[:, s:e], v[:, s:e]
        L = e - s
        scores = torch.einsum("bthgk,bshk->bhgts", qs, ks)
        scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=k.device).tril(), float("-inf"))
        o = torch.einsum("bhgts,bshv->bthgv", scores.softmax(-1), vs)
        out.append(o.reshape(o.shape[0], L, -1, v.shape[-1]))
    return torch.cat(out, dim=1)
