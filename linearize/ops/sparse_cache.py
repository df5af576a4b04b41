"""A sparse exact cache beside the sink + sliding-window block (``GDNOptions.sparse_cache = C``).

The window block reads every token older than its window through the Taylor-GDN state, which cannot be
sharp: a head that retrieves one token out of thousands (a passkey, a name read back) misses it
(``scripts/retrieval_capacity.py``). Sparse caching (LoLA, McDermott et al. 2025) keeps, per KV head, ``C``
of the older tokens exactly — keys and values, a fixed size like the window — chosen by a score as they
leave the window, the lowest-scored evicted when full. The exact softmax then covers sinks, window and
cache under one normalizer; the state still takes every older token, so the mix by mass is unchanged.

Here the score is a linear probe of the block's input per KV head, fitted at conversion by ridge
regression on the log of the largest attention the teacher pays the token from ``window`` or more tokens
later (:func:`far_attention`, :func:`fit_probe`) — causal and query-independent, so the cache at query
``t`` is simply the ``C`` best-scored tokens older than its window: what a decoder keeping a top-``C``
buffer holds. Ties (a token repeated at layer 0, whose input is its embedding alone) go to the newer token
through :func:`selection_keys`, the same numbers in training and decoding: scores are float64, whose rounding
(~1e-16) the tie-break outweighs. Inputs equal only up to the model's own rounding (a run of one token opening a
document has the same hidden states at every layer in exact arithmetic) still tie by chance in float32 models.

Candidates come as ``P`` carried entries (a decoder's cache, seen by every query) followed by one per query
(the *old stream* of :mod:`linearize.ops.window_inputs`: the token leaving the window at that step, seen by
that query and the later ones). Measured on SmolLM2-135M converted and untrained (every layer, window 64 +
4 sinks): passkey at 2K 10% → 80% with ``C = 256`` (the teacher's 80%),
``results/sparse_cache_passkey_smollm2_c256.json``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common import TRITON_MAX_K, compute_dtype

_TIE = 1e-14  # far below float32's spacing: it orders equal scores without reordering different ones
# queries per block of the selection (any size is exact): its work grows as T · (C + block). On a CPU small
# blocks win (T = 2048, C = 256: 31 against 512 ms for all queries in one block; C = 1,024, a fresh prefill's
# cache_softmax: 0.26 against 0.72 s in blocks of 1,024, 1.18 s reading the empty slots too); on an H200 at training's
# length they lost (16 x 2048 tokens, C = 256, forward + backward: 977 ms a step in blocks of 256 against 732 ms
# in one, results/bench_sparse_cache_training*.json), so on a GPU the blocks are 2048 queries
_BLOCK = 256
_BLOCK_GPU = 2048


def selection_keys(score: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``(B, T, H)`` float64: the order tokens are kept in — the probe's ``score`` ``(B, T, H)``, equal
    scores broken towards the later ``pos`` ``(B, T)`` (position in its document) — so that training's
    dense selection and a decoder's buffer pick the same tokens."""
    s = score.double()
    return s + _TIE * pos.double()[..., None] * (s.abs() + 1)


