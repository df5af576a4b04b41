"""The induction probe that ranks layers for ``--keep-softmax N:induction`` (linearize/retrieval.py), against the
attention weights transformers' eager attention returns, and the layers ``convert`` keeps with it."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import linearize
from linearize.config import RecipeError, check_conversion
from linearize.retrieval import induction_scores, retrieval_layers


def eager_scores(model, rows: int, length: int, seed: int = 0) -> torch.Tensor:
    """The same score from the attention weights of the model's own eager attention (sliding windows included)."""
    model.config._attn_implementation = "eager"
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    half = torch.randint(min(100, vocab // 2), vocab, (rows, length), generator=g)
    ids = torch.cat([half, half], 1)
    with torch.no_grad():
        att = model(ids, output_attentions=True, use_cache=False).attentions  # per layer (rows, Hq, T, T)
    t = torch.arange(length, 2 * length - 1)
    return torch.stack([a[:, :, t, t - length + 1].double().mean(dim=(0, 2)) for a in att])


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_induction_scores_equal_the_eager_attention_weights(family):
    """Per layer and query head (GQA; Gemma 3's local layers see their window only), on repeated random rows."""
    model = tiny_model(family)
    ours = induction_scores(model, rows=2, length=24)
    ref = eager_scores(model, rows=2, length=24)
    assert ours.shape == ref.shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-5
    if family == "gemma3_text":  # local layers (window 8) cannot see 24 tokens back: no mass there at all
        local = [i for i, kind in enumerate(model.config.layer_types) if kind == "sliding_attention"]
        assert local and float(ours[local].abs().max()) == 0.0


def test_convert_keeps_the_layers_with_the_strongest_induction_heads():
    teacher = tiny_model("llama", num_hidden_layers=6)
    best = eager_scores(tiny_model("llama", num_hidden_layers=6), rows=2, length=512).max(-1).values
    want = sorted(sorted(range(6), key=lambda i: -float(best[i]))[:2])
    assert retrieval_layers(teacher, list(range(6)), 2) == want
    calib = torch.randint(1, teacher.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(1))
    model = linearize.convert(teacher, calibration_ids=calib, keep_softmax="2:induction")
    assert model.config.linearize["softmax_layers"] == want
    assert model.config.linearize["gdn_layers"] == [i for i in range(6) if i not in want]


def test_keep_softmax_rule_is_checked():
    check_conversion(None, "2:induction", 4)
    check_conversion(None, "2:error", 4)
    with pytest.raises(RecipeError, match="the rule after ':' must be one of error, induction"):
        check_conversion(None, "2:retrieval", 4)
    with pytest.raises(RecipeError, match="nothing would be converted"):
        check_conversion(None, "4:induction", 4)
