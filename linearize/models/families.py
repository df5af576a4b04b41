"""The architecture families linearize converts, and their saved-model classes.

Every supported family computes attention the same way in transformers 5.x (q/k/v/o projections,
optional q/k norms, RoPE from the model), so one GDN module serves all of them; a family entry
only names its transformers classes. A converted model is saved with ``model_type =
"linearize_<family>"``; the classes registered here under that name rebuild the GDN blocks listed
in ``config.linearize``, so ``AutoModelForCausalLM.from_pretrained`` works after ``import
linearize`` with no ``trust_remote_code``.

Adding a family: its attention module must take ``(hidden_states, position_embeddings,
attention_mask, cache/past_key_values, **kwargs)`` and have ``q_proj/k_proj/v_proj/o_proj``,
``head_dim``, ``scaling`` (and ``q_norm/k_norm`` if it normalizes per head). Add one line to
``FAMILIES`` and a tiny-model test in ``tests/test_convert.py``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

PREFIX = "linearize_"


@dataclass(frozen=True)
class Family:
    model_type: str  # the teacher's config.model_type
    module: str  # transformers.models.<module>
    config_class: str
    causal_lm_class: str


FAMILIES = {
    f.model_type: f
    for f in (
        Family("llama", "llama", "LlamaConfig", "LlamaForCausalLM"),  # SmolLM2, Llama 3
        Family("mistral", "mistral", "MistralConfig", "MistralForCausalLM"),
        Family("qwen2", "qwen2", "Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v biases
        Family("qwen3", "qwen3", "Qwen3Config", "Qwen3ForCausalLM"),  # q_norm/k_norm
        Family("gemma3_text", "gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM"),  # sliding + global, q/k norms
    )
}


class UnsupportedArchitecture(ValueError):
    pass


def family_of(config) -> Family:
    mt = config.model_type
    mt = mt[len(PREFIX):] if mt.startswith(PREFIX) else mt
    if mt not in FAMILIES:
        raise UnsupportedArchitecture(
            f"architecture {config.model_type!r} is not supported; supported: {', '.join(FAMILIES)}. "
            "To add one, see linearize/models/families.py"
        )
    return FAMILIES[mt]


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
        from ..convert import swap_attention  # late: convert imports this module

        spec = getattr(config, "linearize", None) or {}
        swap_attention(self, spec.get("gdn_layers", []), spec.get("options", {}))

    lm_cls = type(f"Linearized{base_lm.__name__}", (base_lm,), {"config_class": cfg_cls, "__init__": __init__})
    AutoConfig.register(model_type, cfg_cls, exist_ok=True)
    AutoModelForCausalLM.register(cfg_cls, lm_cls, exist_ok=True)
    _LINEARIZED[f.model_type] = (cfg_cls, lm_cls)
    return cfg_cls, lm_cls


def register_all() -> None:
    for f in FAMILIES.values():
        linearized_classes(f)
