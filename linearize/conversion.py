"""Walk a model and swap softmax attention blocks for Taylor-initialized GDN blocks; the classes a
converted model is saved and loaded as.

    model = linearize.convert(teacher, to="gdn", tokenizer=tok, keep_softmax=2)
    block = linearize.linearize_layer(teacher.model.layers[3].self_attn)

Saving and loading are :mod:`linearize.saving`. A converted model's ``config.model_type`` is
``linearize_<family>``; :func:`register` makes ``AutoModelForCausalLM`` know those types (the
package calls it on first use of its API, see :mod:`linearize`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import replace

import torch

from .calibration import NEW_PARAMETERS, fit_block
from .config import GLOBAL, global_candidates
from .layers.gdn_attention import GDNAttention
from .layers.options import GDNOptions, check_target, keep_count, save_option
from .models.adapters import decoder_layers
from .models.families import FAMILIES, PREFIX, Family, family_of


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
                    lo, hi = int(a), (int(b) if b else num_layers - 1)
                    if hi < lo:
                        raise ValueError(f"{what}: the range {part!r} is empty; write it low-high, e.g. {hi}-{lo}")
                    out.update(range(lo, hi + 1))
                else:
                    out.add(int(part))
            except ValueError as e:
                if "is empty" in str(e):
                    raise
                raise ValueError(f"{what}: cannot read {part!r}; use indices and ranges like 0-3,7,10-") from None
        idx = sorted(out)
    else:
        idx = sorted(set(int(i) for i in spec))
    bad = [i for i in idx if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"{what}: layer {bad[0]} is out of range; the model has layers 0-{num_layers - 1}")
    return idx


def attention_block(teacher: torch.nn.Module, options: GDNOptions | None = None) -> GDNAttention:
    """The converted block of ``options.target`` for one softmax attention module: a :class:`GDNAttention`
    (``gdn``, ``deltanet``, ``kda``) or its VaLA subclass (``linear``:
    :mod:`linearize.layers.vala_attention`)."""
    if options is not None and options.target == "linear":
        from .layers.vala_attention import VaLAAttention

        return VaLAAttention(teacher, options)
    return GDNAttention(teacher, options)


def swap_attention(model, gdn_layers: Sequence[int], options: GDNOptions | dict | None = None) -> None:
    """Replace ``self_attn`` of the listed decoder layers by the converted block (no calibration)."""
    opts = options if isinstance(options, GDNOptions) else GDNOptions(**(options or {}))
    layers = decoder_layers(model)
    for i in gdn_layers:
        if not isinstance(layers[i].self_attn, GDNAttention):
            layers[i].self_attn = attention_block(layers[i].self_attn, opts)


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
    gdn = attention_block(attention, options)
    if hidden_states is not None:
        gdn.calibrate(hidden_states, position_embeddings)
    return gdn


# the sparse cache's probe text: 8,192 built-in tokens in one row (rows of the model's context length where it
# is shorter). On SmolLM2 a probe fitted on one row of 8,192 ranks a passkey 0-85th of the older tokens at 2K to
# 8K on its 18 retrieval heads; fitted on 4 rows of 2,048, 5-4104 (results/sparse_cache_key_rank_smollm2*.json)
PROBE_TOKENS = 8192


def probe_shape(config) -> tuple[int, int]:
    """``(rows, tokens per row)`` of the probe text: ``PROBE_TOKENS`` in rows no longer than the model's context."""
    tokens = min(PROBE_TOKENS, getattr(config, "max_position_embeddings", None) or PROBE_TOKENS)
    return max(1, PROBE_TOKENS // tokens), tokens


def fit_cache_probes(model, blocks: dict, tokenizer=None, calibration_ids: torch.Tensor | None = None) -> None:
    """Fit each converted block's sparse-cache probe (:meth:`GDNAttention.fit_cache_probe`) on the teacher's
    attention over :func:`probe_shape` built-in tokens (``calibration_ids`` without a tokenizer), the layers
    captured eight at a time. ``blocks``: layer index → the block, not yet swapped in."""
    from .eval import capture_attention, text_ids

    rows, tokens = probe_shape(model.config)
    ids = text_ids(tokenizer, tokens, split="train", batch=rows) if tokenizer is not None else calibration_ids
    ids = ids.to(next(model.parameters()).device)
    order = sorted(blocks)
    for j in range(0, len(order), 8):
        caps = capture_attention(model, ids, order[j:j + 8], stop_early=True)
        for i, cap in caps.items():
            blocks[i].fit_cache_probe(cap.hidden_states, cap.position_embeddings)


def refit_cache_probes(model, tokenizer=None, calibration_ids: torch.Tensor | None = None) -> int:
    """Fit the sparse-cache probe of every converted block of ``model`` again (:func:`fit_cache_probes`), now on the
    model's own hidden states and its blocks' own q/k — after training moved both away from the teacher's the
    probes were fitted on at conversion; the text as there (``calibration_ids`` without a tokenizer). Returns the
    blocks refitted (0: the model has no sparse cache)."""
    from .eval import attention_modules

    blocks = {i: m for i, m in enumerate(attention_modules(model))
              if getattr(getattr(m, "options", None), "sparse_cache", 0)}
    if blocks:
        fit_cache_probes(model, blocks, tokenizer, calibration_ids)
    return len(blocks)


def graft_sparse_cache(model, size: int, tokenizer=None, calibration_ids: torch.Tensor | None = None) -> int:
    """Give every window block of ``model`` without a sparse cache one of ``size`` slots per KV head and fit its
    probe on the model as :func:`refit_cache_probes` does (the text as there): a cache for a model converted, or
    trained, without one, which it never trained with. The saved config follows. Returns the blocks given one."""
    from .eval import attention_modules

    blocks = [m for m in attention_modules(model) if getattr(getattr(m, "options", None), "window", 0)
              and not m.options.sparse_cache]
    for m in blocks:
        m.add_sparse_cache(size)
    if blocks:
        save_option(model, "sparse_cache", size)
        refit_cache_probes(model, tokenizer, calibration_ids)
    return len(blocks)


def _parameters(model) -> dict[str, tuple[int, torch.Size]]:
    return {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()}


def check_surgery(before: dict[str, tuple[int, torch.Size]], after: dict[str, tuple[int, torch.Size]]) -> None:
    """Raise unless every parameter of ``before`` is still there, the same tensor with the same shape
    (the GDN blocks reuse the teacher's projections and norms; nothing else is touched), and the only
    new ones are the GDN blocks' own (``NEW_PARAMETERS``)."""
    for name, (ptr, shape) in before.items():
        if name not in after:
            raise RuntimeError(f"convert dropped the teacher parameter {name}; the GDN block must carry it")
        if after[name][1] != shape:
            raise RuntimeError(f"convert changed the shape of {name}: {tuple(shape)} -> {tuple(after[name][1])}")
        if after[name][0] != ptr:
            raise RuntimeError(f"convert replaced the tensor of {name}; the teacher's weights must be reused as they are")
    new = [n for n in after if n not in before and not n.endswith(NEW_PARAMETERS)]
    if new:
        raise RuntimeError(f"convert added an unexpected parameter {new[0]}")


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
    calibration_steps: int = 0,
) -> torch.nn.Module:
    """Convert ``model`` in place to GDN attention and return it.

    Args:
        to: the target block: ``"gdn"`` (the gated delta rule), ``"deltanet"`` (the delta rule without a
            decay; at initialization the same outputs, see :func:`linearize.ops.taylor.fold_decay`),
            ``"linear"`` (VaLA, seed 000 eq. va-la, with a learnable decay correction:
            :mod:`linearize.layers.vala_attention`) or ``"kda"`` (the gated delta rule with a decay per key
            channel, the gdn block exactly at initialization: :mod:`linearize.layers.channel_decay`). It sets
            ``options.target``.
        layers: which layers may be converted (indices/ranges; default all), or ``"global"``: the layers
            that attend over the whole context (Gemma 3's every 6th), whose KV cache is the one that grows; a
            model's sliding-window layers keep a cache of fixed size as they are.
        keep_softmax: layers to keep as softmax: a list of indices, or a count N — keep the N
            layers whose stable-form error on calibration text is worst — or ``"N:induction"``: the N layers
            with the strongest long-range induction heads (:mod:`linearize.retrieval`; no calibration text).
        tokenizer / calibration_ids: calibration text (default: ``calibration_tokens`` tokens of
            the built-in train split) used to set ρ per head and to rank layers for ``keep_softmax``.
        options: :class:`GDNOptions` (form, β bound, operator backend).
        calibration_steps: Adam steps per layer fitting the block's own parameters to the teacher's
            attention output on the calibration text (:mod:`linearize.calibration`; 0: none).
    """
    from .eval import capture_attention, relative_error, text_ids

    check_target(to)
    if calibration_steps < 0:
        raise ValueError(f"calibration_steps must be >= 0; got {calibration_steps}")
    if options is not None and options.target not in ("gdn", to):
        raise ValueError(f"options.target={options.target!r} but to={to!r}: give the target once, as to=")
    options = replace(options or GDNOptions(), target=to)
    family = family_of(model.config)
    n = len(decoder_layers(model))
    if isinstance(layers, str) and layers.strip() == GLOBAL:
        candidates = global_candidates(model.config)
    else:
        candidates = parse_layers(layers, n) if layers is not None else list(range(n))
    rule = "error"
    try:
        counted = keep_count(keep_softmax) if keep_softmax is not None else None
    except ValueError as e:
        raise ValueError(f"--keep-softmax {keep_softmax}: {e}") from None
    if counted is not None:
        keep_softmax, rule = counted  # a count and its rule; indices come as "3,7" or "5,"
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

    before = _parameters(model)
    caps = capture_attention(model, calibration_ids, candidates)
    gdn = {i: linearize_layer(decoder_layers(model)[i].self_attn, options, caps[i].hidden_states, caps[i].position_embeddings)
           for i in candidates}
    if options.sparse_cache:  # before the calibration steps, which run the block with its cache
        fit_cache_probes(model, gdn, tokenizer, calibration_ids)
    for i in candidates if calibration_steps else []:
        fit_block(gdn[i], caps[i].hidden_states, caps[i].position_embeddings, caps[i].output, calibration_steps)
    if isinstance(keep_softmax, int) and keep_softmax > 0 and rule == "induction":
        from .retrieval import retrieval_layers

        kept = retrieval_layers(model, candidates, keep_softmax)
    elif isinstance(keep_softmax, int) and keep_softmax > 0:
        err = {i: relative_error(gdn[i].attention_output(caps[i].hidden_states, caps[i].position_embeddings), caps[i].output)
               for i in candidates}
        kept = sorted(sorted(candidates, key=lambda i: -err[i])[:keep_softmax])
    else:
        kept = list(keep_softmax or [])
    converted = [i for i in candidates if i not in kept]
    for i in converted:
        decoder_layers(model)[i].self_attn = gdn[i]

    check_surgery(before, _parameters(model))  # guard rails: the teacher's weights are reused, none changed

    cfg_cls, lm_cls = linearized_classes(family)
    opts = (options or GDNOptions()).to_dict()
    new_config = cfg_cls(**{k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "transformers_version")})
    new_config.linearize = {"gdn_layers": converted, "softmax_layers": [i for i in range(n) if i not in converted],
                            "options": opts, "teacher_model_type": family.model_type}
    new_config._attn_implementation = model.config._attn_implementation
    model.config = new_config
    for layer in decoder_layers(model):  # modules keep a reference to the config they were built with
        layer.self_attn.config = new_config
    # same modules and weights, new behaviour: a subclass that adds the GDN swap (and the fused kernels) in __init__
    model.__class__ = lm_cls
    fuse_inference_kernels(model)
    return model


