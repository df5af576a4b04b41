"""Recipe schema (typed dataclasses) and loading: YAML + ``key=value`` overrides through omegaconf.

An unknown or mistyped key fails at load time with its dotted path and the closest valid name.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key and the fix."""


@dataclass
class TeacherConfig:
    model: str = "smollm2-135m"  # alias, .gguf file, model directory or hub id


@dataclass
class ConvertConfig:
    layers: str | None = None  # e.g. "0-11,14"; default all
    keep_softmax: str | None = None  # "3,7" (indices) or "2" (count of worst layers)
    form: str = "stable"
    beta_max: float = 1.0
    calibration_tokens: int = 512


@dataclass
class DataConfig:
    source: str = "builtin"  # "builtin", a hub dataset name, or local files (comma-separated paths / glob)
    name: str | None = None  # hub dataset config
    split: str = "train"
    text_field: str = "text"
    chat_template: bool = False  # render a "messages" field with the tokenizer's chat template
    seq_len: int = 256
    heldout_fraction: float = 0.05
    max_documents: int | None = None
    eval_tokens: int = 4096  # held-out tokens used by each evaluation


@dataclass
class StageConfig:
    name: str = "align"  # "align" (attention transfer) or "distill" (logit KL)
    steps: int = 50
    lr: float = 1e-3
    batch_size: int = 4
    trainable: str = "rho,gate_proj,beta_proj"  # comma-separated name substrings; "all" = every parameter
    loss: str = "nmse"  # align: "mse" or "nmse"; distill: ignored
    layer_weights: dict[int, float] = field(default_factory=dict)  # align: {layer index: weight}, others 1.0
    temperature: float = 1.0  # distill: KL temperature
    ce_weight: float = 0.0  # distill: weight of next-token cross-entropy added to the KL
    kl_chunk: int = 1024  # distill: tokens per chunk of the vocabulary-sized KL
    lora_rank: int = 0  # > 0: LoRA adapters (peft) on lora_targets; train them with trainable: lora_
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"


@dataclass
class OptimConfig:
    weight_decay: float = 0.0
    warmup_steps: int = 5
    grad_clip: float = 1.0


@dataclass
class OutputConfig:
    dir: str = "runs/smollm2-gdn"
    checkpoint_every: int = 10
    keep_last: int = 2
    eval_every: int = 25
    log_every: int = 1
    keep_adapter: bool = False  # LoRA: also save the adapter (the model is always saved merged)


@dataclass
class RecipeConfig:
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    data: DataConfig = field(default_factory=DataConfig)
    stages: list[StageConfig] = field(default_factory=lambda: [StageConfig()])
    optim: OptimConfig = field(default_factory=OptimConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    seed: int = 0
    precision: str = "fp32"  # "fp32" or "bf16"
    device: str = "auto"  # "auto", "cpu", "cuda"
    parallel: str = "ddp"  # under torchrun: "ddp" (whole model on every process) or "fsdp" (FSDP2 shards layers)


def _valid_keys(cls) -> list[str]:
    return [f.name for f in fields(cls)]


def _check_keys(raw: Any, cls, path: str = "") -> None:
    """Walk the raw YAML/overrides against the schema; fail on the first unknown key."""
    if not isinstance(raw, dict) or not is_dataclass(cls):
        return
    types = {f.name: f for f in fields(cls)}
    for key, value in raw.items():
        where = f"{path}{key}"
        if key not in types:
            close = difflib.get_close_matches(str(key), list(types), n=1)
            hint = f"; did you mean {path + close[0]!r}?" if close else f"; valid keys here: {', '.join(types)}"
            raise RecipeError(f"unknown recipe key {where!r}{hint}")
        sub = _field_dataclass(types[key])
        if sub is not None:
            if types[key].name == "stages":
                for i, item in enumerate(value or []):
                    _check_keys(item, sub, f"{where}.{i}.")
            else:
                _check_keys(value, sub, f"{where}.")


def _check_path(key: str, merged) -> None:
    """A dotted override key (``stages.0.lr``) must name an existing field."""
    node, cls, done = merged, RecipeConfig, []
    parts = key.split(".")
    for i, part in enumerate(parts):
        if isinstance(node, (list, tuple)) or type(node).__name__ == "ListConfig":
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"override {key!r}: {'.'.join(done)} has {len(node)} entries; index {part!r} is out of range")
            node = node[int(part)]
        else:
            _check_keys({part: None}, cls, "".join(p + "." for p in done))
            f = next(f for f in fields(cls) if f.name == part)
            node, cls = node[part], _field_dataclass(f)
        done.append(part)
        if cls is None and i < len(parts) - 1 and not (type(node).__name__ == "ListConfig"):
            raise RecipeError(f"override {key!r}: {'.'.join(done)} has no sub-keys")


