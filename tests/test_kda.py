"""The kda target: the gated delta rule with a decay per key channel (Kimi Delta Attention).

The operator (``linearize.ops.kda``) against its recurrent definition in float64 — outputs, final states and
every gradient — and against the GDN operator where every channel decays alike; then the converted block,
which at initialization must compute exactly what the gdn block computes."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_interpreter, tiny_model
from test_convert import incremental_logits

import linearize
from linearize.config import StageConfig, load_recipe
from linearize.decoding import Decoder
from linearize.distill.optim import trainable_names
from linearize.layers import GDNAttention
from linearize.layers.options import GDNOptions
from linearize.ops import gated_delta_rule, gated_delta_rule_step
from linearize.ops.decode import taylor_gdn_step_
from linearize.ops.kda import kda_chunk, kda_reference
from linearize.ops.window_inputs import WindowBuffers
from linearize.ops.window_step import sink_window_gdn_step_

f64 = torch.float64


def kda_inputs(B, T, H, G, K, V, seed, dtype=f64, decay=1.0):
    """Random inputs: unit keys, per-channel log-decays in (−decay, 0), β in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H * G, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, H, K, generator=gen, dtype=dtype) * decay
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, v, g, beta


CASES = {  # (B, T, H, G, K, V, cu_seqlens, initial state, chunk)
    "gqa-odd-T": (2, 75, 2, 3, 16, 8, None, True, 64),
    "packed": (1, 150, 2, 2, 8, 12, [0, 37, 37, 101, 150], True, 64),
    "chunk32": (1, 63, 1, 2, 8, 8, [0, 20, 63], False, 32),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_kda_chunk_equals_reference_with_gradients(case):
    B, T, H, G, K, V, cu, init, chunk = CASES[case]
    q, k, v, g, beta = kda_inputs(B, T, H, G, K, V, seed=len(case))
    cu = torch.tensor(cu) if cu is not None else None
    N = B if cu is None else cu.numel() - 1
    h0 = torch.randn(N, H, K, V, dtype=f64, generator=torch.Generator().manual_seed(9)) if init else None
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    twins = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    kw = dict(scale=0.4, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o_ref, h_ref = kda_reference(*inputs, **kw)
    o, h = kda_chunk(*twins, chunk_size=chunk, **kw)
    assert torch.allclose(o, o_ref, rtol=1e-10, atol=1e-11)
    assert torch.allclose(h, h_ref, rtol=1e-10, atol=1e-11)
    gen = torch.Generator().manual_seed(3)
    do, dh = torch.randn(o.shape, generator=gen, dtype=f64), torch.randn(h.shape, generator=gen, dtype=f64)
    ((o_ref * do).sum() + (h_ref * dh).sum()).backward()
    ((o * do).sum() + (h * dh).sum()).backward()
    for name, a, b in zip("q k v g beta".split(), twins, inputs):
        assert torch.allclose(a.grad, b.grad, rtol=1e-9, atol=1e-10), name


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_kda_with_equal_channels_is_the_gdn_operator(backend):
    """g_t,i = g_t for every channel: the GDN operator's scalar-decay result (its reference loop)."""
    q, k, v, g, beta = kda_inputs(1, 90, 2, 2, 16, 8, seed=4)
    g = g[..., 0]
    cu = torch.tensor([0, 41, 90])
    h0 = torch.randn(2, 2, 16, 8, dtype=f64)
    off = torch.randn(1, 90, 2, 8, dtype=f64)
    kw = dict(scale=0.5, initial_state=h0, output_final_state=True, cu_seqlens=cu, v_offset=off)
    want, h_want = gated_delta_rule(q, k, v, g, beta, backend="reference", **kw)
    got, h_got = gated_delta_rule(q, k, v, g[..., None].expand_as(k), beta, backend=backend, **kw)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-11)
    assert torch.allclose(h_got, h_want, rtol=1e-10, atol=1e-11)


def test_kda_decode_steps_equal_the_chunk_form():
    B, T, H, G, K, V = 2, 40, 2, 2, 8, 8
    q, k, v, g, beta = kda_inputs(B, T, H, G, K, V, seed=5)
    h0 = torch.randn(B, H, K, V, dtype=f64)
    want, h_want = kda_chunk(q, k, v, g, beta, scale=0.3, initial_state=h0, output_final_state=True, chunk_size=16)
    h, outs = h0, []
    for t in range(T):  # the public step routes a per-channel g to kda_step
        o, h = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], h, 0.3)
        outs.append(o)
    assert torch.allclose(torch.stack(outs, 1), want, rtol=1e-10, atol=1e-11)
    assert torch.allclose(h, h_want, rtol=1e-10, atol=1e-11)


