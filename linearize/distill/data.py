"""Training text through ``datasets``: load, tokenize (cached), split, pack into rows of ``seq_len``;
or a corpus built by ``linearize data build`` (``data.source: corpus:DIR``), already tokenized and split.

Packed rows carry ``position_ids`` that restart at every document, which is how both the
teacher (transformers' packed-sequence masks, with ``use_cache=False``) and the GDN blocks
(state and prefix means restart) see document boundaries.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import DataConfig, RecipeError

BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
CORPUS = "corpus:"


@dataclass
class PackedData:
    train_ids: torch.Tensor  # (N, L)
    train_pos: torch.Tensor  # (N, L): positions restarting at each document
    heldout_ids: torch.Tensor
    heldout_pos: torch.Tensor
    documents: int
    bos: int | None = None  # the id every row opens with (the tokenizer's own first id), if any


class DataWarning(UserWarning):
    """Rows of the data that are skipped (no text in the text field); shown as one line."""


def _first_line(e: BaseException) -> str:
    while e.__cause__ is not None or e.__context__ is not None:  # datasets wraps the reader's own error
        e = e.__cause__ or e.__context__
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_file(path: str, kind: str) -> None:
    """Empty, binary or foreign files stop here, with the file named (not deep in a reader)."""
    p = Path(path)
    if p.stat().st_size == 0:
        raise RecipeError(f"data.source: {path} is empty; give files with text or remove it from data.source")
    with open(p, "rb") as f:
        head = f.read(1 << 16)
    if kind == "parquet":
        with open(p, "rb") as f:
            f.seek(max(p.stat().st_size - 4, 0))
            tail = f.read(4)
        if not (head.startswith(b"PAR1") and tail == b"PAR1"):
            raise RecipeError(f"data.source: {path} is not a parquet file (truncated or renamed?)")
        return
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        binary = b"\x00" in head
    except UnicodeDecodeError:
        binary = True
    if binary:
        raise RecipeError(f"data.source: {path} is binary, not UTF-8 text; give .txt/.json/.jsonl text or .parquet")


@contextlib.contextmanager
def _quiet(datasets):
    """No progress bars or reader log lines while reading local files: their errors come as one line."""
    level, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def local_files(cfg: DataConfig) -> list[str] | None:
    """The local files ``data.source`` names (checked), or None for the built-in text or a hub dataset."""
    if cfg.source == "builtin":
        return None
    paths = [p for part in cfg.source.split(",") for p in (sorted(glob.glob(part.strip())) or [part.strip()])]
    local = [p for p in paths if Path(p).suffix in BUILDERS or Path(p).exists()]
    if not local:
        return None
    missing = [p for p in local if not Path(p).is_file()]
    if missing:
        raise RecipeError(f"data.source: file not found: {missing[0]}")
    kinds = {BUILDERS.get(Path(p).suffix) for p in local}
    if None in kinds or len(kinds) != 1:
        raise RecipeError(f"data.source: use files of one kind among {', '.join(BUILDERS)}; got {local}")
    for p in local:
        _check_file(p, BUILDERS[Path(p).suffix])
    return local


def read_documents(cfg: DataConfig):
    """A ``datasets.Dataset`` of the raw rows, its text field checked; no tokenizer needed, so it
    runs before the teacher loads. Rows without text are counted and reported (a :class:`DataWarning`)."""
    if cfg.source.startswith(CORPUS):
        open_built_corpus(cfg)
        return None
    import datasets

    if cfg.source == "builtin":
        from pydoc_data.topics import topics

        return datasets.Dataset.from_dict({"text": [topics[k] for k in sorted(topics)]})
    local = local_files(cfg)
    if local:
        kind = BUILDERS[Path(local[0]).suffix]
        with _quiet(datasets):
            try:
                ds = datasets.load_dataset(kind, data_files=local, split="train")
            except Exception as e:  # a reader's error on a garbage file: name the files, not the reader's internals
                raise RecipeError(f"data.source: cannot read {', '.join(local)} as {kind} ({_first_line(e)}); fix or remove the file") from None
    else:
        ds = datasets.load_dataset(cfg.source, cfg.name, split=cfg.split)
    field = "messages" if cfg.chat_template else cfg.text_field
    if field not in ds.column_names:
        if cfg.chat_template:
            raise RecipeError("data.chat_template needs a 'messages' field in the dataset; "
                              f"its fields: {', '.join(ds.column_names)}")
        raise RecipeError(f"data.text_field {field!r} is not in the dataset; its fields: {', '.join(ds.column_names)}; "
                          "set data.text_field")
    values = ds[field]
    missing = sum(v is None for v in values)
    if cfg.chat_template:
        empty = sum(v is not None and not v for v in values)
    else:
        empty = sum(v is not None and not (isinstance(v, str) and v.strip()) for v in values)
    if missing == len(values):
        raise RecipeError(f"data.source: none of its {len(values)} rows has the field {field!r}; "
                          "set data.text_field to the field that holds the text")
    if missing or empty:
        warnings.warn(DataWarning(
            f"data: {missing} of {len(values)} rows have no {field!r} field and {empty} have no text in it; "
            "they are skipped (data.text_field names the field)"), stacklevel=2)
    return ds


def load_documents(cfg: DataConfig, tokenizer=None):
    """A ``datasets.Dataset`` with one ``text`` column, one non-empty document per row."""
    ds = read_documents(cfg)
    field = "text" if cfg.source == "builtin" else cfg.text_field
    if cfg.chat_template:
        ds = ds.filter(lambda ex: bool(ex["messages"]))
        ds = ds.map(lambda ex: {"text": tokenizer.apply_chat_template(ex["messages"], tokenize=False)})
        field = "text"
    ds = ds.filter(lambda ex: isinstance(ex[field], str) and ex[field].strip() != "")
    if cfg.max_documents:
        ds = ds.select(range(min(cfg.max_documents, len(ds))))
    if len(ds) == 0:
        raise RecipeError(f"the dataset {cfg.source!r} has no non-empty text in field {field!r}")
    ds = ds.select_columns([field])
    return ds.rename_column(field, "text") if field != "text" else ds


def restart_rows(pos: torch.Tensor) -> torch.Tensor:
    """Positions counted from 0 at each row start and each document start (a position that is not
    the previous one + 1): a document cut by a row boundary goes on as a new document."""
    L = pos.shape[1]
    t = torch.arange(L).expand_as(pos)
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    last_start = torch.where(start, t, torch.zeros_like(t)).cummax(dim=1).values
    return t - last_start


def open_built_corpus(cfg: DataConfig):
    """The corpus ``data.source: corpus:DIR`` names, its domain weights checked."""
    from ..corpus import open_corpus

    try:
        corpus = open_corpus(cfg.source[len(CORPUS):])
        corpus.budgets(cfg.weights or None, cfg.max_tokens)
    except ValueError as e:
        raise RecipeError(f"data.source: {e}") from None
    return corpus


def pack_arrays(docs: list, seq_len: int, eos: int | None, bos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents (1-D integer arrays or lists) and cut rows of ``seq_len``; positions restart at
    each document and row; ``bos`` (if given) opens each document and each row, ``eos`` ends each document
    (:func:`linearize.corpus.rows.cut_rows`)."""
    from ..corpus.rows import cut_rows

    ids, pos = cut_rows(docs, seq_len, eos, bos)
    return torch.from_numpy(ids), torch.from_numpy(pos)


