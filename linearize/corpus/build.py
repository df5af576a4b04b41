"""Build a corpus: fetch each source's packages, extract and tokenize its documents (tokens and
text cached per source, so a second run resumes), deduplicate (exact copies, then near-twins:
``corpus.neardup``), split off the held-out documents, write per-domain token shards, the same documents' text as parquet beside them, ``manifest.json``
and a ``datasets`` card into a temporary folder and rename it into place.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

from . import documents, shards, sources, texts
from .extract import EXTRACTORS
from .fetch import DEFAULT_CACHE, fetch
from .neardup import NearDuplicates
from .tokenizer import encode, load_tokenizer

EXTRACT_VERSION = 3  # bump when the shared text handling changes: every cached token file is redone
EXTRACTOR_VERSIONS = {"osis": 3}  # bump one extractor's entry when only it changes
CACHE_FORMAT = 2  # bump when what a source's cache holds changes (2: the text beside the tokens)
DEFAULT_TOKENS = 150_000_000
HELDOUT = 0.01
TEST = 0.01  # the test split: documents kept out of training and of every choice made while developing
SHARD_TOKENS = 16_000_000  # 32 MB of uint16 per shard file
CAP_HEADROOM = 1.15  # a capped source is read to this times its cap: copies of earlier documents cost up to 6%


class CorpusError(ValueError):
    """Bad input to the corpus builder: one line naming the problem and the fix."""


def check_output(out: Path, force: bool) -> None:
    """Before anything slow: ``out`` must be new (or ``force``) and its parent writable."""
    if out.exists() and not force:
        raise CorpusError(f"{out} exists; pass --force to replace it or choose another --out")
    if out.exists() and not out.is_dir():
        raise CorpusError(f"{out} is a file; give a folder for --out")
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise CorpusError(f"{parent} is a file, not a folder; choose another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CorpusError(f"cannot write into {parent}; choose a writable --out")


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def source_files(src: sources.Source, roots: list[Path]) -> list[Path]:
    """The files a source reads, in a fixed pseudo-random order (so a capped source samples its
    whole package rather than its first folders)."""
    files = set()
    for root in roots:
        for pattern in src.include:
            for p in root.glob(pattern):
                rel = p.relative_to(root).as_posix()
                if p.is_file() and not any(fnmatch.fnmatch(rel, x) for x in src.exclude):
                    files.add(p)
    ordered = sorted(files)
    random.Random(src.name).shuffle(ordered)
    return ordered


def _cache_key(src: sources.Source, versions: list[str], tok_info: dict) -> str:
    spec = repr((CACHE_FORMAT, src.packages, src.extractor, src.include, src.exclude, src.inner, versions,
                 EXTRACTOR_VERSIONS.get(src.extractor, EXTRACT_VERSION),
                 documents.MAX_CHARS, documents.MIN_CHARS, tok_info["name"], tok_info["vocab_size"]))
    return hashlib.sha1(spec.encode()).hexdigest()[:12]


def tokenize_source(src, packages, tok, tok_info, cap: int | None, cache: Path, dtype) -> dict:
    """The source's documents as ``{tokens, offsets, hashes, texts, stats}``, from the cache when it
    holds enough (all of the source, or at least ``cap`` tokens), else extracted and tokenized now.
    The cache is a token shard (``.safetensors``) and the documents' text (``.parquet``, same stem)."""
    path = cache / "tokens" / tok_info["name"].replace("/", "_") / \
        f"{src.name}-{_cache_key(src, [p.version for p in packages], tok_info)}.safetensors"
    text_path = path.with_suffix(".parquet")
    if path.is_file() and text_path.is_file():  # the text is written first: a token file alone is a torn write
        tokens, offsets, stats, extra = shards.read_shard(path)
        if stats["exhausted"] or (cap is not None and stats["tokens"] >= cap):
            table = texts.read_texts(text_path, len(offsets) - 1)
            return _capped({"tokens": tokens, "offsets": offsets, "hashes": extra["hashes"],
                            "texts": table.column("text").to_pylist(), "stats": stats}, cap)
    files = source_files(src, [p.root for p in packages])
    if not files:
        raise CorpusError(f"source {src.name}: no files match {src.include} in {', '.join(p.name for p in packages)}; "
                          "the package layout changed, update linearize/corpus/sources.py")
    extract = EXTRACTORS[src.extractor]
    parts, hashes, doc_texts, seen = [], [], [], set()
    stats = {"files": 0, "skipped_files": 0, "bytes": 0, "documents": 0, "tokens": 0, "duplicates": 0,
             "exhausted": True}
    batch: list[str] = []

    def flush():
        for text, ids in zip(batch, encode(tok, batch)):
            parts.append(np.asarray(ids, dtype=dtype))
            stats["tokens"] += len(ids)
            stats["bytes"] += len(text.encode())
        doc_texts.extend(batch)
        batch.clear()

    t0 = time.time()
    for n, file in enumerate(files):
        if cap is not None and stats["tokens"] >= cap:
            stats["exhausted"] = False
            break
        try:
            found = list(documents.pieces(extract(file)))
        except (ValueError, OSError, EOFError, UnicodeError, AssertionError) as e:  # a damaged file: skip it
            stats["skipped_files"] += 1
            _log(f"  {src.name}: skipped {file.name} ({type(e).__name__})")
            continue
        stats["files"] += 1
        for text in found:
            h = documents.doc_hash(text)
            if h in seen:
                stats["duplicates"] += 1
                continue
            seen.add(h)
            hashes.append(h)
            batch.append(text)
        if len(batch) >= 512:
            flush()
        if n % 500 == 0 and n:
            _log(f"  {src.name}: {n}/{len(files)} files, {stats['tokens'] / 1e6:.1f}M tokens, {time.time() - t0:.0f}s")
    flush()
    stats["documents"] = len(parts)
    tokens, offsets = shards.concat(parts, dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    texts.write_texts(text_path, doc_texts, [src.name] * len(doc_texts))
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    shards.write_shard(tmp, tokens, offsets, stats, hashes=np.asarray(hashes, dtype=np.uint64))
    tmp.rename(path)
    return _capped({"tokens": tokens, "offsets": offsets, "hashes": np.asarray(hashes, dtype=np.uint64),
                    "texts": doc_texts, "stats": stats}, cap)


def _capped(data: dict, cap: int | None) -> dict:
    """The first documents up to the one that reaches ``cap`` tokens (all when ``cap`` is None)."""
    offsets = data["offsets"]
    if cap is None or offsets[-1] <= cap:
        return data
    k = int(np.searchsorted(offsets, cap, side="left"))  # offsets[k] >= cap: documents 0..k-1
    stats = dict(data["stats"], documents=k, tokens=int(offsets[k]), exhausted=False,
                 bytes=sum(len(t.encode()) for t in data["texts"][:k]))
    return {"tokens": data["tokens"][: offsets[k]], "offsets": offsets[: k + 1], "hashes": data["hashes"][:k],
            "texts": data["texts"][:k], "stats": stats}


def _write_domains(tmp: Path, domain_docs: dict, dtype, shard_tokens: int) -> dict:
    """Each domain's splits (``{"tokens": [...], "text": [...] or None, "source": [...] or None}``,
    one entry per document) as token shards and, where there is text, parquet shards beside them."""
    out = {}
    for domain, splits in domain_docs.items():
        folder = tmp / domain
        folder.mkdir()
        out[domain] = {}
        for split, docs in splits.items():
            parts = docs["tokens"]
            files = shards.write_split(folder, split, parts, dtype, shard_tokens)
            out[domain][split] = {"documents": len(parts), "tokens": int(sum(len(p) for p in parts)), "shards": files}
            if docs["text"] is not None:
                out[domain][split]["text_shards"] = texts.write_split(folder, docs["text"], docs["source"], files)
    return out


def write_atomic(out: Path, force: bool, fill) -> None:
    """``fill(tmp)`` writes the corpus into a temporary folder beside ``out``, renamed into place only
    when complete (:func:`linearize.saving.write_folder`); on any error or Ctrl-C nothing is left behind
    and a corpus it was replacing is back in place."""
    from ..saving import write_folder

    def checked(tmp: Path) -> None:
        fill(tmp)
        if out.exists() and not force:
            raise CorpusError(f"{out} appeared while building; pass --force to replace it")

    write_folder(out, checked)


def write_corpus(out: Path, force: bool, manifest: dict, domain_docs: dict, dtype, shard_tokens: int) -> dict:
    """Shard ``domain_docs`` and write them with ``manifest`` (completed with the domains and the total)."""

    def fill(tmp: Path):
        manifest["domains"] = _write_domains(tmp, domain_docs, dtype, shard_tokens)
        manifest["total_tokens"] = sum(s["tokens"] for d in manifest["domains"].values() for s in d.values())
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if all("text_shards" in s for d in manifest["domains"].values() for s in d.values()):
            texts.write_card(tmp, manifest["domains"])

    write_atomic(out, force, fill)
    return manifest


def build(out: Path, tokens: int = DEFAULT_TOKENS, tokenizer: str = "smollm2-135m", names: list[str] | None = None,
          cache: Path = DEFAULT_CACHE, force: bool = False, heldout: float = HELDOUT,
          shard_tokens: int = SHARD_TOKENS, command: str = "", test: float = TEST) -> dict:
    """Build the corpus into ``out``; returns the manifest. Caps in the sources table are for
    :data:`DEFAULT_TOKENS` and scale with ``tokens``; uncapped sources are always read in full."""
    out = Path(out)
    try:
        chosen = sources.select(names)
    except ValueError as e:
        raise CorpusError(f"--sources: {e}") from None
    if not 0 < heldout < 0.5:
        raise CorpusError(f"--heldout must be in (0, 0.5); got {heldout}")
    if not 0 <= test < 0.5:
        raise CorpusError(f"--test must be in [0, 0.5); got {test}")
    check_output(out, force)
    tok, tok_info = load_tokenizer(tokenizer, cache)
    dtype = shards.token_dtype(tok_info["vocab_size"])
    scale = tokens / DEFAULT_TOKENS
    fetched = {}
    for src in chosen:  # every download first: a missing package stops the build before hours of work
        for name in src.packages:
            if name not in fetched:
                _log(f"fetch {name}")
                fetched[name] = fetch(name, cache, src.inner)
    table, seen, near = [], set(), NearDuplicates()
    splits = ("train", "heldout", "test") if test else ("train", "heldout")
    keyed = {d: {sp: [] for sp in splits} for d in sources.DOMAINS if any(s.domain == d for s in chosen)}
    for src in chosen:
        cap = None if src.cap is None else max(1, round(src.cap * scale))
        pkgs = [fetched[n] for n in src.packages]
        _log(f"source {src.name} ({src.domain}, cap {cap if cap is not None else 'none'})")
        # a cap counts the tokens kept: read past it by what the copies dropped below may cost
        data = tokenize_source(src, pkgs, tok, tok_info, None if cap is None else round(cap * CAP_HEADROOM), cache,
                               dtype)
        offsets, kept, dup, neardup = data["offsets"], {"documents": 0, "tokens": 0}, 0, 0
        stop = len(data["texts"])  # documents read
        for i, (h, text) in enumerate(zip(data["hashes"].tolist(), data["texts"])):
            if cap is not None and kept["tokens"] >= cap:
                stop = i
                break
            if h in seen:  # the same text in an earlier source
                dup += 1
                continue
            seen.add(h)
            doc = data["tokens"][offsets[i]:offsets[i + 1]]
            if near.seen(doc):  # nearly the text of a document kept before: it would straddle the split
                neardup += 1
                continue
            split = documents.split_of(h, heldout, test)
            keyed[src.domain][split].append((h, doc, text, src.name))
            kept["documents"] += 1
            kept["tokens"] += len(doc)
        st = data["stats"]
        whole = stop == len(data["texts"])
        read = st["bytes"] if whole else sum(len(t.encode()) for t in data["texts"][:stop])
        table.append({"name": src.name, "domain": src.domain, "extractor": src.extractor,
                      "packages": [{"package": p.name, "version": p.version,
                                    "license": src.license if src.license and p.license.startswith("unknown")
                                    else p.license} for p in pkgs],
                      "cap_tokens": cap, "files": st["files"], "bytes": read, "documents": kept["documents"],
                      "tokens": kept["tokens"], "duplicates_dropped": st.get("duplicates", 0) + dup,
                      "near_duplicates_dropped": neardup,
                      "complete": bool(st["exhausted"]) and whole})
        _log(f"  {src.name}: {kept['documents']} documents, {kept['tokens'] / 1e6:.2f}M tokens")
        if cap is not None and kept["tokens"] < cap and not st["exhausted"]:  # copies ate the margin read past the cap
            _log(f"  note: {src.name} kept {kept['tokens']:,} tokens of its cap {cap:,}: copies took more than "
                 f"CAP_HEADROOM ({CAP_HEADROOM}) left room for; raise it in linearize/corpus/build.py")
    domain_docs = {d: {} for d in keyed}
    for d, splits in keyed.items():  # hash order: a prefix of a domain is a uniform sample of it
        for split, rows in splits.items():
            rows.sort(key=lambda r: r[0])
            domain_docs[d][split] = {"tokens": [r[1] for r in rows], "text": [r[2] for r in rows],
                                     "source": [r[3] for r in rows]}
    manifest = {"format": "linearize-corpus/1", "command": command, "tokenizer": tok_info,
                "token_dtype": np.dtype(dtype).name, "heldout_fraction": heldout,
                "test_fraction": test,
                "document_chars": [documents.MIN_CHARS, documents.MAX_CHARS], "sources": table}
    return write_corpus(out, force, manifest, domain_docs, dtype, shard_tokens)


def subset(src_dir: Path, out: Path, train_tokens: int, weights: dict | None = None, force: bool = False,
           shard_tokens: int = SHARD_TOKENS, command: str = "") -> dict:
    """A smaller corpus from a built one: a mixture of about ``train_tokens`` training tokens
    (``weights`` per domain, default equal) and all of the heldout and test documents, with their text when
    the corpus has it."""
    from .reader import open_corpus

    out = Path(out)
    check_output(out, force)
    corpus = open_corpus(src_dir)
    weights = weights or {d: 1.0 for d in corpus.domains}
    budgets = corpus.budgets(weights, train_tokens, "train")
    dtype = np.dtype(corpus.manifest["token_dtype"])
    domain_docs = {}
    for d in corpus.domains:
        domain_docs[d] = {}
        for split in corpus.splits:  # a prefix of train up to its budget; all of heldout and test
            tokens, offsets = corpus.arrays(d, split)
            k = len(offsets) - 1 if split != "train" else \
                min(int(np.searchsorted(offsets, budgets.get(d, 0), side="left")), len(offsets) - 1)
            table = corpus.text_table(d, split) if corpus.has_text else None
            domain_docs[d][split] = {
                "tokens": [tokens[offsets[i]:offsets[i + 1]] for i in range(k)],
                "text": None if table is None else table.column("text").slice(0, k).to_pylist(),
                "source": None if table is None else table.column("source").slice(0, k).to_pylist()}
    manifest = dict(corpus.manifest, command=command, subset_of=str(Path(src_dir).resolve()),
                    subset_weights=weights)
    return write_corpus(out, force, manifest, domain_docs, dtype, shard_tokens)