def probe_scores(hidden_states: torch.Tensor, probe: torch.Tensor, chunk_bytes: int = 2**28) -> torch.Tensor:
    """``(B, T, H)`` float64: the probe ``(H, F + 1)`` (weights, then a bias) on the block's input ``(B, T, F)``,
    so many tokens at a time that their float64 copy takes at most ``chunk_bytes`` (256 MB). In float64, so that a
    token's score does not depend on the call that makes it: float32 products rounded differently with the number of rows (2.4e-7 apart
    for one input row, 2 rows against 11), far above the tie-break of :func:`selection_keys`, so a prefill in chunks
    or a decode step kept another copy of a repeated token than one call did."""
    w, b = probe[:, :-1].double(), probe[:, -1].double()
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    rows = max(1, chunk_bytes // (8 * flat.shape[-1]))
    out = torch.cat([F.linear(flat[i:i + rows].double(), w, b) for i in range(0, max(flat.shape[0], 1), rows)])
    return out.view(*hidden_states.shape[:-1], w.shape[0])


def _pooled_blocks(cand_key: torch.Tensor, prior: int, size: int, cand_doc: torch.Tensor | None,
                   query_doc: torch.Tensor | None, block: int | None, kept: bool = True, thresholds=None):
    """Each block of queries ``[t0, t1)`` with the only candidates it can keep: ``(t0, t1, idx, thr, kept)``,
    ``idx`` ``(B, H, P)`` indices into the candidates — the ``size`` best seen before the block (carried from
    block to block, of the document of the query before it), then the block's own stream candidates — ``thr``
    ``(B, H, Q)`` each query's threshold, ``kept`` ``(B, H, Q, P)`` which of them each query keeps (None
    unless ``kept``). A query's ``size`` best lie among those: an older candidate that is not among the
    carried best never will be again (the seen set only grows within a document).
    Arguments as :func:`cache_threshold`; the work grows as ``T · (size + block)``, not ``T²``. ``thresholds``:
    without documents or ``kept``, what computes them from the sorted pool and each entry's first query
    (:func:`linearize.ops.triton.cache_fwd.block_thresholds`) in place of the count below."""
    B, N, H = cand_key.shape
    T, dev = N - prior, cand_key.device
    block = block or (_BLOCK if dev.type == "cpu" else max(_BLOCK_GPU, size))
    keys = cand_key.double().permute(0, 2, 1)  # (B, H, N)
    ninf = float("-inf")
    top = keys[:, :, :prior].topk(min(size, prior), -1)  # every query sees the carried ones
    carry_key, carry = top.values, top.indices
    docs = None if cand_doc is None else cand_doc[:, None, :].expand(B, H, N)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        c, Q = carry.shape[-1], t1 - t0
        idx = torch.cat([carry, torch.arange(prior + t0, prior + t1, device=dev).expand(B, H, Q)], -1)  # (B, H, P)
        pool = torch.cat([carry_key, keys[:, :, prior + t0:prior + t1]], -1)
        j = torch.arange(c + Q, device=dev)
        # each query's threshold: the key at the rank (pool sorted once) where its count of seen ones reaches size
        ordered, order = pool.sort(-1, descending=True)
        if thresholds is not None and docs is None and not kept:
            first = torch.where(torch.isfinite(pool), j - c, Q).clamp_min(-1).to(torch.int32)  # the first query seeing it
            yield t0, t1, idx, thresholds(ordered, first.gather(-1, order), Q, size), None
        else:
            seen = ((j < c) | (j - c <= torch.arange(Q, device=dev)[:, None])) & torch.isfinite(pool)[:, :, None, :]
            if docs is not None:
                pool_doc = torch.gather(docs, 2, idx)
                seen = seen & (pool_doc[:, :, None, :] == query_doc[:, None, t0:t1, None])
            count = seen.gather(-1, order[:, :, None, :].expand_as(seen)).cumsum(-1, dtype=torch.int32)
            r = torch.searchsorted(count, torch.full((B, H, Q, 1), size, dtype=torch.int32, device=dev)).squeeze(-1)
            thr = torch.where(r < c + Q, ordered.gather(-1, r.clamp_max(c + Q - 1)),
                              torch.full_like(r, ninf, dtype=pool.dtype))
            yield t0, t1, idx, thr, (seen & (pool[:, :, None, :] >= thr[..., None])) if kept else None
        if t1 == T:
            break
        if docs is not None:  # the next block's older candidates: of the document of its first query's predecessor
            pool = pool.masked_fill(pool_doc != query_doc[:, None, t1 - 1:t1], ninf)
        top = pool.topk(min(size, c + Q), -1)
        carry_key, carry = top.values, torch.gather(idx, 2, top.indices)


def cache_threshold(cand_key: torch.Tensor, prior: int, size: int, cand_doc: torch.Tensor | None = None,
                    query_doc: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """``(B, H, T)`` float64: each query's ``size``-th largest key among the candidates it sees (−inf when it
    sees fewer): the ``prior`` carried ones and stream candidate ``prior + j`` for queries ``t ≥ j``, of its own
    document where ``cand_doc`` ``(B, P + T)`` and ``query_doc`` ``(B, T)`` are given. ``cand_key``
    ``(B, P + T, H)``: −inf where there is no candidate. A query keeps the candidates with a finite key at or
    above its threshold: at most ``size`` (keys are distinct, :func:`selection_keys`). ``block``: queries per
    step of the selection (default: 256 or ``size``)."""
    B, N, H = cand_key.shape
    thr = [b[3] for b in _pooled_blocks(cand_key, prior, size, cand_doc, query_doc, block)]
    return torch.cat(thr, 2) if thr else cand_key.new_empty(B, H, 0, dtype=torch.float64)


def cache_softmax(q: torch.Tensor, cand_k: torch.Tensor, cand_v: torch.Tensor, cand_key: torch.Tensor, prior: int,
                  size: int, cand_doc: torch.Tensor | None = None, query_doc: torch.Tensor | None = None,
                  block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over its cache, block by block of queries over the few candidates each
    block can keep (linear in T); ``(o, lse)``.

    q ``(B, T, G·H, D)`` scaled; ``cand_k``/``cand_v`` ``(B, P + T, H, D)``, ``cand_key`` ``(B, P + T, H)`` as
    :func:`cache_threshold`. Returns ``o (B, T, G·H, D)`` and ``lse (B, T, G·H)`` in float32 (float64 for
    float64 q), ``lse`` −inf and ``o`` 0 for a query whose cache is empty."""
    B, T, Hq, D = q.shape
    H = cand_k.shape[2]
    G = Hq // H
    acc = compute_dtype(q.dtype)
    ck, cv = (x.to(acc).permute(0, 2, 1, 3) for x in (cand_k, cand_v))  # (B, H, N, D)
    outs, lses = [], []
    for t0, t1, idx, _, kept in _pooled_blocks(cand_key, prior, size, cand_doc, query_doc, block):
        at = idx[..., None].expand(-1, -1, -1, D)
        kb, vb = torch.gather(ck, 2, at), torch.gather(cv, 2, at)  # (B, H, P, D)
        qb = q[:, t0:t1].to(acc).view(B, t1 - t0, H, G, D).permute(0, 2, 3, 1, 4)  # (B, H, G, Q, D)
        o, lse = masked_softmax(qb, kb, vb, kept)  # (B, H, G, Q, D), (B, H, G, Q)
        outs.append(o.permute(0, 3, 1, 2, 4).reshape(B, t1 - t0, Hq, D))
        lses.append(lse.permute(0, 3, 1, 2).reshape(B, t1 - t0, Hq))
    if not outs:
        return q.new_zeros(B, 0, Hq, D, dtype=acc), q.new_zeros(B, 0, Hq, dtype=acc)
    return torch.cat(outs, 1), torch.cat(lses, 1)


def cpu_fused(q: torch.Tensor, *kv: torch.Tensor) -> bool:
    """Whether a softmax runs as torch's fused CPU attention (which returns the log-sum-exp too): on the CPU in float32
    without gradients (a prefill, scoring or a decode step; its log-sum-exp carries none)."""
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, *kv))
    return (q.device.type == "cpu" and q.dtype == torch.float32 and not needs_grad
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def masked_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` ``(B, H, M, D)`` (scaled) over ``k``/``v`` ``(B, H, P, D)`` where ``ok``
    ``(B, H, M or 1, P)`` admits a key: ``o (B, H, M, D)`` and ``lse (B, H, M)`` in q's dtype, 0 and −inf where
    none is admitted. ``q`` may also be ``(B, H, G, M, D)``, the G query heads of each KV head under one ``ok``:
    then ``o (B, H, G, M, D)``, ``lse (B, H, G, M)``. Where :func:`cpu_fused` says so, torch's fused CPU attention
    under an additive mask built once, a query head a call, reading ``k``/``v`` as they lie (a decode step's strided
    view of its cache, no copy); else composed. A prefill's :func:`cache_softmax` passes a block's G heads so: the
    ``(B, H, Q, P)`` mask is neither copied G times nor rebuilt for each head (a 2K prefill of SmolLM2 with a cache of
    1,024 on a 2-core CPU: 10.2 s against 16.6 s composed, results/prefill_cpu_sparse_cache_fused_softmax.json)."""
    grouped = q.dim() == 5
    heads = q.unbind(2) if grouped else (q,)  # one query head at a time: the (B, H, M, P) work is shared, not copied
    bad = ~ok
    if cpu_fused(q, k, v):
        mask = torch.zeros(ok.shape, dtype=q.dtype).masked_fill_(bad, float("-inf"))
        none = ~ok.any(-1)
        outs = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qg, k, v, 0.0, False, attn_mask=mask.expand(*qg.shape[:-1], k.shape[-2]), scale=1.0)[:2] for qg in heads]
        outs = [(o, lse.masked_fill(none, float("-inf"))) for o, lse in outs]
    else:
        outs = []
        for qg in heads:
            logits = (qg @ k.transpose(-1, -2)).masked_fill(bad, float("-inf"))  # (B, H, M, P)
            lse = logits.logsumexp(-1)
            outs.append(((logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]).exp() @ v, lse))
    return tuple(torch.stack(x, 2) for x in zip(*outs)) if grouped else outs[0]


