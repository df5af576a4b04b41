"""SWORD modules (zText/zCom and their ``4`` variants): blocks of OSIS XML, zlib-compressed, with
an index of blocks and an index of verses. Read as bytes, decompressed, tags stripped; nothing runs."""

from __future__ import annotations

import html
import re
import struct
import zlib
from pathlib import Path

from .documents import tidy

_TAG = re.compile(r"<[^>]*>")
_NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.S)


def osis_text(markup: str) -> str:
    """OSIS XML to text: notes dropped, titles on lines of their own, other tags removed."""
    markup = _NOTE.sub("", markup)
    markup = re.sub(r"<(title|lb|p|div|chapter)\b", r"\n<\1", markup)
    markup = re.sub(r"</title>", "</title>\n", markup)
    text = html.unescape(_TAG.sub("", markup))
    return tidy("\n".join(re.sub(r"[ \t]+", " ", line).strip() for line in text.split("\n")))


def sword_blocks(index: Path) -> dict[int, bytes]:
    """The decompressed blocks of a zText/zCom module part by block number: ``index`` is its
    ``*.bzs``/``*.czs`` file of little-endian ``<III`` (offset, size, uncompressed size) entries
    into the ``*z`` data file beside it."""
    data = index.with_suffix(index.suffix[:-1] + "z").read_bytes()
    raw = index.read_bytes()
    blocks = {}
    for i in range(len(raw) // 12):
        offset, size, usize = struct.unpack_from("<III", raw, 12 * i)
        if size == 0:
            continue
        block = zlib.decompress(data[offset:offset + size])
        if len(block) != usize:
            raise ValueError(f"{index}: block {i} is {len(block)} bytes, its index says {usize}")
        blocks[i] = block
    return blocks


def _verse_entries(raw: bytes, blocks: dict[int, bytes]) -> list[tuple[int, int, int]]:
    """The ``(block, offset, size)`` entries of a verse index. zText/zCom modules store ``<IIH>``
    (10 bytes), zText4/zCom4 ``<III>`` (12 bytes); the layout is the one whose every entry lies
    inside an existing block (a misread layout fails that at once)."""
    for fmt, width in (("<III", 12), ("<IIH", 10)):
        if len(raw) % width:
            continue
        entries = [struct.unpack_from(fmt, raw, width * j) for j in range(len(raw) // width)]
        if all(size == 0 or (b in blocks and offset + size <= len(blocks[b])) for b, offset, size in entries):
            return entries
    raise ValueError("the verse index matches neither the <IIH> nor the <III> layout")


def sword_documents(index: Path) -> list[str]:
    """One OSIS string per block (a book or a chapter). The verse index beside it (``*.bzv``)
    places each verse in a block; verses are cut apart on it and joined by newlines, so the last
    word of one never runs into the first of the next."""
    blocks = sword_blocks(index)
    verses = index.with_suffix(index.suffix[:-1] + "v")
    if not verses.is_file():
        return [b.decode("utf-8", errors="replace") for b in blocks.values()]
    grouped: dict[int, list[bytes]] = {}
    seen = set()
    for entry in _verse_entries(verses.read_bytes(), blocks):
        b, offset, size = entry
        if size and entry not in seen:  # commentaries link a range of verses to one shared entry
            seen.add(entry)
            grouped.setdefault(b, []).append(blocks[b][offset:offset + size])
    return [b"\n".join(parts).decode("utf-8", errors="replace") for _, parts in sorted(grouped.items())]


def extract_osis(path: Path):
    """``path`` is a module part's block index (``ot.bzs``); one document per block."""
    for markup in sword_documents(path):
        yield osis_text(markup)
