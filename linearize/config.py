"""Recipe schema (typed dataclasses) and loading: YAML + ``key=value`` overrides through omegaconf.

An unknown or mistyped key fails at load time with its dotted path and the closest valid name.
"""

from __future__ import annotations

import difflib
import math
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
    # the target block: gdn, deltanet (the delta rule without a decay), linear (VaLA; no window) or kda (gdn with a
    # decay per key channel, the gdn block at init)
    to: str = "gdn"
    layers: str | None = None  # e.g. "0-11,14"; default all
    keep_softmax: str | None = None  # "3,7" (indices), "2" (count of worst layers) or "2:induction" (linearize.retrieval)
    form: str = "stable"
    beta_max: float = 1.0
    short_conv: int = 0  # kernel size of a learnable causal conv on q, k, v (identity at init); 0 = off
    window: int = 0  # exact softmax over each query's last `window` tokens and `sinks` first ones; 0 = off
    sinks: int = 0
    output_gate: bool = False  # a gate and mixed RMSNorm before o_proj (identity at init)
    decay_rank: int = 16  # kda: rank of the per-channel decay correction
    write_gate: bool = False  # a learnable strength on each token's write into the state (1 at init)
    calibrate_mix: bool = False  # with a window: fit the mix's per-head bias on the calibration text
    mix_order: int = 1  # with a window: the older tokens' normalizer to first (1) or second (2) order
    sparse_cache: int = 0  # with a window: an exact cache of this many older tokens per KV head (probe-chosen)
    calibration_tokens: int = 512
    calibration_steps: int = 0  # Adam steps per layer fitting the block's own parameters at convert (linearize.calibration)
    # the Taylor front as Triton kernels (GDNOptions.fused_front): null = on CUDA (the window block's old stream:
    # where no gradient is wanted), false = the PyTorch front. Changes no result beyond float rounding, only the speed.
    fused_front: bool | None = None


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
    weights: dict[str, float] = field(default_factory=dict)  # corpus:DIR sources: {domain: weight}; default by size
    max_tokens: int | None = None  # corpus:DIR sources: training tokens to take (default: all at those weights)
    # training rows: "documents" restarts positions at each document (attention stays inside it); "stream"
    # runs them through the row, as pretraining does (attention crosses documents: context as long as the row)
    packing: str = "documents"


@dataclass
class StageConfig:
    name: str = "align"  # "align" (attention transfer) or "distill" (logit KL)
    steps: int = 50
    lr: float = 1e-3
    batch_size: int = 4  # rows of seq_len tokens a step
    # tokens per row in this stage; 0: data.seq_len. A shorter length must divide data.seq_len: the stage
    # cuts the data's rows into pieces of it (positions restart at each piece)
    seq_len: int = 0
    # comma-separated name substrings; "all" = every parameter; "new" = the parameters conversion added
    # to the converted blocks; "softmax_attn" = a hybrid's kept softmax attention; "-X" removes what X
    # matches (distill/optim.py)
    trainable: str = "new"
    loss: str = "nmse"  # align: "mse" or "nmse"; distill: ignored
    layer_weights: dict[int, float] = field(default_factory=dict)  # align: {layer index: weight}, others 1.0
    temperature: float = 1.0  # distill: KL temperature
    ce_weight: float = 0.0  # distill: weight of next-token cross-entropy added to the KL
    kl_chunk: int = 1024  # distill: tokens per chunk of the vocabulary-sized KL
    lora_rank: int = 0  # > 0: LoRA adapters (peft) on lora_targets; train them with trainable: lora_
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj"


def stage_seq_len(cfg: RecipeConfig, stage: StageConfig) -> int:
    """Tokens per row in ``stage``."""
    return stage.seq_len or cfg.data.seq_len


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
    save_stages: bool = False  # also save the student after every stage but the last, as model-<stage>/


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
        raise RecipeError(f"recipe key {key!r}: {msg}; fix its value in the recipe or the override" if key
                          else f"recipe: {msg}") from None
    validate(cfg)
    return cfg