def merge_softmax(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                  lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One softmax over two disjoint key sets from each's ``(o (B, T, Hq, D), lse (B, T, Hq))``: the outputs
    weighted by their share of the mass, the normalizers added (−inf parts, empty sets, weigh 0)."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    w_a = torch.where(finite, (lse_a - lse).exp(), torch.zeros_like(lse))[..., None]
    w_b = torch.where(finite, (lse_b - lse).exp(), torch.zeros_like(lse))[..., None]
    return w_a * o_a + w_b * o_b.to(o_a.dtype), lse


def stream_keys(token_key: torch.Tensor, old_ok: torch.Tensor, window: int, past: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, T, H)`` float64: the selection key of the old stream's token at each step — the token ``window``
    steps back, from ``past`` ``(B, W, H)`` (a decoder's window keys; −inf slots for a fresh sequence) then
    ``token_key`` ``(B, T, H)`` — −inf where ``old_ok`` ``(B, T)`` says that step writes nothing."""
    B, T, H = token_key.shape
    past = token_key.new_full((B, window, H), float("-inf"), dtype=torch.float64) if past is None else past
    keys = torch.cat([past.double(), token_key.double()], 1)[:, :T]
    return keys.masked_fill(~old_ok[..., None], float("-inf"))


def far_attention(q: torch.Tensor, k: torch.Tensor, window: int, block: int = 512) -> torch.Tensor:
    """``(B, T, H)`` float64: per token and KV head, the log of the largest softmax attention any query head of
    that KV head pays it from ``window`` or more tokens later (causal softmax over the whole row; clamped at
    1e-6, the value of tokens no later query reaches). q ``(B, T, G·H, D)`` scaled, k ``(B, T, H, D)``, each row
    one document from its start: the target :func:`fit_probe` fits."""
    B, T, Hq, D = q.shape
    H = k.shape[2]
    kd = k.double()
    best = torch.full((B, H, T), 1e-6, dtype=torch.float64, device=q.device)
    s = torch.arange(T, device=q.device)
    for t0 in range(0, T, block):  # a block of queries against the keys up to its last one
        t = torch.arange(t0, min(T, t0 + block), device=q.device)
        n = t0 + len(t)
        logits = torch.einsum("bthgd,bshd->bhgts", q[:, t0:n].double().view(B, len(t), H, Hq // H, D), kd[:, :n])
        p = logits.masked_fill(s[None, :n] > t[:, None], float("-inf")).softmax(-1)
        p = p.masked_fill(t[:, None] - s[None, :n] < window, 0)  # (B, H, G, Q, n)
        best[..., :n] = torch.maximum(best[..., :n], p.amax((2, 3)))
    return best.log().transpose(1, 2)


def fit_probe(features: torch.Tensor, target: torch.Tensor, ridge: float = 1e-2) -> torch.Tensor:
    """``(H, F + 1)`` float64: per KV head, the ridge regression of ``target`` ``(B, T, H)`` on ``features``
    ``(B, T, F)`` and a bias (``ridge`` scaled by the number of rows), as :func:`probe_scores` reads it."""
    x = features.reshape(-1, features.shape[-1]).double()
    x = torch.cat([x, torch.ones_like(x[:, :1])], 1)
    y = target.reshape(-1, target.shape[-1]).double()
    a = x.T @ x + ridge * x.shape[0] * torch.eye(x.shape[1], dtype=x.dtype, device=x.device)
    return torch.linalg.solve(a, x.T @ y).T


@dataclass
class CacheBuffers:
    """What decoding keeps of the cache, per row: ``C`` tokens per KV head and the window's selection keys
    (a token's key must be known when it leaves the window)."""

    k: torch.Tensor  # (B, C, H, D)
    v: torch.Tensor
    key: torch.Tensor  # (B, C, H) float64: the kept tokens' selection keys; -inf = empty slot
    win_key: torch.Tensor  # (B, W, H) float64: the window's tokens' keys, oldest first; -inf = none

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.key, self.win_key]

    @classmethod
    def empty(cls, like: torch.Tensor, size: int, window: int) -> CacheBuffers:
        B, _, H, D = like.shape
        inf = dict(dtype=torch.float64, device=like.device)
        return cls(like.new_zeros(B, size, H, D), like.new_zeros(B, size, H, D),
                   torch.full((B, size, H), float("-inf"), **inf), torch.full((B, window, H), float("-inf"), **inf))


def token_keys(hidden_states: torch.Tensor, probe: torch.Tensor, pos: torch.Tensor, sinks: int) -> torch.Tensor:
    """``(B, T, H)`` float64: each token's selection key, −inf for the sinks and padding (``pos`` ≤ ``sinks``;
    ``pos`` ``(B, T)``: position in its document from 1, padding 0), which are never cache candidates."""
    return score_keys(probe_scores(hidden_states, probe), pos, sinks)


def score_keys(score: torch.Tensor, pos: torch.Tensor, sinks: int) -> torch.Tensor:
    """:func:`token_keys` from the probe's ``score`` ``(B, T, H)``: :func:`selection_keys`, −inf where ``pos`` ≤ ``sinks``."""
    return selection_keys(score, pos).masked_fill((pos <= sinks)[..., None], float("-inf"))


def fresh_cache(q: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor, old_ok: torch.Tensor, token_key: torch.Tensor,
                cand_doc: torch.Tensor, query_doc: torch.Tensor, window: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of each query's cache in a sequence from its start (dense; see :func:`cache_softmax`): the
    old stream ``old_k``/``old_v`` ``(B, T, H, D)``, ``old_ok`` ``(B, T)``, its documents ``cand_doc`` ``(B, T)``."""
    keys = stream_keys(token_key, old_ok, window)
    return cache_softmax(q, old_k, old_v, keys, 0, size, cand_doc, query_doc)


def cached_cache(q: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor, old_ok: torch.Tensor, token_key: torch.Tensor,
                 past: CacheBuffers, window: int, size: int, backend: str = "auto",
                 fresh: bool = False) -> tuple[torch.Tensor, torch.Tensor, CacheBuffers]:
    """``(o, lse, buffers after)``: a continuation from ``past``, whose ``size`` tokens every query sees beside
    the old stream's (``fresh``: ``past`` is empty, and the softmax skips its slots). The buffers after keep
    the ``size`` best-keyed candidates and the window's last keys.
    Reads nothing on the host (a decode step through it can be captured in a CUDA graph). Without gradients
    on CUDA (a prefill; ``backend="triton"``: also under the interpreter) the softmax is one Triton kernel a
    block of queries (:func:`linearize.ops.triton.cache_fwd.cache_softmax_triton`)."""
    from .window import window_triton_usable

    stream = stream_keys(token_key, old_ok, window, past.win_key)
    cand_key = torch.cat([past.key, stream], 1)  # (B, C + T, H)
    cand_k, cand_v = (torch.cat([a, b.to(a.dtype)], 1) for a, b in ((past.k, old_k), (past.v, old_v)))
    prior = 0 if fresh else size
    cand = [x[:, size - prior:] for x in (cand_k, cand_v, cand_key)]
    if window_triton_usable(q, backend) and q.shape[-1] <= TRITON_MAX_K:
        from .triton.cache_fwd import cache_softmax_triton

        o, lse = cache_softmax_triton(q, *cand, prior, size)
    else:
        o, lse = cache_softmax(q, *cand, prior, size)
    best = cand_key.topk(size, dim=1).indices  # (B, C, H): what the next query sees of these
    gather = lambda x: torch.gather(x, 1, best[..., None].expand(-1, -1, -1, x.shape[-1]))  # noqa: E731
    win_key = torch.cat([past.win_key, token_key.double()], 1)[:, -window:]
    return o, lse, CacheBuffers(gather(cand_k), gather(cand_v), torch.gather(cand_key, 1, best), win_key)


def cache_step_(q: torch.Tensor, old_k: torch.Tensor, old_v: torch.Tensor, old_ok: torch.Tensor,
                token_key: torch.Tensor, past: CacheBuffers, window: int) -> tuple[torch.Tensor, torch.Tensor, CacheBuffers]:
    """:func:`cached_cache` for one decode step (``T = 1``), its buffers updated in place: of the ``C`` kept
    tokens and the one leaving the window, the query attends to all but the lowest-keyed, and the newcomer
    takes that one's slot when it was a kept token (an empty slot, −inf, goes first). A handful of kernels
    instead of a selection's sort, and no new buffers: what a captured decode step replays."""
    B, _, Hq, D = q.shape
    H = past.key.shape[2]
    acc = compute_dtype(q.dtype)
    _offer_(past, old_k, old_v, stream_keys(token_key, old_ok, window, past.win_key))  # kept: the filled slots after it
    logits = torch.einsum("bhgd,bphd->bhgp", q[:, 0].to(acc).view(B, H, Hq // H, D), past.k.to(acc))
    logits = logits.masked_fill(~torch.isfinite(past.key).permute(0, 2, 1)[:, :, None, :], float("-inf"))
    lse = logits.logsumexp(-1)  # (B, H, G)
    p = (logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None]).exp()
    o = torch.einsum("bhgp,bphd->bhgd", p, past.v.to(acc)).reshape(B, 1, Hq, D)
    win_key = torch.cat([past.win_key, token_key.double()], 1)[:, -window:]
    return o, lse.reshape(B, 1, Hq), CacheBuffers(past.k, past.v, past.key, win_key)


def _offer_(cache: CacheBuffers, k: torch.Tensor, v: torch.Tensor, key: torch.Tensor) -> None:
    """In place: a candidate (``k``, ``v`` ``(B, 1, H, D)``, ``key`` ``(B, 1, H)``) takes the lowest-keyed slot (the
    first of equals, so an empty one, −inf, goes first) when its key is at least that one's: the slots then hold
    the best ``C`` of the ``C + 1``."""
    if torch.compiler.is_compiling():  # traced (a compiled CPU step): an indexed write, which the compiler keeps in
        B, _, H = cache.key.shape      # place, where it copies a scattered buffer whole (the step 1.45x faster)
        slot, b, h = cache.key.argmin(1), torch.arange(B, device=key.device)[:, None], torch.arange(H, device=key.device)
        low = cache.key[b, slot, h]  # (B, H)
        take = key[:, 0] >= low
        for buf, x in ((cache.k, k), (cache.v, v)):
            buf[b, slot, h] = torch.where(take[..., None], x[:, 0].to(buf.dtype), buf[b, slot, h])
        cache.key[b, slot, h] = torch.where(take, key[:, 0], low)
        return
    slot = cache.key.argmin(1, keepdim=True)  # (B, 1, H)
    take = key >= cache.key.gather(1, slot)
    at = slot[..., None].expand(-1, -1, -1, cache.k.shape[-1])
    for buf, x in ((cache.k, k), (cache.v, v)):
        buf.scatter_(1, at, torch.where(take[..., None], x.to(buf.dtype), buf.gather(1, at)))
    cache.key.scatter_(1, slot, torch.where(take, key, cache.key.gather(1, slot)))


def cache_enter_(cache: CacheBuffers, win_k: torch.Tensor, win_v: torch.Tensor, win_pos: torch.Tensor,
                 token_key: torch.Tensor, sinks: int) -> None:
    """Before a fused decode step (:func:`linearize.ops.window_step.sink_window_gdn_step_`), in place: the token
    leaving the window (slot 0 of ``win_k``/``win_v`` ``(B, W, H, D)``, real and no sink where ``win_pos`` ``(B, W)``
    says so) takes the lowest-keyed of the ``C`` slots when its key is at least that one's (an empty slot, −inf,
    goes first), and the new token's key ``token_key`` ``(B, H)`` enters the window's keys. The slots then hold
    what :func:`cache_step_` attends to: the step's exact part reads them as keys where their key is finite."""
    new = cache.win_key[:, :1].masked_fill(~(win_pos[:, :1] > sinks)[..., None], float("-inf"))  # (B, 1, H)
    _offer_(cache, win_k[:, :1], win_v[:, :1], new)
    cache.win_key.copy_(torch.cat([cache.win_key[:, 1:], token_key.double()[:, None]], 1))


def sink_window_cache_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_doc: torch.Tensor,
                           query_doc: torch.Tensor, pos: torch.Tensor, window: int, sinks: int, token_key: torch.Tensor,
                           old_ok: torch.Tensor, size: int, compiled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linearize.ops.window.sink_window_flex` with the cache in the same softmax: query ``t`` also sees
    the key ``s`` older than its window whose selection key is finite and at least its threshold
    (:func:`cache_threshold` over its old stream). For a fresh sequence in training on CUDA: one fused kernel
    each way, the selection (no gradient) beside it. Arguments as ``sink_window_flex``, plus ``token_key``
    ``(B, T, H)`` (:func:`token_keys`) and the old stream's ``old_ok`` ``(B, T)``."""
    from torch.nn.attention.flex_attention import flex_attention

    from .window import _flex_attention, block_mask

    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    doc_before = torch.cat([key_doc.new_full((B, window), -1), key_doc], 1)[:, :T]  # the stream token's document
    thr = cache_threshold(stream_keys(token_key, old_ok, window), 0, size, doc_before, query_doc)  # (B, H, T)
    # the kernel compares integers (it compiles no float64, and a bool tensor read in the mask costs it 10x on
    # the H200): each key's rank among its row's keys (-1: no candidate; past every threshold: a sink) and the
    # rank of each query's threshold key (keys are distinct; a threshold of -inf ranks 0, below every candidate)
    tk = token_key.double().permute(0, 2, 1).contiguous()  # (B, H, T)
    ordered, order = tk.sort(-1)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(T, device=q.device).expand_as(order)).int()
    rank = rank.masked_fill(~torch.isfinite(tk), -1).masked_fill((pos <= sinks)[:, None, :], T + 1)
    thr_rank = torch.searchsorted(ordered, thr.contiguous()).int()
    kdoc, qdoc = key_doc.int(), query_doc.int()

    def seen(b, h, t, s):  # a sink or a kept key is seen from past the window on (sinks inside it anyway)
        return (qdoc[b, t] == kdoc[b, s]) & (s <= t) & ((t - s < window) | (rank[b, h // G, s] >= thr_rank[b, h // G, t]))

    mask = block_mask(seen, B, Hq, T, q.device, compiled)
    dt = k.dtype if k.dtype in (torch.bfloat16, torch.float16) else torch.float32
    fn = _flex_attention() if compiled else flex_attention
    o, lse = fn(q.to(dt).transpose(1, 2), k.to(dt).transpose(1, 2), v.to(dt).transpose(1, 2), block_mask=mask,
                scale=1.0, enable_gqa=G != 1, return_lse=True)
    return o.transpose(1, 2).float(), lse.transpose(1, 2).float()
