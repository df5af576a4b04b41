"""RoPE scaling set on a loaded model (linearize.models.rope) against transformers building the same model
from a config that carries the rule from the start; and a converted window block, scaled like its teacher,
still its teacher over its window and sinks."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config, tiny_model
from test_convert import ids

from linearize.checks import UserError
from linearize.models.rope import parse_rope_scaling, rope_scaling


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("spec,params", [
    ("yarn:4:64", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    ("yarn:2", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}),  # the config's
    ("linear:2", {"rope_type": "linear", "factor": 2.0}),
])
def test_scaled_model_is_the_model_built_with_the_rule(family, spec, params):
    from transformers import AutoModelForCausalLM

    model = tiny_model(family)
    x = ids(model, B=2, T=160)
    with torch.no_grad():
        before = model(x).logits
    set_to = rope_scaling(model, spec)
    cfg = tiny_config(family)
    cfg.rope_parameters = {**params, "rope_theta": cfg.rope_parameters["rope_theta"]}
    reference = AutoModelForCausalLM.from_config(cfg).eval()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        got, want = model(x).logits, reference(x).logits
    assert set_to == cfg.rope_parameters
    assert torch.equal(got, want)
    assert (got - before).abs().max() > 1e-3  # the rule changed the model


def test_a_scaled_window_block_is_its_scaled_teacher_over_the_window():
    import linearize
    from linearize.layers import GDNOptions

    teacher = tiny_model("llama")
    x = ids(teacher, B=2, T=24)
    model = linearize.convert(tiny_model("llama"), calibration_ids=x, options=GDNOptions(window=8, sinks=3))
    for m in (teacher, model):
        rope_scaling(m, "yarn:4:16")
    with torch.no_grad():
        assert (model(x[:, :11]).logits - teacher(x[:, :11]).logits).abs().max() < 1e-5


@pytest.mark.parametrize("spec", ["yarn", "yarn:1", "yarn:0.5:2048", "ntk:4", "dynamic:4", "yarn:4:0", "yarn:4:2048:1", "yarn:x"])
def test_bad_rules_are_refused(spec):
    with pytest.raises(UserError, match="KIND:FACTOR"):
        parse_rope_scaling(spec)


def test_a_family_without_one_set_of_rope_parameters_is_refused():
    model = tiny_model("gemma3_text")
    if isinstance(model.config.rope_parameters, dict) and "rope_theta" in model.config.rope_parameters:
        pytest.skip("this transformers keeps Gemma 3's RoPE parameters in one set")
    with pytest.raises(UserError, match="no single set"):
        rope_scaling(model, "yarn:4")


def test_softmax_layers_only_scales_the_kept_softmax_layers():
    """A model that keeps every layer softmax, scaled on its softmax layers only, is the model transformers
    builds with the rule; in a hybrid the converted layers keep the plain RoPE (their outputs unchanged)."""
    from transformers import AutoModelForCausalLM

    import linearize

    teacher = tiny_model("llama")
    x = ids(teacher, B=2, T=40)
    every = linearize.convert(tiny_model("llama"), calibration_ids=x, keep_softmax=4)
    rope_scaling(every, "yarn:4:16", layers="softmax")
    cfg = tiny_config("llama")
    cfg.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": cfg.rope_parameters["rope_theta"],
                           "original_max_position_embeddings": 16}
    reference = AutoModelForCausalLM.from_config(cfg).eval()
    reference.load_state_dict(tiny_model("llama").state_dict())
    with torch.no_grad():
        assert torch.equal(every(x).logits, reference(x).logits)

    def layer_outputs(model):
        got = []
        hooks = [layer.register_forward_hook(lambda m, a, o: got.append(o[0] if isinstance(o, tuple) else o))
                 for layer in model.model.layers]
        with torch.no_grad():
            logits = model(x).logits
        for h in hooks:
            h.remove()
        return got, logits

    hybrid = linearize.convert(tiny_model("llama"), calibration_ids=x, keep_softmax=[1, 3])
    plain, plain_logits = layer_outputs(hybrid)
    rope_scaling(hybrid, "yarn:4:16", layers="softmax")
    scaled, scaled_logits = layer_outputs(hybrid)
    assert torch.equal(plain[0], scaled[0])  # layer 0 is converted: the plain RoPE, the same input
    assert (plain[1] - scaled[1]).abs().max() > 1e-4  # layer 1 kept softmax: scaled
    assert (plain_logits - scaled_logits).abs().max() > 1e-4
    assert hybrid.config.rope_parameters.get("rope_type", "default") == "default"  # the config is left alone


def test_softmax_layers_only_needs_a_softmax_layer():
    import linearize

    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=ids(teacher, B=1, T=24))
    with pytest.raises(UserError, match="keeps no softmax attention layer"):
        rope_scaling(model, "yarn:4", layers="softmax")
