"""Near-duplicate documents, found by MinHash over token shingles and banded locality-sensitive hashing.

Exact deduplication (``documents.doc_hash``) misses a page and its one-word edit, or two man pages of sibling
character sets: measured on the real ``manpages`` source, 0.4% of its pieces had a twin sharing ≥ 80% of their
8-word shingles (here shingles are 8 token ids), and one held-out piece (``koi8-u.7``) had its twin (``koi8-r.7``) in the training split, so the
held-out perplexity read a page the model had trained on. :class:`NearDuplicates` keeps the first of each group of
near-twins, whichever split its hash would give it, so no held-out document has a near-twin left in training.

A document is its token ids; its shingles are the ``SHINGLE`` consecutive ids, hashed together (deterministic:
no Python ``hash``); its signature is the minimum, over its shingles, of ``PERMUTATIONS`` multiply-shift hashes.
Two documents whose shingle sets have Jaccard similarity s agree on each signature entry with probability s. The
signature is cut in ``BANDS`` bands; a document sharing a band with an earlier kept one is compared with it on the
whole signature, and is a near-duplicate when they agree on at least ``THRESHOLD`` of it (a pair at s = 0.8 becomes
a candidate with probability 1 − (1 − 0.8⁴)⁸ ≈ 0.985; at s = 0.5, 0.40, then mostly rejected by the comparison).
"""

from __future__ import annotations

import numpy as np

SHINGLE = 8  # token ids a shingle
PERMUTATIONS = 32
BANDS = 8  # of PERMUTATIONS // BANDS entries each
THRESHOLD = 0.8  # share of signature entries two near-duplicates agree on (the estimated Jaccard similarity)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd constants: a shingle's ids folded into one 64-bit value
_SEEDS = np.random.default_rng(20261205).integers(1, 2**63, size=(2, PERMUTATIONS), dtype=np.uint64) | np.uint64(1)


def shingle_hashes(ids: np.ndarray, size: int = SHINGLE) -> np.ndarray:
    """``(n − size + 1,)`` uint64: each run of ``size`` consecutive ids folded into one value (the whole document
    as one shingle when it is shorter)."""
    ids = np.asarray(ids, dtype=np.uint64)
    if len(ids) == 0:
        return np.zeros(1, dtype=np.uint64)
    size = min(size, len(ids))
    h = np.zeros(len(ids) - size + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):  # the folding wraps modulo 2⁶⁴ on purpose
        for j in range(size):
            h = (h ^ ids[j: len(ids) - size + 1 + j]) * _MIX
            h ^= h >> np.uint64(29)
    return h


def signature(ids: np.ndarray) -> np.ndarray:
    """``(PERMUTATIONS,)`` uint64: per multiply-shift hash ``(a·x + b) mod 2⁶⁴``, its minimum over the shingles."""
    h = np.unique(shingle_hashes(ids))
    with np.errstate(over="ignore"):
        return (h[None, :] * _SEEDS[0][:, None] + _SEEDS[1][:, None]).min(1)


class NearDuplicates:
    """The documents kept so far; :meth:`seen` tells whether a new one nearly repeats one of them, and keeps it if
    not."""

    def __init__(self, threshold: float = THRESHOLD, bands: int = BANDS):
        self.threshold, self.bands = threshold, bands
        self.rows = PERMUTATIONS // bands
        self.buckets: dict[tuple[int, bytes], list[int]] = {}
        self.signatures: list[np.ndarray] = []

    def seen(self, ids) -> bool:
        sig = signature(ids)
        keys = [(b, sig[b * self.rows:(b + 1) * self.rows].tobytes()) for b in range(self.bands)]
        candidates = {i for key in keys for i in self.buckets.get(key, ())}
        if any(np.mean(self.signatures[i] == sig) >= self.threshold for i in candidates):
            return True
        index = len(self.signatures)
        self.signatures.append(sig)
        for key in keys:
            self.buckets.setdefault(key, []).append(index)
        return False