def fuse_inference_kernels(model) -> None:
    """A converted model's RMSNorms and SiLU-gated MLPs on their one-pass Triton kernels where no gradient is
    wanted on CUDA (:mod:`linearize.modules.norm`, :mod:`linearize.modules.swiglu`); training and the CPU keep
    the modules' own forwards. ``convert`` and the converted classes' ``__init__`` call it."""
    from .modules.norm import fuse_norms
    from .modules.swiglu import fuse_mlps

    fuse_norms(model)
    fuse_mlps(model)


def unfuse_inference_kernels(model) -> None:
    """Take :func:`fuse_inference_kernels` off again: transformers' own norms and MLPs (to time or check against)."""
    from .modules.norm import unfuse_norms
    from .modules.swiglu import unfuse_mlps

    unfuse_norms(model)
    unfuse_mlps(model)


def _teacher_classes(f: Family):
    mod = importlib.import_module(f"transformers.models.{f.module}")
    return getattr(mod, f.config_class), getattr(mod, f.causal_lm_class)


_LINEARIZED: dict[str, tuple[type, type]] = {}


def linearized_classes(f: Family) -> tuple[type, type]:
    """``(ConfigClass, ForCausalLMClass)`` of the converted family, registered with the Auto classes."""
    if f.model_type in _LINEARIZED:
        return _LINEARIZED[f.model_type]
    from transformers import AutoConfig, AutoModelForCausalLM

    base_cfg, base_lm = _teacher_classes(f)
    model_type = PREFIX + f.model_type
    cfg_cls = type(f"Linearized{base_cfg.__name__}", (base_cfg,), {"model_type": model_type})

    def __init__(self, config):
        base_lm.__init__(self, config)
        spec = getattr(config, "linearize", None) or {}
        swap_attention(self, spec.get("gdn_layers", []), spec.get("options", {}))
        fuse_inference_kernels(self)

    def generate(self, inputs=None, **kwargs):
        """transformers' ``generate()``; on CUDA, for a model whose every layer is GDN and a plain call
        (greedy or sampled, ``max_new_tokens`` given), the same tokens through the CUDA-graph decoder of
        :mod:`linearize.decoding`."""
        from .decoding import graph_generate

        out = graph_generate(self, inputs, kwargs)
        return out if out is not None else base_lm.generate(self, inputs, **kwargs)

    lm_cls = type(f"Linearized{base_lm.__name__}", (base_lm,),
                  {"config_class": cfg_cls, "__init__": __init__, "generate": generate})
    AutoConfig.register(model_type, cfg_cls, exist_ok=True)
    AutoModelForCausalLM.register(cfg_cls, lm_cls, exist_ok=True)
    _LINEARIZED[f.model_type] = (cfg_cls, lm_cls)
    return cfg_cls, lm_cls


def register() -> None:
    """Register every family's converted classes with ``AutoConfig`` / ``AutoModelForCausalLM`` (idempotent)."""
    for f in FAMILIES.values():
        linearized_classes(f)