def parse_layer_spec(spec: str, num_layers: int | None = None, what: str = "--layers") -> list[int]:
    """``"0-3,7,10-"`` → sorted indices; ``"10-"`` runs to the last layer. Without ``num_layers`` only
    the syntax is checked (an open range then stands for its start alone)."""
    out: set[int] = set()
    parts = [p.strip() for p in str(spec).split(",")]
    if not any(parts):
        raise RecipeError(f"{what} {spec!r} names no layer; use indices and ranges like 0-3,7,10-")
    for part in filter(None, parts):
        a, dash, b = part.partition("-")
        if not a.strip().isdigit() or (b.strip() and not b.strip().isdigit()):
            raise RecipeError(f"{what}: cannot read {part!r}; use indices and ranges like 0-3,7,10- (no negatives)")
        lo = int(a)
        if num_layers is not None and lo >= num_layers:
            raise RecipeError(f"{what}: layer {lo} is out of range; the model has layers 0-{num_layers - 1}")
        hi = int(b) if b.strip() else (num_layers - 1 if num_layers is not None and dash else lo)
        if dash and b.strip() and hi < lo:
            raise RecipeError(f"{what}: the range {part!r} is empty (start after end); write {hi}-{lo}")
        out.update(range(lo, hi + 1))
    idx = sorted(out)
    if num_layers is not None:
        bad = [i for i in idx if i >= num_layers]
        if bad:
            raise RecipeError(f"{what}: layer {bad[0]} is out of range; the model has layers 0-{num_layers - 1}")
        if not idx:
            raise RecipeError(f"{what} {spec!r} names no layer of the model's 0-{num_layers - 1}")
    return idx


GLOBAL = "global"  # the layer choice "the layers without a sliding window" (linearize.models.adapters.global_layers)


def global_candidates(config, what: str = "--layers") -> list[int]:
    """The layers ``global`` names in a model of this ``config``; none is an error."""
    from .models.adapters import global_layers

    cand = global_layers(config)
    if not cand:
        raise RecipeError(f"{what} global: every layer of this model attends over a sliding window; "
                          "name the layers to convert instead")
    return cand


def check_conversion(layers: str | None, keep_softmax: str | None, num_layers: int | None = None,
                     where: tuple[str, str] = ("--layers", "--keep-softmax"), config=None) -> None:
    """Layer choices of a conversion; ranges too once ``num_layers`` is known, and which layers ``global``
    names once the model's ``config`` is. Something must convert."""
    if layers is not None and str(layers).strip() == GLOBAL:
        if config is None:
            return  # which layers those are is known with the model
        layers = ",".join(map(str, global_candidates(config, where[0])))
    cand = parse_layer_spec(layers, num_layers, where[0]) if layers is not None else None
    if num_layers is not None and cand is None:
        cand = list(range(num_layers))
    if keep_softmax is None:
        return
    from .layers.options import keep_count

    ks = str(keep_softmax).strip()
    try:
        counted = keep_count(ks)  # a count of layers and the rule that picks them; None: indices
    except ValueError as e:
        raise RecipeError(f"{where[1]} {keep_softmax}: {e}") from None
    if counted is not None:
        ks = str(counted[0])
        if cand is not None and counted[0] >= len(cand):
            raise RecipeError(f"{where[1]} {ks} keeps every one of the {len(cand)} layers to convert, so nothing "
                              f"would be converted; give a count below {len(cand)}")
        return
    kept = parse_layer_spec(ks, num_layers, where[1])
    if cand is not None and not set(cand) - set(kept):
        raise RecipeError(f"{where[1]} {ks} keeps every layer {where[0]} allows, so nothing would be converted")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _need(ok: bool, key: str, rule: str, value) -> None:
    if not ok:
        raise RecipeError(f"{key} must be {rule}; got {value!r}")


