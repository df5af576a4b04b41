"""The tokenizer a corpus is cut with, as a ``tokenizers.Tokenizer`` (fast, torch-free).

A name is a model alias (``smollm2-135m``: its GGUF's tokenizer, converted once through
transformers and cached as ``tokenizer.json``), a ``tokenizer.json`` file, or a model directory
holding one.
"""

from __future__ import annotations

from pathlib import Path


def tokenizer_file(name: str, cache: Path) -> Path:
    p = Path(name).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            return p / "tokenizer.json"
        raise ValueError(f"--tokenizer {name}: the folder has no tokenizer.json")
    from ..models.loading import ALIASES, resolve_model

    if name not in ALIASES:
        raise ValueError(f"--tokenizer {name!r}: give a model alias ({', '.join(ALIASES)}), a tokenizer.json "
                         "or a folder holding one")
    cached = cache / "tokenizers" / f"{name}.json"
    if not cached.is_file():
        from ..models.loading import load_tokenizer as model_tokenizer

        tok = model_tokenizer(resolve_model(name))  # the one the teacher will be loaded with
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(".tmp")
        tok.backend_tokenizer.save(str(tmp))
        tmp.rename(cached)
    return cached


def load_tokenizer(name: str, cache: Path):
    """``(tokenizer, info)``; info holds the name, vocab size and special token ids for the manifest."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file(name, cache)))
    special = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>")
               if tok.token_to_id(t) is not None}
    return tok, {"name": name, "vocab_size": tok.get_vocab_size(), "special_tokens": special,
                 "vocab_sha1": vocab_hash(tok.get_vocab())}


def vocab_hash(vocab: dict) -> str:
    """A fingerprint of a vocabulary (token -> id, added tokens included): two tokenizers of the same size
    can still map ids to different tokens."""
    import hashlib
    import json

    return hashlib.sha1(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]


def encode(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added (the consumer separates documents)."""
    fast = getattr(tok, "encode_batch_fast", tok.encode_batch)
    return [e.ids for e in fast(texts, add_special_tokens=False)]


def tokenizer_mismatch(built: dict, tokenizer, whose: str = "the model") -> str | None:
    """Why a corpus tokenized as ``built`` (its manifest's ``tokenizer``) does not fit ``whose`` ``tokenizer``
    (a transformers tokenizer), or None: the vocabulary size, then its fingerprint where the manifest has one."""
    name = built.get("name")
    if built.get("vocab_size") is not None and built["vocab_size"] != len(tokenizer):
        return f"the corpus was tokenized with {name!r} ({built['vocab_size']} tokens), {whose}'s tokenizer has {len(tokenizer)}"
    if built.get("vocab_sha1") is not None and vocab_hash(tokenizer.get_vocab()) != built["vocab_sha1"]:
        return f"the corpus was tokenized with {name!r}, whose vocabulary differs from {whose}'s (same size, other tokens)"
    return None


def document_start(tokenizer) -> int | None:
    """The id the tokenizer puts before every text of its own accord (Gemma's ``<bos>``, Llama 3's
    ``<|begin_of_text|>``), which its model expects first; None where it adds none (SmolLM2, Qwen)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer("a").input_ids
    return bos if len(ids) and ids[0] == bos else None