def corpus_data(cfg: DataConfig, tokenizer) -> PackedData:
    """Rows of a built corpus: its train split mixed by ``data.weights`` (up to ``data.max_tokens``), and
    held-out rows from its held-out split at the same weights (the teacher's end-of-text between documents,
    and its beginning-of-text before each where its tokenizer adds one to every text, as the hub path's does)."""
    corpus = open_built_corpus(cfg)
    built = corpus.manifest["tokenizer"]
    from ..corpus.tokenizer import document_start, tokenizer_mismatch

    why = tokenizer_mismatch(built, tokenizer, whose="the teacher")
    if why:
        raise RecipeError(f"data.source: {why}; build a corpus with the teacher's tokenizer")
    weights = cfg.weights or None
    # documents end with the corpus's own end-of-text where it has one (an instruct tokenizer's eos is the
    # end of a chat turn, not of a document)
    eos = built.get("special_tokens", {}).get("<|endoftext|>", tokenizer.eos_token_id)
    bos = document_start(tokenizer)  # Gemma without its <bos> is ~2.5x the perplexity on this corpus
    train = [doc for _, doc in corpus.mixture("train", weights, cfg.max_tokens, seed=0)]
    held = [doc for _, doc in corpus.mixture("heldout", weights, max(2 * cfg.eval_tokens, 4 * cfg.seq_len), seed=0)]
    train_ids, train_pos = pack_arrays(train, cfg.seq_len, eos, bos)
    held_ids, held_pos = pack_arrays(held, cfg.seq_len, eos, bos)
    if train_ids.shape[0] == 0 or held_ids.shape[0] == 0:
        raise RecipeError(f"data.source: the corpus has fewer than data.seq_len={cfg.seq_len} tokens in a split; lower seq_len")
    return PackedData(train_ids, train_pos, held_ids, held_pos, len(train) + len(held), bos)


