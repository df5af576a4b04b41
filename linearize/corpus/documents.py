"""Documents: read, tidied, cut to a sensible length, hashed for deduplication and the held-out split."""

from __future__ import annotations

import gzip
import hashlib
import re
from pathlib import Path

MAX_CHARS = 16_000  # about 4k tokens: longer texts (a whole dictionary, a book) are cut at paragraphs
MIN_CHARS = 200  # shorter pieces (a .so redirect, an empty page) carry too little to learn from


def read_text(path: Path) -> str:
    """The file as text; ``.gz``/``.dz`` (dictzip is gzip) decompressed; bad bytes replaced."""
    data = Path(path).read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def tidy(text: str) -> str:
    """Trailing spaces off, at most one blank line in a row, no leading/trailing blank lines."""
    lines = [line.rstrip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def split_document(text: str, max_chars: int = MAX_CHARS) -> list[str]:
    """``text`` in pieces of at most ``max_chars``, cut at blank lines where possible, else at line
    ends, else anywhere. Pieces join back (with the separators) into ``text``."""
    if len(text) <= max_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > max_chars:
        window = text[start:start + max_chars]
        cut = window.rfind("\n\n")
        if cut < max_chars // 4:
            cut = window.rfind("\n")
        if cut < max_chars // 4:
            cut = max_chars
        else:
            cut += 1  # the newline stays with the piece before
        pieces.append(text[start:start + cut])
        start += cut
    pieces.append(text[start:])
    return pieces


def pieces(texts, max_chars: int = MAX_CHARS, min_chars: int = MIN_CHARS):
    """Every text cut by :func:`split_document`, stripped, short pieces dropped."""
    for text in texts:
        for piece in split_document(text, max_chars):
            piece = piece.strip("\n")
            if len(piece.strip()) >= min_chars:
                yield piece


def doc_hash(text: str) -> int:
    """64-bit hash of a document with its whitespace normalized: equal hashes are duplicates."""
    return int.from_bytes(hashlib.blake2b(" ".join(text.split()).encode(), digest_size=8).digest(), "little")


def split_of(h: int, heldout: float, test: float = 0.0) -> str:
    """A document's split by its hash: deterministic, independent of order and of the other documents.
    ``heldout`` (for measuring while developing: the in-training evaluation, choosing a recipe) takes the
    first ``heldout`` of the hash range, ``test`` (for the figures reported once the choices are made) the
    next ``test``, and ``train`` the rest: a corpus built with a test split holds out the same documents as
    one without, and trains on all others but the test ones."""
    bucket = (h >> 11) % 100_000
    if bucket < round(heldout * 100_000):
        return "heldout"
    return "test" if bucket < round((heldout + test) * 100_000) else "train"