def test_kda_chunk_is_stable_in_float32_under_strong_decays():
    """Decays of up to e⁻⁸ a token (e⁻⁵¹² over a chunk): no factor of the chunk form overflows."""
    q, k, v, g, beta = kda_inputs(1, 130, 2, 2, 16, 16, seed=6, decay=8.0)
    want, _ = kda_reference(q, k, v, g, beta)
    got, _ = kda_chunk(*(x.float() for x in (q, k, v, g, beta)))
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max() < 1e-4


def test_decode_step_kernels_refuse_a_per_channel_decay():
    """The decode-step kernels take one decay per head (the kda block steps through the torch body); the chunked
    operator's kernels take a per-channel g (tests/test_kda_triton*.py), of k's shape only."""
    q, k, v, g, beta = kda_inputs(1, 8, 1, 1, 8, 8, seed=7, dtype=torch.float32)
    with pytest.raises(ValueError, match="per-channel g must be"):
        gated_delta_rule(q, k, v, g[..., :4], beta)
    N, H, K = 2, 1, 8
    state, sk, sv, n = torch.zeros(N, H, K, K), torch.zeros(N, H, K), torch.zeros(N, H, K), torch.zeros(N)
    args = (torch.randn(N, H, K), torch.randn(N, H, K), torch.randn(N, H, K), state, sk, sv, n, torch.ones(H),
            torch.ones(N, H), torch.ones(N, H, K), 1.0)
    with pytest.raises(ValueError, match="per-channel"):
        taylor_gdn_step_(*args, K ** -0.5, backend="triton")
    buf = WindowBuffers.empty(torch.zeros(N, 1, H, K), 2, 1)
    with pytest.raises(ValueError, match="per-channel"):
        sink_window_gdn_step_(*args[:3], buf, *args[3:-1], torch.zeros(H), 1.0, 2, 1, backend="triton")


def test_decode_steps_take_a_per_channel_gate():
    """The Taylor-GDN decode steps with the gate factor repeated over channels equal the per-head one."""
    N, H, G, K = 2, 2, 2, 8
    gen = torch.Generator().manual_seed(8)
    f_g = torch.rand(N, H, generator=gen, dtype=f64) + 0.5
    for window in (0, 3):
        outs = []
        for gate in (f_g, f_g[..., None].expand(N, H, K)):
            state, sk, sv, n = (torch.zeros(N, H, K, K, dtype=f64), torch.zeros(N, H, K, dtype=f64),
                                torch.zeros(N, H, K, dtype=f64), torch.zeros(N, dtype=f64))
            buf = WindowBuffers.empty(torch.zeros(N, 1, H, K, dtype=f64), window, 1) if window else None
            g2 = torch.Generator().manual_seed(1)
            for _ in range(6):
                q, k, v = (torch.randn(N, h, K, generator=g2, dtype=f64) for h in (G * H, H, H))
                common = (state, sk, sv, n, torch.ones(H, dtype=f64), torch.ones(N, H, dtype=f64), gate)
                if window:
                    o = sink_window_gdn_step_(q, k, v, buf, *common, torch.zeros(G * H, dtype=f64), 1.0, window, 1)
                else:
                    o = taylor_gdn_step_(q, k, v, *common, 1.0, K ** -0.5)
            outs.append((o, state.clone()))
        assert torch.allclose(outs[0][0], outs[1][0], rtol=1e-12, atol=1e-12)
        assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-12, atol=1e-12)


# --- the converted block -------------------------------------------------------------------------------------


def calib(model, T=48, seed=1):
    return torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


