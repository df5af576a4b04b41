"""RoPE scaling set on a loaded model: YaRN or linear interpolation, as transformers defines them.

    rope_scaling(model, "yarn:4:2048")   # factor 4 over an original length of 2,048 tokens

A model trained on short rows reads positions far beyond them badly; these rules stretch its rotary
frequencies so that the long positions look like the trained ones. transformers builds a model's rotary
embedding from ``config.rope_parameters`` when the model is made, so the rule is written there and every
rotary embedding module is built again from it (the weights are untouched). Families whose config holds
one set of RoPE parameters (Llama, Qwen, Mistral, ...) are supported; per-layer-type ones (Gemma 3) are not.

``layers="softmax"`` scales only the softmax attention a hybrid kept: those layers get their rotary
embedding from a scaled copy (a forward pre-hook replaces the ``position_embeddings`` the decoder layer
hands them), while the converted layers, whose window and Taylor state were trained on the plain RoPE, keep
it. The model's config then stays as it was.
"""

from __future__ import annotations

from ..checks import UserError

# transformers' "dynamic" (NTK) rule starts only past config.max_position_embeddings, whatever original length
# it is given, so it is left out: for a model whose config claims more than it was trained on it does nothing.
KINDS = ("yarn", "linear")


def parse_rope_scaling(spec: str) -> tuple[str, float, int | None]:
    """``"yarn:4"`` or ``"yarn:4:2048"`` → ``(kind, factor, original length or None)``."""
    parts = spec.split(":")
    try:
        kind, factor = parts[0], float(parts[1])
        original = int(parts[2]) if len(parts) == 3 else None
        if len(parts) > 3 or kind not in KINDS or factor <= 1.0 or (original is not None and original < 1):
            raise ValueError
    except (ValueError, IndexError):
        raise UserError(f"--rope-scaling {spec!r}: give KIND:FACTOR[:ORIGINAL_LENGTH] with KIND one of "
                        f"{', '.join(KINDS)} and FACTOR > 1, e.g. yarn:4:2048") from None
    return kind, factor, original


def check_layers(layers: str) -> None:
    if layers not in ("all", "softmax"):
        raise UserError(f"--rope-scaling-layers {layers!r}: give all or softmax")


def rope_scaling(model, spec: str, layers: str = "all") -> dict:
    """Set the RoPE scaling ``spec`` (see :func:`parse_rope_scaling`) on ``model`` in place and rebuild its
    rotary embeddings (``layers="all"``) or only those the kept softmax layers read (``"softmax"``); returns
    the new ``rope_parameters``. The original length defaults to the config's ``max_position_embeddings``."""
    check_layers(layers)
    kind, factor, original = parse_rope_scaling(spec)
    config = model.config
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise UserError(f"--rope-scaling: {config.model_type} keeps no single set of RoPE parameters "
                        "(per layer type, or none); evaluate it without --rope-scaling")
    new = {"rope_type": kind, "factor": factor, "rope_theta": params["rope_theta"]}
    if kind != "linear":
        new["original_max_position_embeddings"] = original or config.max_position_embeddings
    if "partial_rotary_factor" in params:
        new["partial_rotary_factor"] = params["partial_rotary_factor"]
    if layers == "softmax":
        _scale_softmax_layers(model, new)
        return new
    config.rope_parameters = new
    rebuilt = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding") and hasattr(child, "inv_freq"):
                setattr(parent, name, type(child)(config).to(child.inv_freq.device))
                rebuilt += 1
    if not rebuilt:
        raise UserError(f"--rope-scaling: no rotary embedding found in this {config.model_type} model")
    return new


def _scale_softmax_layers(model, params: dict) -> None:
    import copy

    from ..layers import GDNAttention
    from .adapters import decoder_layers

    kept = [layer.self_attn for layer in decoder_layers(model) if not isinstance(layer.self_attn, GDNAttention)]
    rotary = getattr(model.model, "rotary_emb", None)
    if not kept or rotary is None:
        raise UserError("--rope-scaling-layers softmax: this model keeps no softmax attention layer "
                        "(every layer converted); use --rope-scaling-layers all")
    config = copy.deepcopy(model.config)
    config.rope_parameters = params
    scaled = type(rotary)(config).to(rotary.inv_freq.device)
    for attn in kept:
        attn.scaled_rotary = scaled  # one module shared by the kept layers (its buffers are not saved)
        attn.register_forward_pre_hook(_scaled_position_embeddings, with_kwargs=True)


def _scaled_position_embeddings(module, args, kwargs):
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError("a kept softmax layer was called without position_ids; its scaled RoPE needs them")
    kwargs["position_embeddings"] = module.scaled_rotary(hidden, position_ids)
    return args, kwargs