def build_data(cfg: DataConfig, tokenizer, max_positions: int | None = None) -> PackedData:
    """Load, tokenize, split documents into train / held-out, pack each. With ``data.packing: stream`` the
    training rows' positions run from 0 to the row's end across documents (held-out rows keep theirs)."""
    if max_positions is not None and cfg.seq_len > max_positions:
        raise RecipeError(f"data.seq_len {cfg.seq_len} exceeds the teacher's {max_positions} positions; lower data.seq_len")
    data = corpus_data(cfg, tokenizer) if cfg.source.startswith(CORPUS) else hub_data(cfg, tokenizer)
    if cfg.packing == "stream":
        data.train_pos = torch.arange(cfg.seq_len).expand_as(data.train_pos).contiguous()
    return data


def hub_data(cfg: DataConfig, tokenizer) -> PackedData:
    """Rows of documents from the hub, local files or the built-in text (``data.source``)."""
    ds = load_documents(cfg, tokenizer)
    tok = ds.map(lambda batch: {"ids": tokenizer(batch["text"]).input_ids}, batched=True, remove_columns=ds.column_names)
    from ..corpus.tokenizer import document_start

    bos = document_start(tokenizer)  # rows open with it again where a row boundary cuts a document
    docs = [d[1:] if bos is not None and d[:1] == [bos] else d for d in tok["ids"]]
    n_held = max(1, int(len(docs) * cfg.heldout_fraction)) if len(docs) > 1 else 0
    if cfg.source == "builtin":  # at least the topics `linearize eval` and `convert` measure on: none is trained on
        from ..eval import BUILTIN_TRAIN_SHARE

        n_held = max(n_held, len(docs) - int(len(docs) * BUILTIN_TRAIN_SHARE))
    train_docs, held_docs = docs[: len(docs) - n_held], docs[len(docs) - n_held:]
    eos = tokenizer.eos_token_id  # ends each document
    train_ids, train_pos = pack_arrays(train_docs, cfg.seq_len, eos, bos)
    held_ids, held_pos = pack_arrays(held_docs or docs, cfg.seq_len, eos, bos)
    if train_ids.shape[0] == 0:
        raise RecipeError(f"the dataset has fewer than data.seq_len={cfg.seq_len} tokens; add text or lower seq_len")
    trained_on = not held_docs or held_ids.shape[0] == 0  # one document, or held-out ones too short for a row
    if held_ids.shape[0] == 0:
        held_ids, held_pos = train_ids[-1:], train_pos[-1:]
    if trained_on:
        warnings.warn(DataWarning(
            f"data: no held-out row of {cfg.seq_len} tokens ({len(docs)} document(s) in all: one is trained on, or the "
            "held-out ones are too short), so the held-out evaluation reads training text: it measures fit, not "
            "generalization; add documents or lower data.seq_len"), stacklevel=2)
    return PackedData(train_ids, train_pos, held_ids, held_pos, len(docs), bos)
