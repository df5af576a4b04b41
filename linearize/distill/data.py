"""Training text through ``datasets``: load, tokenize (cached), split, pack into rows of ``seq_len``.

Packed rows carry ``position_ids`` that restart at every document, which is how both the
teacher (transformers' packed-sequence masks, with ``use_cache=False``) and the GDN blocks
(state and prefix means restart) see document boundaries.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DataConfig, RecipeError

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass
class PackedData:
    train_ids: torch.Tensor  # (N, L)
    train_pos: torch.Tensor  # (N, L): positions restarting at each document
    heldout_ids: torch.Tensor
    heldout_pos: torch.Tensor
    documents: int

    @property
    def train_tokens(self) -> int:
        return self.train_ids.numel()


def load_documents(cfg: DataConfig, tokenizer=None):
    """A ``datasets.Dataset`` with one ``text`` column, one document per row."""
    import datasets

    if cfg.source == "builtin":
        from pydoc_data.topics import topics

        ds = datasets.Dataset.from_dict({"text": [topics[k] for k in sorted(topics)]})
        field = "text"
    else:
        paths = [p for part in cfg.source.split(",") for p in (sorted(glob.glob(part.strip())) or [part.strip()])]
        local = [p for p in paths if Path(p).suffix in BUILDERS or Path(p).exists()]
        if local:
            missing = [p for p in local if not Path(p).is_file()]
            if missing:
                raise RecipeError(f"data.source: file not found: {missing[0]}")
            kinds = {BUILDERS.get(Path(p).suffix) for p in local}
            if None in kinds or len(kinds) != 1:
                raise RecipeError(f"data.source: use files of one kind among {', '.join(BUILDERS)}; got {local}")
            ds = datasets.load_dataset(kinds.pop(), data_files=local, split="train")
        else:
            ds = datasets.load_dataset(cfg.source, cfg.name, split=cfg.split)
        field = cfg.text_field
    if cfg.chat_template:
        if "messages" not in ds.column_names:
            raise RecipeError("data.chat_template needs a 'messages' field in the dataset")
        ds = ds.map(lambda ex: {"text": tokenizer.apply_chat_template(ex["messages"], tokenize=False)})
        field = "text"
    if field not in ds.column_names:
        raise RecipeError(f"data.text_field {field!r} is not in the dataset; its fields: {', '.join(ds.column_names)}")
    ds = ds.filter(lambda ex: isinstance(ex[field], str) and ex[field].strip() != "")
    if cfg.max_documents:
        ds = ds.select(range(min(cfg.max_documents, len(ds))))
    if len(ds) == 0:
        raise RecipeError(f"the dataset {cfg.source!r} has no non-empty text in field {field!r}")
    return ds.rename_column(field, "text") if field != "text" else ds


def pack(token_lists: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents and cut rows of ``seq_len``; positions restart at each document and row."""
    ids, pos = [], []
    for toks in token_lists:
        ids.extend(toks)
        pos.extend(range(len(toks)))
    n = len(ids) // seq_len
    if n == 0:
        return torch.empty(0, seq_len, dtype=torch.long), torch.empty(0, seq_len, dtype=torch.long)
    ids_t = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    pos_t = torch.tensor(pos[: n * seq_len]).view(n, seq_len)
    return ids_t, restart_rows(pos_t)


def restart_rows(pos: torch.Tensor) -> torch.Tensor:
    """Positions counted from 0 at each row start and each document start (a position that is not
    the previous one + 1): a document cut by a row boundary goes on as a new document."""
    L = pos.shape[1]
    t = torch.arange(L).expand_as(pos)
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    last_start = torch.where(start, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - last_start


def build_data(cfg: DataConfig, tokenizer, max_positions: int | None = None) -> PackedData:
    """Load, tokenize, split documents into train / held-out, pack each."""
    if max_positions is not None and cfg.seq_len > max_positions:
        raise RecipeError(f"data.seq_len {cfg.seq_len} exceeds the teacher's {max_positions} positions; lower data.seq_len")
    ds = load_documents(cfg, tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    tok = ds.map(lambda batch: {"ids": [t + eos for t in tokenizer(batch["text"]).input_ids]},
                 batched=True, remove_columns=ds.column_names)
    docs = tok["ids"]
    n_held = max(1, int(len(docs) * cfg.heldout_fraction)) if len(docs) > 1 else 0
    train_docs, held_docs = docs[: len(docs) - n_held], docs[len(docs) - n_held:]
    train_ids, train_pos = pack(train_docs, cfg.seq_len)
    held_ids, held_pos = pack(held_docs or docs, cfg.seq_len)
    if train_ids.shape[0] == 0:
        raise RecipeError(f"the dataset has fewer than data.seq_len={cfg.seq_len} tokens; add text or lower seq_len")
    if held_ids.shape[0] == 0:
        held_ids, held_pos = train_ids[-1:], train_pos[-1:]
    return PackedData(train_ids, train_pos, held_ids, held_pos, len(docs))
