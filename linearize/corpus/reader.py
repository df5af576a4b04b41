"""Read a built corpus. Torch-free; loads safetensors and parquet only (nothing in the folder can run code).

    >>> from linearize.corpus import open_corpus
    >>> c = open_corpus("/work/corpus/smollm2")           # doctest: +SKIP
    >>> c.domains                                         # doctest: +SKIP
    ('prose', 'docs', 'code')
    >>> doc = next(c.documents("prose", "heldout"))       # a 1-D int64 numpy array of token ids
    >>> c.splits                                          # doctest: +SKIP
    ('train', 'heldout', 'test')
    >>> for domain, doc in c.mixture("train", {"prose": 1, "docs": 1, "code": 1}, tokens=10_000_000):
    ...     ...
    >>> text = c.texts("prose", "heldout")[0]             # that document's text, as extracted
    >>> import datasets                                   # the text through datasets, one config per domain:
    >>> ds = datasets.load_dataset("/work/corpus/smollm2", "prose")  # its splits; columns text, source

``heldout`` is for measuring while developing (the in-training evaluation, choosing a recipe), ``test``
for the figures reported once the choices are made; corpora built before the test split have none.

Documents carry no special tokens; put the tokenizer's end-of-text id
(``c.manifest["tokenizer"]["special_tokens"]["<|endoftext|>"]``) between them when packing.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from .shards import read_shard
from .texts import read_texts

SPLITS = ("train", "heldout", "test")


class Corpus:
    def __init__(self, folder: Path, manifest: dict):
        self.folder = folder
        self.manifest = manifest
        self.domains: tuple[str, ...] = tuple(manifest["domains"])
        self.splits: tuple[str, ...] = tuple(s for s in SPLITS if all(s in d for d in manifest["domains"].values()))
        self.vocab_size: int = manifest["tokenizer"]["vocab_size"]
        self._arrays: dict = {}
        # corpora built before the text was kept have token shards only
        self.has_text: bool = all("text_shards" in s for d in manifest["domains"].values() for s in d.values())

    def _check(self, domain: str, split: str) -> None:
        if domain not in self.domains:
            raise ValueError(f"no domain {domain!r} in {self.folder}; it has {', '.join(self.domains)}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}; got {split!r}")
        if split not in self.splits:
            raise ValueError(f"{self.folder} has no {split!r} split (built before it existed, or with --test 0); "
                             "rebuild it with 'linearize data build'")

    def tokens(self, domain: str, split: str = "train") -> int:
        self._check(domain, split)
        return self.manifest["domains"][domain][split]["tokens"]

    def arrays(self, domain: str, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, offsets)`` of a domain's split, its shards joined (cached after the first call)."""
        self._check(domain, split)
        key = (domain, split)
        if key not in self._arrays:
            toks, offs, base = [], [np.zeros(1, dtype=np.int64)], 0
            for shard in self.manifest["domains"][domain][split]["shards"]:
                t, o, _, _ = read_shard(self.folder / shard["file"])
                toks.append(t)
                offs.append(o[1:] + base)
                base += len(t)
            dtype = np.dtype(self.manifest["token_dtype"])
            self._arrays[key] = (np.concatenate(toks) if toks else np.zeros(0, dtype), np.concatenate(offs))
        return self._arrays[key]

    def text_table(self, domain: str, split: str = "train"):
        """The split's text as a pyarrow table (columns ``text``, ``source``), row ``i`` document ``i``
        of :meth:`arrays`; its parquet shards joined."""
        import pyarrow as pa

        self._check(domain, split)
        if not self.has_text:
            raise ValueError(f"{self.folder} holds tokens only (built before the text was kept); "
                             "rebuild it with 'linearize data build' for the documents' text")
        entry = self.manifest["domains"][domain][split]
        return pa.concat_tables([read_texts(self.folder / t["file"], t["documents"]) for t in entry["text_shards"]])

    def texts(self, domain: str, split: str = "train") -> list[str]:
        """The split's documents' text, as extracted (tokenized, each is :meth:`documents`' array)."""
        return self.text_table(domain, split).column("text").to_pylist()

    def documents(self, domain: str, split: str = "train"):
        """The split's documents in stored order (hash order: any prefix is a uniform sample), each
        a 1-D int64 array of token ids."""
        tokens, offsets = self.arrays(domain, split)
        for i in range(len(offsets) - 1):
            yield tokens[offsets[i]:offsets[i + 1]].astype(np.int64)

    def budgets(self, weights: dict | None, tokens: int | None, split: str = "train") -> dict:
        """Tokens to take per domain: ``weights`` (default: each domain's own size) scaled to
        ``tokens`` (default: the most the data allows at those proportions). A domain that runs
        short gives its share to the others."""
        have = {d: self.tokens(d, split) for d in self.domains}
        if weights is None:
            weights = dict(have)
        unknown = [d for d in weights if d not in self.domains]
        if unknown:
            raise ValueError(f"weights name domain {unknown[0]!r}; the corpus has {', '.join(self.domains)}")
        if any(w < 0 for w in weights.values()) or not any(w > 0 and have[d] for d, w in weights.items()):
            raise ValueError(f"weights must be >= 0 with one > 0 for a domain that has tokens; got {weights}")
        active = {d: float(w) for d, w in weights.items() if w > 0 and have[d]}
        if tokens is None:  # the domain that runs out first bounds the mixture
            scale = min(have[d] / w for d, w in active.items())
            return {d: int(w * scale) for d, w in active.items()}
        out, left = {}, tokens
        while active and left > 0:
            total = sum(active.values())
            want = {d: left * w / total for d, w in active.items()}
            short = {d for d in active if have[d] - out.get(d, 0) <= want[d]}
            if not short:
                for d in active:
                    out[d] = out.get(d, 0) + int(want[d])
                break
            for d in short:  # these give all they have; the rest is shared again
                left -= have[d] - out.get(d, 0)
                out[d] = have[d]
                del active[d]
        return out

    def mixture(self, split: str = "train", weights: dict | None = None, tokens: int | None = None, seed: int = 0):
        """``(domain, document)`` pairs drawn from every domain by :meth:`budgets` (about ``tokens``
        in all, each domain's first documents up to its budget), interleaved in a seeded order."""
        budgets = self.budgets(weights, tokens, split)
        picked = []
        for d, budget in budgets.items():
            _, offsets = self.arrays(d, split)
            k = int(np.searchsorted(offsets, budget, side="left"))  # documents 0..k-1 reach the budget
            picked += [(d, i) for i in range(min(k, len(offsets) - 1))]
        random.Random(seed).shuffle(picked)
        for d, i in picked:
            tokens_, offsets = self.arrays(d, split)
            yield d, tokens_[offsets[i]:offsets[i + 1]].astype(np.int64)


def open_corpus(folder) -> Corpus:
    """The corpus in ``folder`` (written by ``linearize data build``/``subset``)."""
    folder = Path(folder).expanduser()
    path = folder / "manifest.json"
    if not path.is_file():
        raise ValueError(f"{folder} is not a corpus (no manifest.json); build one with 'linearize data build'")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != "linearize-corpus/1":
        raise ValueError(f"{path}: unknown format {manifest.get('format')!r}; rebuild with 'linearize data build'")
    return Corpus(folder, manifest)
