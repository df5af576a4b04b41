"""Token shards: safetensors files of a flat ``tokens`` array and ``offsets`` (int64, one more
entry than documents: document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``). Loading them runs
no code. ``tokens`` is uint16 while the vocabulary fits (SmolLM2: 49152), else int32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 1 << 16 else np.int32


def write_shard(path: Path, tokens: np.ndarray, offsets: np.ndarray, meta: dict | None = None, **extra) -> None:
    """Write one shard; ``extra`` arrays (e.g. document ``hashes``) are stored beside the two."""
    if offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{path}: offsets must rise from 0 to len(tokens)={len(tokens)}")
    tensors = {"tokens": np.ascontiguousarray(tokens), "offsets": np.ascontiguousarray(offsets, dtype=np.int64)}
    tensors.update({k: np.ascontiguousarray(v) for k, v in extra.items()})
    save_file(tensors, str(path), metadata={"meta": json.dumps(meta or {})})


def read_shard(path: Path) -> tuple[np.ndarray, np.ndarray, dict, dict]:
    """``(tokens, offsets, meta, extra arrays)`` of one shard."""
    with safe_open(str(path), framework="numpy") as f:
        arrays = {k: f.get_tensor(k) for k in f.keys()}
        meta = json.loads((f.metadata() or {}).get("meta", "{}"))
    return arrays.pop("tokens"), arrays.pop("offsets"), meta, arrays


def concat(parts: list[np.ndarray], dtype) -> tuple[np.ndarray, np.ndarray]:
    """Documents (1-D arrays) as one ``(tokens, offsets)`` pair."""
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
    return tokens, offsets


def write_split(folder: Path, split: str, parts: list[np.ndarray], dtype, shard_tokens: int) -> list[dict]:
    """Documents into ``folder/<split>-00000.safetensors``, ... of at most about ``shard_tokens``
    each (a document never straddles two); returns each shard's file name, documents, tokens."""
    shards, start, index = [], 0, 0
    while start < len(parts) or index == 0:
        size, end = 0, start
        while end < len(parts) and (size == 0 or size + len(parts[end]) <= shard_tokens):
            size += len(parts[end])
            end += 1
        tokens, offsets = concat(parts[start:end], dtype)
        name = f"{split}-{index:05d}.safetensors"
        write_shard(folder / name, tokens, offsets)
        shards.append({"file": f"{folder.name}/{name}", "documents": end - start, "tokens": int(len(tokens))})
        start, index = end, index + 1
    return shards
