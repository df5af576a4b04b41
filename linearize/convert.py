"""Walk a model, swap softmax attention blocks for Taylor-initialized GDN blocks; save and load.

    model = linearize.convert(teacher, to="gdn", tokenizer=tok, keep_softmax=2)
    linearize.save(model, tok, "smollm2-gdn")
    model = linearize.load("smollm2-gdn")      # or AutoModelForCausalLM.from_pretrained(...)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from .layers.gdn_attention import GDNAttention, GDNOptions
from .models.adapters import decoder_layers
from .models.families import family_of, linearized_classes

TARGETS = ("gdn",)


def parse_layers(spec: str | Sequence[int] | None, num_layers: int, what: str = "--layers") -> list[int] | None:
    """``"0-3,7,10-"`` / ``[0, 1, 7]`` → sorted indices, each checked against ``num_layers``."""
    if spec is None:
        return None
    if isinstance(spec, str):
        out: set[int] = set()
        for part in filter(None, (p.strip() for p in spec.split(","))):
            try:
                if "-" in part[1:]:
                    a, b = part.split("-", 1)
                    out.update(range(int(a), (int(b) if b else num_layers - 1) + 1))
                else:
                    out.add(int(part))
            except ValueError:
                raise ValueError(f"{what}: cannot read {part!r}; use indices and ranges like 0-3,7,10-") from None
        idx = sorted(out)
    else:
        idx = sorted(set(int(i) for i in spec))
    bad = [i for i in idx if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{what}: layer {bad[0]} is out of range; the model has layers 0-{num_layers - 1}")
    return idx


def swap_attention(model, gdn_layers: Sequence[int], options: GDNOptions | dict | None = None) -> None:
    """Replace ``self_attn`` of the listed decoder layers by :class:`GDNAttention` (no calibration)."""
    opts = options if isinstance(options, GDNOptions) else GDNOptions(**(options or {}))
    layers = decoder_layers(model)
    for i in gdn_layers:
        if not isinstance(layers[i].self_attn, GDNAttention):
            layers[i].self_attn = GDNAttention(layers[i].self_attn, opts)


def linearize_layer(
    attention: torch.nn.Module,
    options: GDNOptions | None = None,
    hidden_states: torch.Tensor | None = None,
    position_embeddings=None,
) -> GDNAttention:
    """Convert one softmax attention module into a GDN module that reuses its weights.

    With calibration activations (the module's input ``hidden_states`` and its
    ``position_embeddings``), ρ is set from the queries they produce; otherwise ρ = 1.
    """
    family_of(attention.config)
    if isinstance(attention, GDNAttention):
        raise ValueError("this attention module is already a GDN block; pass a softmax attention module")
    gdn = GDNAttention(attention, options)
    if hidden_states is not None:
        gdn.calibrate(hidden_states, position_embeddings)
    return gdn


def _non_attention_params(model) -> dict[str, tuple[int, torch.Size]]:
    return {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters() if ".self_attn." not in n}


@torch.no_grad()
def convert(
    model,
    to: str = "gdn",
    layers: str | Sequence[int] | None = None,
    keep_softmax: int | str | Sequence[int] | None = None,
    tokenizer=None,
    calibration_ids: torch.Tensor | None = None,
    calibration_tokens: int = 512,
    options: GDNOptions | None = None,
) -> torch.nn.Module:
    """Convert ``model`` in place to GDN attention and return it.

    Args:
        to: the target block; only ``"gdn"``.
        layers: which layers may be converted (indices/ranges; default all).
        keep_softmax: layers to keep as softmax: a list of indices, or a count N — keep the N
            layers whose stable-form error on calibration text is worst.
        tokenizer / calibration_ids: calibration text (default: ``calibration_tokens`` tokens of
            the built-in train split) used to set ρ per head and to rank layers for ``keep_softmax``.
        options: :class:`GDNOptions` (form, β bound, operator backend).
    """
    from .eval import capture_attention, relative_error, text_ids

    if to not in TARGETS:
        raise ValueError(f"--to {to!r} is not supported; supported targets: {', '.join(TARGETS)}")
    family = family_of(model.config)
    n = len(decoder_layers(model))
    candidates = parse_layers(layers, n) if layers is not None else list(range(n))
    if isinstance(keep_softmax, str) and keep_softmax.strip().isdigit():
        keep_softmax = int(keep_softmax)  # a count; indices come as "3,7" or "5,"
    if isinstance(keep_softmax, int):
        if not 0 <= keep_softmax <= len(candidates):
            raise ValueError(f"--keep-softmax {keep_softmax}: must be between 0 and {len(candidates)} (the layers to convert)")
    elif keep_softmax is not None:
        keep_softmax = parse_layers(keep_softmax, n, "--keep-softmax")
    if calibration_ids is None:
        if tokenizer is None:
            raise ValueError("convert needs calibration text: pass tokenizer= (built-in text) or calibration_ids=")
        calibration_ids = text_ids(tokenizer, calibration_tokens, split="train")
    calibration_ids = calibration_ids.to(next(model.parameters()).device)

    before = _non_attention_params(model)
    caps = capture_attention(model, calibration_ids, candidates)
    gdn = {i: linearize_layer(decoder_layers(model)[i].self_attn, options, caps[i].hidden_states, caps[i].position_embeddings)
           for i in candidates}
    if isinstance(keep_softmax, int) and keep_softmax > 0:
        err = {i: relative_error(gdn[i].attention_output(caps[i].hidden_states, caps[i].position_embeddings), caps[i].output)
               for i in candidates}
        kept = sorted(sorted(candidates, key=lambda i: -err[i])[:keep_softmax])
    else:
        kept = list(keep_softmax or [])
    converted = [i for i in candidates if i not in kept]
    for i in converted:
        decoder_layers(model)[i].self_attn = gdn[i]

    # guard rails: nothing outside attention moved or changed shape
    after = _non_attention_params(model)
    assert after == before, "convert changed a non-attention parameter"

    cfg_cls, lm_cls = linearized_classes(family)
    opts = (options or GDNOptions()).to_dict()
    new_config = cfg_cls(**{k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "transformers_version")})
    new_config.linearize = {"gdn_layers": converted, "softmax_layers": [i for i in range(n) if i not in converted],
                            "options": opts, "teacher_model_type": family.model_type}
    new_config._attn_implementation = model.config._attn_implementation
    model.config = new_config
    for layer in decoder_layers(model):  # modules keep a reference to the config they were built with
        layer.self_attn.config = new_config
    # same modules and weights, new behaviour: a subclass that only adds the GDN swap in __init__
    model.__class__ = lm_cls
    return model


def save(model, tokenizer, out_dir: str | os.PathLike, force: bool = False, extra=None) -> Path:
    """``save_pretrained`` model (+ tokenizer) atomically: written to a temporary folder, then renamed.

    ``extra(folder)`` may write more files (reports) into the folder before the rename.
    """
    out = Path(out_dir)
    check_output_dir(out, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an existing output (unless ``force``) and an unwritable parent, before any work."""
    if out.exists() and not force:
        raise FileExistsError(f"output directory {out} exists; pass --force to replace it or choose another --output")
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(prefix=".linearize-write-check-", dir=parent)).rmdir()  # a real write, root included
    except OSError:
        raise PermissionError(f"cannot write into {parent}; choose another --output") from None


def load(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Load a converted model directory (``AutoModelForCausalLM.from_pretrained`` works too)."""
    from transformers import AutoModelForCausalLM

    from .models.families import register_all

    register_all()
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a converted model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(p, dtype=dtype).eval()
