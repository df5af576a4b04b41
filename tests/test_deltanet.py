"""The deltanet target: the delta rule without a decay, Taylor-initialized. Checked against the recurrent
definition of the operator (float64) and against the GDN block it must equal at initialization."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from test_convert import incremental_logits

import linearize
from linearize.layers import GDNAttention
from linearize.layers.cache import GDNStateLayer
from linearize.layers.options import GDNOptions
from linearize.ops.reference import gated_delta_rule_reference
from linearize.ops.taylor import fold_decay, taylor_back, taylor_front


def calib(model, T=48, seed=1):
    return torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


def ids(model, B=2, T=24, seed=2):
    return torch.randint(1, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("masked", [False, True])
def test_fold_decay_is_the_same_recurrence_without_decay(masked):
    """The GDN recurrence of the Taylor front (α = 1 − 1/t) equals the delta rule (α ≡ 1) on t·u, read with q/t."""
    g = torch.Generator().manual_seed(0)
    B, T, H, G, D = 2, 17, 2, 2, 8
    q = torch.randn(B, T, G * H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, D, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.3 if masked else None
    front = taylor_front(q, k, v, rho=torch.full((H,), 0.7, dtype=torch.float64), mask=mask)
    o, h = gated_delta_rule_reference(q, front.k, front.v, front.g, front.beta, output_final_state=True)
    q2, folded = fold_decay(q, copy.copy(front))
    assert (folded.g == 0).all()
    o2, h2 = gated_delta_rule_reference(q2, folded.k, folded.v, folded.g, folded.beta, output_final_state=True)
    assert torch.allclose(taylor_back(o2, front.v_mean), taylor_back(o, front.v_mean), rtol=1e-10, atol=1e-12)
    t = front.count[:, -1].clamp_min(1)[:, None, None, None]
    assert torch.allclose(h2, t * h, rtol=1e-10, atol=1e-12)  # the state is t× the GDN state


BLOCKS = [dict(), dict(window=4, sinks=2), dict(window=4, sinks=1, short_conv=3, output_gate=True)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: "-".join(f"{k}{v}" for k, v in b.items()) or "pure")
def test_deltanet_equals_gdn_at_init(family, block):
    teacher = tiny_model(family).double()
    c = calib(teacher)
    gdn = linearize.convert(copy.deepcopy(teacher), calibration_ids=c, options=GDNOptions(**block))
    delta = linearize.convert(copy.deepcopy(teacher), to="deltanet", calibration_ids=c, options=GDNOptions(**block))
    assert delta.config.linearize["options"]["target"] == "deltanet"
    blocks = [m for m in delta.modules() if isinstance(m, GDNAttention)]
    assert blocks and all(not hasattr(b, "gate_proj") for b in blocks)
    x = ids(teacher, T=30)
    want = gdn(x).logits
    assert torch.allclose(delta(x).logits, want, rtol=1e-9, atol=1e-9)
    # packed documents: positions restart where a document starts
    pos = torch.cat([torch.arange(11), torch.arange(19)])[None].expand(2, -1)
    assert torch.allclose(delta(x, position_ids=pos).logits, gdn(x, position_ids=pos).logits, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("block", BLOCKS[:2], ids=["pure", "window"])
def test_deltanet_prefill_and_decode_equal_full_forward(block):
    teacher = tiny_model("llama").double()
    model = linearize.convert(teacher, to="deltanet", calibration_ids=calib(teacher), options=GDNOptions(**block))
    x = ids(model, B=2, T=20)
    mask = torch.ones_like(x)
    pos = torch.arange(20)[None].expand(2, -1)
    full = model(x).logits
    inc, cache = incremental_logits(model, x, mask, pos, prefill=9)
    assert torch.allclose(inc, full, rtol=1e-9, atol=1e-9)
    # what is cached is t× the GDN state of the same prefix
    gdn = linearize.convert(tiny_model("llama").double(), calibration_ids=calib(teacher), options=GDNOptions(**block))
    _, gdn_cache = incremental_logits(gdn, x, mask, pos, prefill=9)
    for a, b in zip(cache.layers, gdn_cache.layers):
        if isinstance(a, GDNStateLayer):
            t = a.sums.count.clamp_min(1)[:, None, None, None]
            assert torch.allclose(a.state, t * b.state, rtol=1e-8, atol=1e-10)


def test_deltanet_saves_loads_and_generates(tmp_path):
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, to="deltanet", calibration_ids=calib(teacher), options=GDNOptions(window=4, sinks=2))
    model.save_pretrained(tmp_path / "m")
    back = linearize.load(tmp_path / "m")
    assert back.config.linearize["options"]["target"] == "deltanet"
    x = ids(model, B=1, T=12)
    assert torch.equal(back.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0),
                       model.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0))


def test_target_given_twice_must_agree():
    teacher = tiny_model("llama")
    with pytest.raises(ValueError, match="give the target once"):
        linearize.convert(teacher, to="gdn", calibration_ids=calib(teacher), options=GDNOptions(target="deltanet"))
    with pytest.raises(ValueError, match="supported targets: gdn, deltanet"):
        GDNOptions(target="mamba")
