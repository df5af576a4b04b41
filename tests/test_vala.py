"""The linear target (VaLA, seed 000 eq. va-la): the converted block against the equation itself, written
out here as a naive float64 loop over the teacher's own q/k/v — prefill, decoding from the cache, padding,
packed rows — and the entry points that reach it (convert, CLI, recipe, save/load)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from conftest import tiny_model
from test_cli import assert_one_line_error, run
from test_convert import incremental_logits
from test_distill import losses, overrides

import linearize
from linearize.config import RecipeError, load_recipe
from linearize.distill import run_recipe
from linearize.layers import GDNAttention, GDNOptions
from linearize.layers.vala_attention import VaLAAttention
from linearize.models import project_qkv
from linearize.ops import vala_attention
from linearize.ops.vala import vala_attention_front

f64 = torch.float64
FAMILIES = ["llama", "qwen2", "qwen3", "gemma3_text"]


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def calib(model, T=48, seed=1):
    return torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


def ids(model, B=2, T=24, seed=2):
    return torch.randint(1, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def vala_naive(q, k, v, scale):
    """Eq. va-la for one sequence, token by token: ``o_t = v̄_t + ((1/t) Σ_{i≤t} v_i k_iᵀ − v̄_t k̄_tᵀ)(s·q_t)``
    with means over the first t tokens, each query head reading its KV head. q ``(T, Hq, D)``, k/v ``(T, H, D)``."""
    T, Hq, _ = q.shape
    H = k.shape[1]
    out = torch.empty(T, Hq, v.shape[-1], dtype=f64)
    for t in range(1, T + 1):
        ks, vs = k[:t].double(), v[:t].double()
        k_mean, v_mean = ks.mean(0), vs.mean(0)  # (H, D)
        M = torch.einsum("thv,thk->hvk", vs, ks) / t - torch.einsum("hv,hk->hvk", v_mean, k_mean)  # (H, V, K)
        for h in range(Hq):
            kv = h // (Hq // H)  # query heads h·G … h·G + G − 1 share KV head h
            out[t - 1, h] = v_mean[kv] + M[kv] @ (scale * q[t - 1, h].double())
    return out


def blocks(model):
    return [layer.self_attn for layer in model.model.layers if isinstance(layer.self_attn, GDNAttention)]


class Recorder:
    """Per converted block and call: the block's input (hidden states, RoPE cos/sin) and the attention output
    it hands to ``o_proj``, so the test can recompute that output from the teacher's own q/k/v."""

    def __init__(self, model):
        self.calls = {i: [] for i, _ in enumerate(blocks(model))}
        self.handles = []
        for i, blk in enumerate(blocks(model)):
            self.handles.append(blk.register_forward_pre_hook(self._input(i), with_kwargs=True))
            self.handles.append(blk.o_proj.register_forward_pre_hook(self._output(i)))

    def _input(self, i):
        def hook(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            self.calls[i].append({"h": h.detach(), "pe": kwargs["position_embeddings"]})
        return hook

    def _output(self, i):
        def hook(mod, args):
            self.calls[i][-1]["o"] = args[0].detach()
        return hook

    def joined(self, i):
        """``(hidden, (cos, sin), attention output)`` of block i over all its calls, along time."""
        c = self.calls[i]
        cat = lambda xs: torch.cat(xs, 1)  # noqa: E731
        return cat([x["h"] for x in c]), tuple(cat([x["pe"][j] for x in c]) for j in (0, 1)), cat([x["o"] for x in c])

    def close(self):
        for h in self.handles:
            h.remove()


def check_against_equation(model, rec, rows, tol=1e-10):
    """Every block's recorded output on the given ``{row: [(start, end), ...]}`` document spans equals the
    naive eq. va-la on the q/k/v the teacher's projections, norms and RoPE give for its recorded input."""
    for i, blk in enumerate(blocks(model)):
        h, pe, o = rec.joined(i)
        q, k, v = project_qkv(blk, h, pe)
        B, T = h.shape[:2]
        o = o.view(B, T, blk.num_heads, -1)
        for b, spans in rows.items():
            for s, e in spans:
                want = vala_naive(q[b, s:e], k[b, s:e], v[b, s:e], blk.scaling)
                assert rel(o[b, s:e].double(), want) <= tol, (i, b, s, e, rel(o[b, s:e].double(), want))


def test_vala_front_and_operator_equal_quadratic_vala():
    """The front + chunkwise operator equal the quadratic form of eq. va-la (ops.taylor.vala_attention),
    per document of a packed row too."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 150, 6, 16, generator=g, dtype=f64)
    k = torch.randn(1, 150, 2, 16, generator=g, dtype=f64) + 0.5
    v = torch.randn(1, 150, 2, 16, generator=g, dtype=f64)
    assert rel(vala_attention_front(q, k, v, scale=0.3), vala_attention(q, k, v, scale=0.3)) <= 1e-10
    cu = torch.tensor([0, 40, 41, 150])
    assert rel(vala_attention_front(q, k, v, scale=0.3, cu_seqlens=cu),
               vala_attention(q, k, v, scale=0.3, cu_seqlens=cu)) <= 1e-10
    want = vala_naive(q[0, 41:], k[0, 41:], v[0, 41:], 0.3)
    assert rel(vala_attention_front(q, k, v, scale=0.3, cu_seqlens=cu)[0, 41:], want) <= 1e-10


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_linear_block_equals_vala_equation(family):
    """At init every converted block computes eq. va-la on the teacher's own q/k/v (after RoPE and norms)."""
    teacher = tiny_model(family).double()
    model = linearize.convert(copy.deepcopy(teacher), to="linear", calibration_ids=calib(teacher))
    assert model.config.linearize["options"]["target"] == "linear"
    assert all(isinstance(b, VaLAAttention) for b in blocks(model)) and len(blocks(model)) == len(model.model.layers)
    rec = Recorder(model)
    model(ids(model, B=2, T=30))
    check_against_equation(model, rec, {0: [(0, 30)], 1: [(0, 30)]})


def test_convert_linear_new_parameters_and_teacher_weights():
    teacher = tiny_model("llama")
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    model = linearize.convert(teacher, to="linear", calibration_ids=calib(teacher))
    after = model.state_dict()
    assert all(torch.equal(after[n], w) for n, w in before.items())
    assert {n.split(".")[-2] + "." + n.split(".")[-1] for n in set(after) - set(before)} == {"gate_proj.weight",
                                                                                          "gate_proj.bias"}


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_convert_linear_decode_and_padding_equal_vala_equation(family):
    """Prefill, then one token at a time from the model's cache, with a left-padded row: every block's
    output on the real tokens is eq. va-la on those tokens alone, and the logits equal the full forward."""
    teacher = tiny_model(family).double()
    model = linearize.convert(teacher, to="linear", calibration_ids=calib(teacher))
    pad, T = 5, 20
    x = ids(model, B=2, T=T)
    x[1, :pad] = 0
    mask = torch.ones_like(x)
    mask[1, :pad] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    full = model(x, attention_mask=mask, position_ids=pos).logits
    rec = Recorder(model)
    inc, cache = incremental_logits(model, x, mask, pos, prefill=9)
    rec.close()
    assert len(rec.calls[0]) == 1 + T - 9
    check_against_equation(model, rec, {0: [(0, T)], 1: [(pad, T)]})
    assert rel(inc[1, pad:], full[1, pad:]) <= 1e-10 and rel(inc[0], full[0]) <= 1e-10
    assert rel(full[1, pad:], model(x[1:, pad:]).logits[0]) <= 1e-10  # padding leaks into nothing
    assert cache.get_seq_length() == T


def test_convert_linear_packed_rows_equal_vala_per_document():
    teacher = tiny_model("qwen3").double()
    model = linearize.convert(teacher, to="linear", calibration_ids=calib(teacher))
    x = ids(model, B=2, T=30)
    pos = torch.stack([torch.cat([torch.arange(11), torch.arange(19)]), torch.cat([torch.arange(4), torch.arange(26)])])
    rec = Recorder(model)
    model(x, position_ids=pos, use_cache=False)  # with a cache, each row continues as one sequence
    check_against_equation(model, rec, {0: [(0, 11), (11, 30)], 1: [(0, 4), (4, 30)]})


@pytest.mark.parametrize("extra", [dict(), dict(short_conv=3, output_gate=True)], ids=["pure", "conv-gate"])
def test_convert_linear_decay_correction_prefill_decode_and_backends(extra):
    """With a trained-looking decay correction (and the short convolution and output gate), the block is no
    longer the equation, but the chunkwise operator, the reference loop and token-by-token decoding agree,
    and the correction gets gradient."""
    teacher = tiny_model("llama").double()
    model = linearize.convert(teacher, to="linear", calibration_ids=calib(teacher), options=GDNOptions(**extra))
    x = ids(model, B=2, T=20)
    before = model(x).logits
    with torch.no_grad():
        for i, blk in enumerate(blocks(model)):
            blk.gate_proj.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(i))
            blk.gate_proj.bias.fill_(0.5)
    full = model(x).logits
    assert rel(full, before) > 1e-3  # the correction moves the output
    for blk in blocks(model):
        blk.options.backend = "reference"
    assert rel(model(x).logits, full) <= 1e-10
    for blk in blocks(model):
        blk.options.backend = "torch"
    mask, pos = torch.ones_like(x), torch.arange(20)[None].expand(2, -1)
    inc, _ = incremental_logits(model, x, mask, pos, prefill=7)
    assert rel(inc, full) <= 1e-10
    model(x).logits.square().mean().backward()
    assert all(b.gate_proj.weight.grad.abs().sum() > 0 for b in blocks(model))