def ids(model, B=2, T=24, seed=2):
    return torch.randint(1, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def corrections(model) -> list:
    return [m.channel_gate_proj for m in model.modules() if isinstance(m, GDNAttention)]


@torch.no_grad()
def perturb(model, std=0.5, seed=0):
    """Move every per-channel correction off zero, so that the channels decay each their own way."""
    gen = torch.Generator().manual_seed(seed)
    for c in corrections(model):
        c.up.weight.copy_(torch.randn(c.up.weight.shape, generator=gen, dtype=c.up.weight.dtype) * std)


BLOCKS = [dict(), dict(window=4, sinks=2), dict(window=4, sinks=1, short_conv=3, output_gate=True)]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("block", BLOCKS, ids=["pure", "window", "window-conv-gate"])
def test_kda_equals_gdn_at_init(family, block):
    teacher = tiny_model(family).double()
    c = calib(teacher)
    gdn = linearize.convert(copy.deepcopy(teacher), calibration_ids=c, options=GDNOptions(**block))
    kda = linearize.convert(copy.deepcopy(teacher), to="kda", calibration_ids=c, options=GDNOptions(**block))
    assert kda.config.linearize["options"]["target"] == "kda"
    assert len(corrections(kda)) == kda.config.num_hidden_layers
    x = ids(teacher, T=30)
    want = gdn(x).logits
    assert torch.allclose(kda(x).logits, want, rtol=1e-10, atol=1e-10)
    pos = torch.cat([torch.arange(11), torch.arange(19)])[None].expand(2, -1)  # packed documents
    packed = dict(position_ids=pos, use_cache=False)  # the training path: each document from a fresh state
    assert torch.allclose(kda(x, **packed).logits, gdn(x, **packed).logits, rtol=1e-10, atol=1e-10)
    perturb(kda)
    assert (kda(x).logits - want).abs().max() > 1e-3


def test_kda_correction_is_trained():
    """Gradients reach the correction (W_up at init, where W_down's is zero; both once W_up moved), and the
    distill stages' parameter selections — ``self_attn`` and the default — take its parameters."""
    teacher = tiny_model("llama").double()
    model = linearize.convert(teacher, to="kda", calibration_ids=calib(teacher), options=GDNOptions(window=4, sinks=2))
    x = ids(model, T=20)
    model(x).logits.square().mean().backward()
    first = corrections(model)[0]
    assert first.up.weight.grad.abs().max() > 0 and first.down.weight.grad.abs().max() == 0
    perturb(model)
    model.zero_grad()
    model(x).logits.square().mean().backward()
    assert all(c.up.weight.grad.abs().max() > 0 and c.down.weight.grad.abs().max() > 0 for c in corrections(model))
    new = {n for n, _ in model.named_parameters() if "channel_gate_proj" in n}
    assert len(new) == 2 * model.config.num_hidden_layers
    for trainable in ("self_attn", StageConfig().trainable):
        assert new <= set(trainable_names(model, StageConfig(trainable=trainable)))


@pytest.mark.parametrize("block", BLOCKS[:2], ids=["pure", "window"])
def test_kda_prefill_and_decode_equal_full_forward(block):
    """A left-padded batch: the prefill, then one token at a time through the fused steps' PyTorch bodies and
    through the composed ops, against the full forward of each row."""
    teacher = tiny_model("llama").double()
    model = linearize.convert(teacher, to="kda", calibration_ids=calib(teacher), options=GDNOptions(**block))
    perturb(model)
    x = ids(model, B=2, T=20)
    mask = torch.ones_like(x)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    keep = mask.bool()
    full = model(x, attention_mask=mask, position_ids=pos).logits
    fused, cache = incremental_logits(model, x, mask, pos, prefill=9)
    assert torch.allclose(fused[keep], full[keep], rtol=1e-9, atol=1e-9)
    for layer in model.model.layers:
        layer.self_attn.fused_step = False
    composed, _ = incremental_logits(model, x, mask, pos, prefill=9)
    assert torch.allclose(composed[keep], full[keep], rtol=1e-9, atol=1e-9)


def test_kda_saves_loads_and_generates(tmp_path):
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, to="kda", calibration_ids=calib(teacher), options=GDNOptions(window=4, sinks=2))
    perturb(model)
    model.save_pretrained(tmp_path / "m")
    back = linearize.load(tmp_path / "m")
    assert back.config.linearize["options"]["target"] == "kda"
    x = ids(model, B=1, T=12)
    assert torch.equal(back(x).logits, model(x).logits)
    kw = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=2)
    want = model.generate(x, do_sample=False, **kw)
    assert torch.equal(back.generate(x, do_sample=False, **kw), want)
    got = Decoder(back, graph=False).generate(x, **kw)  # linearize's decoder, eager; pads after the end of text
    assert torch.equal(got[:, : want.shape[1]], want) and (got[:, want.shape[1]:] == 0).all()


