"""The stacked projections of a decode step against the block's own five projections."""

from __future__ import annotations

import torch
from conftest import tiny_model
from torch import nn

import linearize
from linearize.layers.gdn_attention import GDNAttention
from linearize.layers.options import GDNOptions
from linearize.layers.step_projection import step_projections


def blocks(family="qwen2", to="gdn", **options):  # qwen2: q/k/v with biases
    teacher = tiny_model(family)
    ids = torch.randint(1, teacher.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    model = linearize.convert(teacher, calibration_ids=ids, to=to, options=GDNOptions(**options)).double()
    for m in model.modules():
        if isinstance(m, GDNAttention):
            nn.init.normal_(m.beta_proj.weight, std=0.1)  # not the zero init: every row of the product counts
            if m.decays:
                nn.init.normal_(m.gate_proj.weight, std=0.1)
    return model, [m for m in model.modules() if isinstance(m, GDNAttention)]


def separate(attn, x):
    gate = attn.gate_proj(x) if attn.decays else torch.zeros_like(attn.beta_proj(x))
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), attn.beta_proj(x), gate


def test_stacked_product_equals_the_five_projections_and_follows_their_weights():
    for family, options in (("qwen2", {}), ("llama", {"to": "deltanet"})):
        model, attns = blocks(family, **options)
        attn = attns[0]
        assert attn.q_proj.bias is not None or family != "qwen2"
        x = torch.randn(3, 1, attn.q_proj.in_features, dtype=torch.float64)
        with torch.no_grad():
            for got, want in zip(step_projections(attn, x), separate(attn, x)):
                assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
            for param, step in ((attn.k_proj.weight, 0.5), (attn.beta_proj.bias, 1.0)):
                param.add_(step)  # trained in place: the stacked copy must follow
                for got, want in zip(step_projections(attn, x), separate(attn, x)):
                    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_no_stacking_under_autograd_or_for_wrapped_projections():
    model, attns = blocks()
    attn = attns[0]
    x = torch.randn(2, 1, attn.q_proj.in_features, dtype=torch.float64)
    assert step_projections(attn, x) is None  # grad enabled: training keeps the block's own path
    attn.q_proj = nn.Sequential(attn.q_proj)  # as a LoRA wrapper would be: not a plain nn.Linear
    with torch.no_grad():
        assert step_projections(attn, x) is None


def test_decoding_with_stacked_projections_equals_without():
    model, attns = blocks("llama", window=4, sinks=2)
    ids = torch.randint(1, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    stacked = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    try:
        GDNAttention.stacked_step = False
        plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    finally:
        GDNAttention.stacked_step = True
    assert torch.equal(stacked, plain)
