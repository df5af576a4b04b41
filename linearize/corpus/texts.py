"""Document text beside the token shards: parquet files of one row per document, columns ``text``
(the document as extracted, before tokenization) and ``source`` (its source's name). Row ``i`` of
``DOMAIN/SPLIT-0000N.parquet`` is document ``i`` of ``DOMAIN/SPLIT-0000N.safetensors``. Written with
pyarrow (zstd); ``datasets`` reads them (``load_dataset("parquet", data_files=...)``, or the corpus
folder itself through the ``README.md`` card written beside them). Loading them runs no code.
"""

from __future__ import annotations

import os
from pathlib import Path

COMPRESSION = "zstd"
CARD = "README.md"


def write_texts(path: Path, texts: list[str], sources: list[str]) -> int:
    """One parquet file of ``texts`` and ``sources`` (one row each), written to a temporary name and
    renamed into place; returns the UTF-8 bytes of the text."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    if len(texts) != len(sources):
        raise ValueError(f"{path}: {len(texts)} texts but {len(sources)} sources; give one source per text")
    table = pa.table({"text": pa.array(texts, pa.string()), "source": pa.array(sources, pa.string())})
    tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}")
    pq.write_table(table, tmp, compression=COMPRESSION)
    tmp.rename(path)
    return int(pc.sum(pc.binary_length(table.column("text"))).as_py() or 0)


def read_texts(path: Path, documents: int | None = None):
    """The ``text`` and ``source`` columns of one file as a pyarrow table; ``documents``, when given,
    is the row count it must have (that of the token shard it belongs to)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["text", "source"])
    except (OSError, KeyError) as e:  # pyarrow's errors subclass these; a missing column is a KeyError
        raise ValueError(f"{path}: not a text shard ({str(e).strip().splitlines()[0]}); rebuild the corpus "
                         "with 'linearize data build'") from None
    if documents is not None and table.num_rows != documents:
        raise ValueError(f"{path}: {table.num_rows} rows but its token shard holds {documents} documents; "
                         "rebuild the corpus with 'linearize data build'")
    return table


def write_split(folder: Path, texts: list[str], sources: list[str], token_shards: list[dict]) -> list[dict]:
    """``texts`` cut as the token shards were (each shard's ``documents`` in turn), each part written
    beside its shard under the same stem; returns each text shard's file name, documents, UTF-8 bytes."""
    if sum(s["documents"] for s in token_shards) != len(texts):
        raise ValueError(f"{folder}: {len(texts)} texts for {sum(s['documents'] for s in token_shards)} documents")
    out, start = [], 0
    for shard in token_shards:
        end = start + shard["documents"]
        name = Path(shard["file"]).with_suffix(".parquet").name
        size = write_texts(folder / name, texts[start:end], sources[start:end])
        out.append({"file": f"{folder.name}/{name}", "documents": end - start, "bytes": size})
        start = end
    return out


def write_card(folder: Path, domains: dict) -> None:
    """A dataset card whose YAML header names one ``datasets`` config per domain with its splits, so
    ``datasets.load_dataset(str(folder), DOMAIN)`` gives ``train``, ``heldout`` and ``test`` (split names
    ``datasets`` would not infer from the file names)."""
    lines = ["---", "configs:"]
    for domain, splits in domains.items():
        lines += [f"- config_name: {domain}", "  data_files:"]
        for split, entry in splits.items():  # an empty split (a small corpus's test) is no split to datasets
            if entry["documents"]:
                lines += [f"  - split: {split}", f"    path: {domain}/{split}-*.parquet"]
    lines += ["---", "", "A corpus written by `linearize data build`: per domain, token shards (`*.safetensors`) and "
              "the same documents' text (`*.parquet`, row i = document i of the shard with the same stem); "
              "`manifest.json` lists the sources. Read the text with "
              "`datasets.load_dataset(\"path/to/this/folder\", \"DOMAIN\")`.", ""]
    (folder / CARD).write_text("\n".join(lines))