def test_kda_block_on_the_triton_kernels_equals_torch():
    """A converted kda model (channels decaying each their own way) on the interpreted kernels: logits, prefill +
    decode from the cache (the decode steps run the torch body), and every parameter's gradient."""
    from test_linear_ops import rel

    needs_interpreter()
    teacher = tiny_model("llama", num_hidden_layers=2)
    model = linearize.convert(teacher, to="kda", calibration_ids=calib(teacher), options=GDNOptions(window=4, sinks=2))
    perturb(model)
    x = ids(model, B=1, T=40)
    mask, pos = torch.ones_like(x), torch.arange(40)[None]

    def run(backend):
        for m in model.modules():
            if isinstance(m, GDNAttention):
                m.options.backend = backend
        model.zero_grad()
        logits = model(x).logits
        logits.square().mean().backward()
        return logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    want, want_grad = run("torch")
    got, got_grad = run("triton")
    assert rel(got, want) <= 1e-5 and rel(got_grad, want_grad) <= 1e-5, (rel(got, want), rel(got_grad, want_grad))
    with torch.no_grad():
        inc, _ = incremental_logits(model, x, mask, pos, prefill=36)
    assert rel(inc, want) <= 1e-5


def test_cli_convert_to_kda_and_recipe(tiny_dir, tmp_path):
    from test_cli import run

    out = tmp_path / "kda"
    code, text = run("convert", "--model", tiny_dir, "--output", out, "--to", "kda", "--tokens", 64,
                     "--calibration-tokens", 64, "--decay-rank", 4)
    assert code == 0, text
    options = json.loads((out / "config.json").read_text())["linearize"]["options"]
    assert options["target"] == "kda" and options["decay_rank"] == 4
    assert all(c.down.weight.shape[0] == 4 for c in corrections(linearize.load(out)))
    code, text = run("convert", "--model", tiny_dir, "--output", tmp_path / "bad", "--to", "kda", "--decay-rank", 0)
    assert code == 2 and "decay" in text and not (tmp_path / "bad").exists()
    report = json.loads((out / "fidelity.json").read_text())
    assert report["options"]["target"] == "kda" and all(r["block"] == "gdn" for r in report["layers"])
    code, text = run("generate", "--model", out, "-n", 4, "Hello")
    assert code == 0, text


def test_distill_kda_target_trains_and_saves(tiny_dir, tmp_path):
    """A recipe names the target (``convert.to: kda``): it trains the correction (finite losses, W_up moved off
    zero by the default parameter selection) and saves the kda block."""
    from test_distill import losses, overrides

    from linearize.distill import run_recipe

    cfg = load_recipe(None, overrides(tiny_dir, tmp_path / "o", **{"convert.to": "kda", "convert.window": 8,
                                                                  "convert.sinks": 2, "convert.decay_rank": 8,
                                                                  "stages.0.steps": 3}))
    assert cfg.convert.to == "kda" and cfg.convert.decay_rank == 8
    run_recipe(cfg)
    ls = losses(tmp_path / "o")
    assert len(ls) == 3 and all(math.isfinite(x) for x in ls)
    saved = json.loads((tmp_path / "o" / "model" / "config.json").read_text())
    assert saved["linearize"]["options"]["target"] == "kda" and saved["linearize"]["options"]["decay_rank"] == 8
    model = linearize.load(tmp_path / "o" / "model")
    assert all(c.up.weight.abs().max() > 0 for c in corrections(model))
