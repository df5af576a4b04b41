"""The write gate (``GDNOptions.write_gate``): a learnable strength on each token's write into the state.

Checked against the Taylor form itself: a factor of 1 (the gate at init) is the block without it exactly;
the delta rule is linear in what is written, so a constant factor c scales the state's read by c; a
factor on one token changes what later tokens read and nothing before it; and the decode path (prefill,
then one token at a time) equals the full forward with the gate moved off its init."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_model
from test_convert import incremental_logits

import linearize
from linearize.config import StageConfig, load_recipe
from linearize.distill.optim import trainable_names
from linearize.layers import GDNAttention
from linearize.layers.options import GDNOptions
from linearize.ops import gated_delta_rule
from linearize.ops.taylor import taylor_front

f64 = torch.float64


def front_inputs(B=2, T=40, H=2, G=2, D=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * G, D, generator=gen, dtype=f64) * D**-0.5
    k = torch.randn(B, T, H, D, generator=gen, dtype=f64) + 0.5  # keys share an offset, as real keys do
    v = torch.randn(B, T, H, D, generator=gen, dtype=f64)
    return q, k, v


def state_read(q, k, v, write_factor=None):
    """The Taylor-GDN's read ``hᵀq`` (the output without ``v̄``) and the front, through the reference loop."""
    front = taylor_front(q, k, v, rho=torch.ones(k.shape[2], dtype=f64), write_factor=write_factor)
    o, _ = gated_delta_rule(q, front.k, front.v, front.g, front.beta, backend="reference")
    return o, front


def test_a_constant_factor_scales_the_read_and_one_token_only_what_follows():
    q, k, v = front_inputs()
    base, front = state_read(q, k, v)
    same, _ = state_read(q, k, v, torch.ones(front.beta.shape, dtype=f64))
    assert torch.equal(same, base)
    scaled, _ = state_read(q, k, v, torch.full(front.beta.shape, 3.0, dtype=f64))
    torch.testing.assert_close(scaled, 3.0 * base, rtol=1e-12, atol=1e-12)
    one = torch.ones(front.beta.shape, dtype=f64)
    s = 17
    one[:, s] = 5.0
    bumped, f2 = state_read(q, k, v, one)
    assert torch.equal(bumped[:, :s], base[:, :s])  # nothing before the token moves
    assert (bumped[:, s:] - base[:, s:]).abs().amax() > 1e-3
    for name in ("k", "g", "beta", "v_mean"):  # the gate touches the written value only
        assert torch.equal(getattr(f2, name), getattr(front, name)), name


# --- the converted block -------------------------------------------------------------------------------------


def ids(model, B=2, T=24, seed=2):
    return torch.randint(1, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def calib(model, T=48):
    return ids(model, B=1, T=T, seed=1)


def gates(model) -> list:
    return [m.write_gate for m in model.modules() if isinstance(m, GDNAttention)]


@torch.no_grad()
def perturb(model, std=0.3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for g in gates(model):
        g.weight.copy_(torch.randn(g.weight.shape, generator=gen) * std)
        g.bias.copy_(torch.randn(g.bias.shape, generator=gen) * std)


BLOCKS = [dict(), dict(window=4, sinks=2), dict(window=4, sinks=1, short_conv=3, output_gate=True)]


@pytest.mark.parametrize("target", ["gdn", "deltanet", "kda"])
@pytest.mark.parametrize("block", BLOCKS, ids=["pure", "window", "window-conv-gate"])
def test_the_gate_is_the_block_without_it_at_init(target, block):
    teacher = tiny_model("llama").double()
    c = calib(teacher)
    plain = linearize.convert(copy.deepcopy(teacher), to=target, calibration_ids=c, options=GDNOptions(**block))
    gated = linearize.convert(copy.deepcopy(teacher), to=target, calibration_ids=c,
                              options=GDNOptions(write_gate=True, **block))
    assert len(gates(gated)) == gated.config.num_hidden_layers
    x = ids(teacher, T=30)
    want = plain(x).logits
    assert torch.equal(gated(x).logits, want)
    pos = torch.cat([torch.arange(11), torch.arange(19)])[None].expand(2, -1)  # packed documents
    packed = dict(position_ids=pos, use_cache=False)  # the training path: each document from a fresh state
    assert torch.equal(gated(x, **packed).logits, plain(x, **packed).logits)
    perturb(gated)
    assert (gated(x).logits - want).abs().max() > 1e-4


def test_the_gate_trains():
    teacher = tiny_model("llama").double()
    model = linearize.convert(teacher, calibration_ids=calib(teacher), options=GDNOptions(window=4, sinks=2,
                                                                                          write_gate=True))
    model(ids(model, T=20)).logits.square().mean().backward()
    assert all(g.weight.grad.abs().max() > 0 and g.bias.grad.abs().max() > 0 for g in gates(model))
    new = {n for n, _ in model.named_parameters() if "write_gate" in n}
    assert len(new) == 2 * model.config.num_hidden_layers
    for trainable in ("self_attn", StageConfig().trainable):
        assert new <= set(trainable_names(model, StageConfig(trainable=trainable)))


@pytest.mark.parametrize("block", BLOCKS[:2], ids=["pure", "window"])
def test_prefill_and_decode_equal_the_full_forward(block):
    """A left-padded batch with the gate off its init: the prefill, then one token at a time (the composed
    ops: the fused step kernels know no write gate), against the full forward of each row."""
    teacher = tiny_model("llama").double()
    model = linearize.convert(teacher, calibration_ids=calib(teacher), options=GDNOptions(write_gate=True, **block))
    perturb(model)
    assert not any(m.fused_step for m in model.modules() if isinstance(m, GDNAttention))
    x = ids(model, B=2, T=20)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    keep = mask.bool()
    full = model(x, attention_mask=mask, position_ids=pos).logits
    steps, _ = incremental_logits(model, x, mask, pos, prefill=9)
    assert torch.allclose(steps[keep], full[keep], rtol=1e-9, atol=1e-9)


def test_saved_loaded_and_bad_input(tmp_path):
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=calib(teacher), options=GDNOptions(window=4, sinks=2,
                                                                                          write_gate=True))
    perturb(model)
    model.save_pretrained(tmp_path / "m")
    back = linearize.load(tmp_path / "m")
    assert back.config.linearize["options"]["write_gate"] is True
    x = ids(model, B=1, T=12)
    assert torch.equal(back(x).logits, model(x).logits)
    with pytest.raises(ValueError, match="write_gate"):
        GDNOptions(target="linear", write_gate=True)
    with pytest.raises(ValueError, match="write_gate must be true or false"):
        GDNOptions(write_gate="yes")


def test_cli_and_recipe(tiny_dir, tmp_path):
    from test_cli import run

    out = tmp_path / "wg"
    code, text = run("convert", "--model", tiny_dir, "--output", out, "--write-gate", "--tokens", 64,
                     "--calibration-tokens", 64)
    assert code == 0, text
    assert json.loads((out / "config.json").read_text())["linearize"]["options"]["write_gate"] is True
    code, text = run("convert", "--model", tiny_dir, "--output", tmp_path / "bad", "--to", "linear", "--write-gate")
    assert code == 2 and "write" in text and not (tmp_path / "bad").exists()
    cfg = load_recipe(None, [f"teacher.model={tiny_dir}", "convert.write_gate=true"])
    assert cfg.convert.write_gate is True
    with pytest.raises(Exception, match="convert.write_gate"):
        load_recipe(None, [f"teacher.model={tiny_dir}", "convert.write_gate=true", "convert.to=linear"])
