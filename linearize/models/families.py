"""The architecture families linearize converts: a table, torch-free.

Every supported family computes attention the same way in transformers 5.x (q/k/v/o projections,
optional q/k norms, RoPE from the model), so one GDN module serves all of them; a family entry
only names its transformers classes. A converted model is saved with ``model_type =
"linearize_<family>"`` (``PREFIX``); :func:`linearize.conversion.linearized_classes` builds and
registers the classes that rebuild its GDN blocks.

Adding a family: its attention module must take ``(hidden_states, position_embeddings,
attention_mask, cache/past_key_values, **kwargs)`` and have ``q_proj/k_proj/v_proj/o_proj``,
``head_dim``, ``scaling`` (and ``q_norm/k_norm`` if it normalizes per head). Add one line to
``FAMILIES`` and a tiny-model test in ``tests/test_convert.py``.
"""

from __future__ import annotations

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
