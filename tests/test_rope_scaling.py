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