def _field_dataclass(f):
    hints = {"teacher": TeacherConfig, "convert": ConvertConfig, "data": DataConfig, "stages": StageConfig,
             "optim": OptimConfig, "output": OutputConfig}
    return hints.get(f.name)


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> RecipeConfig:
    """YAML file (or the defaults) + ``key=value`` overrides → a validated :class:`RecipeConfig`."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    layers = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise RecipeError(f"recipe not found: {path}")
        try:
            layers.append(OmegaConf.load(p))
        except Exception as e:
            raise RecipeError(f"cannot read {path} as YAML: {str(e).splitlines()[0]}") from None
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        raise RecipeError(f"override {bad[0]!r} is not key=value (e.g. data.seq_len=512)")
    for layer in layers:
        _check_keys(OmegaConf.to_container(layer), RecipeConfig)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RecipeConfig), *layers)
        for item in overrides or []:
            key, value = item.split("=", 1)
            _check_path(key, merged)
            OmegaConf.update(merged, key, OmegaConf.from_dotlist([f"v={value}"]).v, merge=True)
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        msg = str(e).splitlines()[0]
        key = getattr(e, "full_key", None)
        raise RecipeError(f"recipe key {key!r}: {msg}" if key else f"recipe: {msg}") from None
    validate(cfg)
    return cfg


def validate(cfg: RecipeConfig) -> None:
    if not cfg.stages:
        raise RecipeError("recipe has no stages; add one with name: align or name: distill")
    for i, st in enumerate(cfg.stages):
        if st.name not in ("align", "distill"):
            raise RecipeError(f"stages.{i}.name must be 'align' or 'distill'; got {st.name!r}")
        if st.steps < 1 or st.batch_size < 1:
            raise RecipeError(f"stages.{i}: steps and batch_size must be at least 1")
        if st.loss not in ("mse", "nmse"):
            raise RecipeError(f"stages.{i}.loss must be 'mse' or 'nmse'; got {st.loss!r}")
        bad = {k: w for k, w in st.layer_weights.items() if not (w >= 0 and w < float("inf"))}
        if bad:
            raise RecipeError(f"stages.{i}.layer_weights must be finite and ≥ 0; got {bad}")
    if cfg.precision not in ("fp32", "bf16"):
        raise RecipeError(f"precision must be 'fp32' or 'bf16'; got {cfg.precision!r}")
    if cfg.parallel not in ("ddp", "fsdp"):
        raise RecipeError(f"parallel must be 'ddp' or 'fsdp'; got {cfg.parallel!r}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise RecipeError(f"device must be 'auto', 'cpu' or 'cuda'; got {cfg.device!r}")
    if cfg.data.seq_len < 2:
        raise RecipeError(f"data.seq_len must be at least 2; got {cfg.data.seq_len}")
    if cfg.output.checkpoint_every < 1 or cfg.output.keep_last < 1:
        raise RecipeError("output.checkpoint_every and output.keep_last must be at least 1")


def to_yaml(cfg: RecipeConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