def test_convert_linear_float32_close_to_float64():
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, to="linear", calibration_ids=calib(teacher))
    x = ids(model, B=2, T=70)
    out = model(x).logits
    assert rel(out.double(), copy.deepcopy(model).double()(x).logits) <= 1e-5


def test_convert_linear_saves_loads_and_generates(tmp_path):
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, to="linear", calibration_ids=calib(teacher))
    with torch.no_grad():
        blocks(model)[1].gate_proj.bias.fill_(0.25)  # a trained value must survive the round trip
    x = ids(model, B=2, T=16)
    ref = model(x).logits
    linearize.save(model, None, tmp_path / "m")
    back = linearize.load(tmp_path / "m")
    assert back.config.linearize["options"]["target"] == "linear"
    assert all(isinstance(b, VaLAAttention) for b in blocks(back))
    assert torch.equal(back(x).logits, ref)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(back.generate(x[:1], **kw), model.generate(x[:1], **kw))


def test_linear_target_refuses_a_window_at_convert_time():
    teacher = tiny_model("llama")
    with pytest.raises(ValueError, match=r"window must be 0 for the linear target .* set window=0 and sinks=0"):
        linearize.convert(teacher, to="linear", calibration_ids=calib(teacher), options=GDNOptions(window=4, sinks=2))
    with pytest.raises(ValueError, match="form must be 'stable' for the linear target"):
        GDNOptions(target="linear", form="seed")