def validate(cfg: RecipeConfig) -> None:
    """Every field that can be checked without the model; called before anything is loaded."""
    from .layers.options import FORMS, TARGETS

    _need(isinstance(cfg.teacher.model, str) and cfg.teacher.model.strip() != "", "teacher.model",
          "an alias, .gguf file, model directory or hub id", cfg.teacher.model)
    c = cfg.convert
    _need(c.to in TARGETS, "convert.to", " or ".join(repr(t) for t in TARGETS), c.to)
    _need(c.form in FORMS, "convert.form", " or ".join(repr(f) for f in FORMS), c.form)
    _need(_finite(c.beta_max) and c.beta_max > 0, "convert.beta_max", "a finite number > 0", c.beta_max)
    _need(c.short_conv == 0 or 2 <= c.short_conv <= 8, "convert.short_conv", "0 (off) or a kernel size 2 to 8", c.short_conv)
    _need(isinstance(c.decay_rank, int) and not isinstance(c.decay_rank, bool) and 1 <= c.decay_rank <= 4096,
          "convert.decay_rank", "a whole number from 1 to 4096", c.decay_rank)
    _need(isinstance(c.window, int) and not isinstance(c.window, bool) and 0 <= c.window <= 65536, "convert.window",
          "0 (off) or a number of tokens up to 65536", c.window)
    _need(isinstance(c.sinks, int) and not isinstance(c.sinks, bool) and 0 <= c.sinks <= 65536 and (c.window or not c.sinks),
          "convert.sinks", "0, or a number of tokens with a convert.window", c.sinks)
    _need(c.to != "linear" or not (c.window or c.sinks), "convert.window",
          "0 with convert.to: linear (the linear target has no sink/window form; set convert.sinks: 0 too)", c.window)
    _need(isinstance(c.output_gate, bool), "convert.output_gate", "true or false", c.output_gate)
    _need(isinstance(c.write_gate, bool), "convert.write_gate", "true or false", c.write_gate)
    _need(not (c.write_gate and c.to == "linear"), "convert.write_gate", "false with convert.to: linear", c.write_gate)
    _need(isinstance(c.calibrate_mix, bool), "convert.calibrate_mix", "true or false", c.calibrate_mix)
    _need(c.mix_order in (1, 2) and not isinstance(c.mix_order, bool) and (c.mix_order == 1 or c.window),
          "convert.mix_order", "1, or 2 with a convert.window", c.mix_order)
    _need(isinstance(c.sparse_cache, int) and not isinstance(c.sparse_cache, bool) and 0 <= c.sparse_cache <= 65536
          and (c.window or not c.sparse_cache), "convert.sparse_cache", "0, or a number of tokens with a convert.window",
          c.sparse_cache)
    _need(c.fused_front is None or isinstance(c.fused_front, bool), "convert.fused_front", "true, false or null",
          c.fused_front)
    _need(c.calibration_tokens >= 1, "convert.calibration_tokens", "at least 1", c.calibration_tokens)
    _need(c.calibration_steps >= 0, "convert.calibration_steps", ">= 0", c.calibration_steps)
    check_conversion(c.layers, c.keep_softmax, where=("convert.layers", "convert.keep_softmax"))
    d = cfg.data
    for key in ("source", "split", "text_field"):
        _need(str(getattr(d, key)).strip() != "", f"data.{key}", "a non-empty string", getattr(d, key))
    _need(d.seq_len >= 2, "data.seq_len", "at least 2", d.seq_len)
    _need(_finite(d.heldout_fraction) and 0 < d.heldout_fraction < 1, "data.heldout_fraction",
          "between 0 and 1 (exclusive)", d.heldout_fraction)
    _need(d.max_documents is None or d.max_documents >= 1, "data.max_documents", "at least 1 or null", d.max_documents)
    _need(d.eval_tokens >= 1, "data.eval_tokens", "at least 1", d.eval_tokens)
    _need(all(_finite(w) and w >= 0 for w in d.weights.values()), "data.weights", "finite and >= 0", d.weights)
    _need(d.max_tokens is None or d.max_tokens >= d.seq_len, "data.max_tokens", "at least data.seq_len or null", d.max_tokens)
    _need(d.packing in ("documents", "stream"), "data.packing", "'documents' or 'stream'", d.packing)
    if not cfg.stages:
        raise RecipeError("recipe has no stages; add one with name: align or name: distill")
    for i, st in enumerate(cfg.stages):
        k = f"stages.{i}."
        _need(st.name in ("align", "distill"), k + "name", "'align' or 'distill'", st.name)
        _need(st.steps >= 1, k + "steps", "at least 1", st.steps)
        _need(st.batch_size >= 1, k + "batch_size", "at least 1", st.batch_size)
        _need(st.seq_len == 0 or (st.seq_len >= 2 and cfg.data.seq_len % st.seq_len == 0), k + "seq_len",
              f"0 (data.seq_len) or a length >= 2 that divides data.seq_len={cfg.data.seq_len} (for a longer "
              "stage, raise data.seq_len to it)", st.seq_len)
        _need(_finite(st.lr) and st.lr > 0, k + "lr", "a finite number > 0", st.lr)
        _need(st.trainable.strip() != "", k + "trainable", "parameter name parts (e.g. self_attn) or 'all'", st.trainable)
        _need(st.loss in ("mse", "nmse"), k + "loss", "'mse' or 'nmse'", st.loss)
        bad = {n: w for n, w in st.layer_weights.items() if not (_finite(w) and w >= 0)}
        _need(not bad, k + "layer_weights", "finite and >= 0", bad)
        neg = [n for n in st.layer_weights if n < 0]
        _need(not neg, k + "layer_weights", "keyed by layer indices >= 0", neg)
        _need(_finite(st.temperature) and st.temperature > 0, k + "temperature", "a finite number > 0", st.temperature)
        _need(_finite(st.ce_weight) and st.ce_weight >= 0, k + "ce_weight", "a finite number >= 0", st.ce_weight)
        _need(st.kl_chunk >= 1, k + "kl_chunk", "at least 1", st.kl_chunk)
        _need(st.lora_rank >= 0, k + "lora_rank", ">= 0 (0: no LoRA)", st.lora_rank)
        if st.lora_rank > 0:
            _need(st.lora_targets.strip() != "", k + "lora_targets", "module names (e.g. q_proj,v_proj)", st.lora_targets)
        if "lora_" in st.trainable and not any(s.lora_rank > 0 for s in cfg.stages):
            raise RecipeError(f"{k}trainable names lora_ but no stage has lora_rank > 0; set {k}lora_rank (e.g. 8)")
    o = cfg.optim
    _need(_finite(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay", "a finite number >= 0", o.weight_decay)
    _need(o.warmup_steps >= 0, "optim.warmup_steps", ">= 0", o.warmup_steps)
    _need(_finite(o.grad_clip) and o.grad_clip >= 0, "optim.grad_clip", "a finite number >= 0 (0: no clipping)", o.grad_clip)
    out = cfg.output
    _need(str(out.dir).strip() != "", "output.dir", "a folder path", out.dir)
    for key in ("checkpoint_every", "keep_last", "eval_every", "log_every"):
        _need(getattr(out, key) >= 1, f"output.{key}", "at least 1", getattr(out, key))
    if out.save_stages and cfg.parallel == "fsdp":
        raise RecipeError("output.save_stages is not supported with parallel: fsdp (only the final model is "
                          "gathered); drop it, or train with parallel: ddp")
    _need(cfg.seed >= 0, "seed", ">= 0", cfg.seed)
    _need(cfg.precision in ("fp32", "bf16"), "precision", "'fp32' or 'bf16'", cfg.precision)
    _need(cfg.parallel in ("ddp", "fsdp"), "parallel", "'ddp' or 'fsdp'", cfg.parallel)
    _need(cfg.device in ("auto", "cpu", "cuda"), "device", "'auto', 'cpu' or 'cuda'", cfg.device)


def to_yaml(cfg: RecipeConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