def test_cli_convert_linear_window_is_one_clear_error(tmp_path):
    assert_one_line_error(*run("convert", "--to", "linear", "--window", "64", "-o", tmp_path / "o"),
                          "--window must be 0 for the linear target")


def test_cli_convert_to_linear_and_generate(tiny_dir, tmp_path):
    out = tmp_path / "vala"
    code, text = run("convert", "--model", tiny_dir, "--output", out, "--to", "linear", "--tokens", 64,
                     "--calibration-tokens", 64)
    assert code == 0, text
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["linearize"]["options"]["target"] == "linear" and cfg["linearize"]["options"]["window"] == 0
    report = json.loads((out / "fidelity.json").read_text())
    for r in report["layers"]:  # at init the converted block is VaLA: the report's two columns agree
        assert abs(r["converted"] - r["vala"]) <= 1e-4 * r["vala"], r
    code, text = run("generate", "--model", out, "-n", 4, "Hello")
    assert code == 0, text


def test_recipe_convert_to_linear():
    cfg = load_recipe(None, ["convert.to=linear"])
    assert cfg.convert.to == "linear"
    with pytest.raises(RecipeError, match=r"convert.window must be 0 with convert.to: linear"):
        load_recipe(None, ["convert.to=linear", "convert.window=64", "convert.sinks=4"])


def test_distill_linear_target_trains_and_saves(tiny_dir, tmp_path):
    """A recipe with convert.to: linear trains (finite align losses) and saves the VaLA block."""
    cfg = load_recipe(None, overrides(tiny_dir, tmp_path / "o", **{"convert.to": "linear", "stages.0.steps": 4}))
    run_recipe(cfg)
    ls = losses(tmp_path / "o")
    assert len(ls) == 4 and all(math.isfinite(x) for x in ls)
    saved = json.loads((tmp_path / "o" / "model" / "config.json").read_text())
    assert saved["linearize"]["options"]["target"] == "linear"
    assert all(isinstance(b, VaLAAttention) for b in blocks(linearize.load(tmp_path / "o" / "model")))


def test_convert_linear_calibration_steps_fit_the_decay_correction():
    """calibration_steps fits the one new parameter (gate_proj) and never worsens a layer on the calibration rows."""
    from linearize.eval import capture_attention, relative_error

    teacher = tiny_model("llama")
    c = calib(teacher, T=64)
    caps = capture_attention(teacher, c)
    model = linearize.convert(copy.deepcopy(teacher), to="linear", calibration_ids=c, calibration_steps=5)
    moved = 0
    for i, blk in enumerate(blocks(model)):
        moved += int(blk.gate_proj.weight.abs().sum() > 0)
        err = relative_error(blk.attention_output(caps[i].hidden_states, caps[i].position_embeddings), caps[i].output)
        base = relative_error(vala_attention(*project_qkv(blk, caps[i].hidden_states, caps[i].position_embeddings),
                                             scale=blk.scaling).flatten(2), caps[i].output)
        assert err <= base + 1e-6, (i, err, base)
    assert moved >= 1  # a layer where no step improved keeps its initialization
