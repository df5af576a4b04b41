"""linearize.convert / linearize_layer / save / load on tiny models of every family and on SmolLM2."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_model
from test_ops import taylor_direct
from transformers import AutoModelForCausalLM, DynamicCache

import linearize
from linearize.compat import cache_kwargs
from linearize.eval import capture_attention, text_ids
from linearize.layers import GDNAttention
from linearize.models import project_qkv
from linearize.ops import softmax_attention

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"]


def calib(model, T=48, seed=1):
    return torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


def ids(model, B=2, T=24, seed=2):
    return torch.randint(1, model.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_keeps_every_non_attention_weight_bit_identical(family):
    teacher = tiny_model(family)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    model = linearize.convert(teacher, to="gdn", calibration_ids=calib(teacher))
    after = model.state_dict()
    for name, value in before.items():
        assert name in after, name
        assert after[name].shape == value.shape and torch.equal(after[name], value), name
    new = set(after) - set(before)
    assert new and all(any(s in n for s in ("rho", "gate_proj", "beta_proj")) for n in new)
    assert all(isinstance(layer.self_attn, GDNAttention) for layer in model.model.layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_block_equals_taylor_equations(family):
    """At init every GDN block computes the stable Taylor form of SPEC §2 on the teacher's activations."""
    teacher = tiny_model(family)
    x = ids(teacher, B=1, T=30)
    caps = capture_attention(teacher, x)
    # our softmax on the extracted q/k/v reproduces the teacher: the extraction (norms, RoPE, biases) is right
    for i, cap in caps.items():
        attn = teacher.model.layers[i].self_attn
        q, k, v = (t.double() for t in project_qkv(attn, cap.hidden_states, cap.position_embeddings))
        if getattr(attn, "sliding_window", None) is None:
            ref = softmax_attention(q, k, v, scale=attn.scaling).flatten(2)
            assert (ref - cap.output).norm() / cap.output.norm() < 1e-5
    model = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib(teacher))
    for i, cap in caps.items():
        gdn = model.model.layers[i].self_attn
        q, k, v = (t.double() for t in project_qkv(gdn, cap.hidden_states, cap.position_embeddings))
        ref = taylor_direct(q, k, v, gdn.scaling, "stable", rho=gdn.rho.double(), beta_max=gdn.options.beta_max)
        out = gdn.attention_output(cap.hidden_states, cap.position_embeddings)
        assert ((out.double() - ref.flatten(2)).norm() / ref.norm()).item() < 1e-5


def test_gdn_block_fused_front_equals_pytorch_front():
    """GDNOptions(fused_front=True): the block's output on packed positions and the gradients of its
    parameters (q/k/v projections, ρ, gate, β correction) equal those of the PyTorch front."""
    from linearize.layers import GDNOptions

    teacher = tiny_model("llama")
    x = ids(teacher, B=2, T=40)
    pos = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)  # two documents per row
    caps = capture_attention(teacher, x, [0], position_ids=pos)
    results = []
    for fused in (False, True):
        model = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib(teacher),
                                  options=GDNOptions(fused_front=fused))
        gdn = model.model.layers[0].self_attn
        with torch.no_grad():  # trained-looking corrections, so every path carries gradient
            gdn.beta_proj.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
            gdn.gate_proj.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        out = gdn.attention_output(caps[0].hidden_states, caps[0].position_embeddings, pos)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in gdn.named_parameters() if p.grad is not None}))
    (ref, ref_g), (got, got_g) = results
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    assert ref_g.keys() == got_g.keys() and {"rho", "gate_proj.weight", "beta_proj.weight", "k_proj.weight"} <= ref_g.keys()
    for n in ref_g:
        assert ((got_g[n] - ref_g[n]).norm() / ref_g[n].norm()).item() < 1e-4, n


def test_gdn_block_fused_front_in_half_precision():
    """A half-precision block on the fused path (q, k̂ and u stay fp16: the front's kernels compute in float32
    inside, the operator applies the softmax scale) against the float32 block: output and ρ's gradient are
    as close as those of the fp16 block on the PyTorch front (float32 front, cast for the operator)."""
    from linearize.layers import GDNOptions

    teacher = tiny_model("llama")
    x = ids(teacher, B=2, T=40)
    pos = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
    cap = capture_attention(teacher, x, [0], position_ids=pos)[0]
    model = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib(teacher), options=GDNOptions(fused_front=False))
    base = model.model.layers[0].self_attn
    with torch.no_grad():
        base.beta_proj.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    w = torch.randn(cap.output.shape, generator=torch.Generator().manual_seed(3))
    runs = {}
    for name, dtype, fused in (("ref", torch.float32, False), ("torch", torch.float16, False), ("fused", torch.float16, True)):
        gdn = copy.deepcopy(base).to(dtype)
        gdn.options = GDNOptions(fused_front=fused)
        out = gdn.attention_output(cap.hidden_states.to(dtype), tuple(t.to(dtype) for t in cap.position_embeddings), pos)
        assert out.dtype == dtype
        (out.float() * w).sum().backward()
        runs[name] = (out.detach().float(), gdn.rho.grad.float(), gdn.k_proj.weight.grad.float(), gdn.q_proj.weight.grad.float())
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(runs["fused"][0], runs["ref"][0]) < 1e-2
    for i, what in enumerate(("output", "drho", "dk_proj", "dq_proj")):
        err_fused, err_torch = rel(runs["fused"][i], runs["ref"][i]), rel(runs["torch"][i], runs["ref"][i])
        assert err_fused < 2 * err_torch + 1e-3, (what, err_fused, err_torch)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_save_load_round_trip(tmp_path, family):
    model = linearize.convert(tiny_model(family), calibration_ids=calib(tiny_model(family)))
    x = ids(model)
    ref = model(x).logits
    linearize.save(model, None, tmp_path / "out")
    cfg = (tmp_path / "out" / "config.json").read_text()
    assert '"linearize"' in cfg and f'"linearize_{family}"' in cfg
    for loaded in (AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), linearize.load(tmp_path / "out")):
        assert torch.equal(loaded(x).logits, ref)


def incremental_logits(model, x, mask, position_ids, prefill):
    cache = DynamicCache(config=model.config)
    kw = cache_kwargs(cache)  # this transformers version's name for the cache keyword
    outs = [model(x[:, :prefill], attention_mask=mask[:, :prefill], position_ids=position_ids[:, :prefill],
                  use_cache=True, **kw).logits]
    for t in range(prefill, x.shape[1]):
        outs.append(model(x[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=position_ids[:, t : t + 1],
                          use_cache=True, **kw).logits)
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("keep", [None, [1]])
def test_convert_prefill_and_decode_equal_full_forward(family, keep):
    teacher = tiny_model(family)
    model = linearize.convert(teacher, calibration_ids=calib(teacher), keep_softmax=keep)
    x = ids(model, B=2, T=20)
    mask = torch.ones_like(x)
    pos = torch.arange(20)[None].expand(2, -1)
    full = model(x, attention_mask=mask).logits
    inc, cache = incremental_logits(model, x, mask, pos, prefill=13)
    assert (inc - full).abs().max() < 1e-4
    assert cache.get_seq_length() == 20


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_convert_left_padding_matches_unpadded(family):
    teacher = tiny_model(family)
    model = linearize.convert(teacher, calibration_ids=calib(teacher))
    a, b = ids(model, B=1, T=18, seed=5), ids(model, B=1, T=12, seed=6)
    pad = 6
    x = torch.cat([a, torch.cat([torch.zeros(1, pad, dtype=torch.long), b], 1)])
    mask = torch.ones_like(x)
    mask[1, :pad] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    full_b = model(b).logits
    padded = model(x, attention_mask=mask, position_ids=pos).logits
    assert (padded[1, pad:] - full_b[0]).abs().max() < 1e-4
    assert (padded[0] - model(a).logits[0]).abs().max() < 1e-4
    inc, _ = incremental_logits(model, x, mask, pos, prefill=10)
    assert (inc[1, pad:] - full_b[0]).abs().max() < 1e-4


def test_convert_generate_left_padded_batch_equals_single_rows():
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=calib(teacher))
    a, b = ids(model, B=1, T=10, seed=7), ids(model, B=1, T=6, seed=8)
    x = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], 1)])
    mask = torch.ones_like(x)
    mask[1, :4] = 0
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    batch = model.generate(x, attention_mask=mask, **kw)
    assert torch.equal(batch[0, 10:], model.generate(a, **kw)[0, 10:])
    assert torch.equal(batch[1, 10:], model.generate(b, **kw)[0, 6:])


def test_convert_keep_softmax_count_keeps_worst_layers():
    from linearize.eval import relative_error

    teacher = tiny_model("llama", num_hidden_layers=5)
    c = calib(teacher)
    caps = capture_attention(teacher, c)
    errs = {}
    for i, cap in caps.items():
        gdn = linearize.linearize_layer(teacher.model.layers[i].self_attn, None, cap.hidden_states, cap.position_embeddings)
        errs[i] = relative_error(gdn.attention_output(cap.hidden_states, cap.position_embeddings), cap.output)
    worst = sorted(sorted(errs, key=lambda i: -errs[i])[:2])
    model = linearize.convert(teacher, calibration_ids=c, keep_softmax=2)
    assert model.config.linearize["softmax_layers"] == worst
    kinds = [isinstance(layer.self_attn, GDNAttention) for layer in model.model.layers]
    assert [i for i, k in enumerate(kinds) if not k] == worst


def test_convert_layers_option_and_errors():
    teacher = tiny_model("llama", num_hidden_layers=5)
    model = linearize.convert(teacher, calibration_ids=calib(teacher), layers="1-2,4")
    assert model.config.linearize["gdn_layers"] == [1, 2, 4]
    with pytest.raises(ValueError, match="out of range"):
        linearize.convert(tiny_model("llama"), calibration_ids=calib(teacher), layers="0-9")
    with pytest.raises(ValueError, match=r"the range '1-0' is empty"):
        linearize.convert(tiny_model("llama"), calibration_ids=calib(teacher), layers="1-0")
    from linearize.conversion import parse_layers

    assert parse_layers("3-", 5) == [3, 4] and parse_layers("0-1,3", 5) == [0, 1, 3]
    with pytest.raises(ValueError, match="not supported"):
        linearize.convert(tiny_model("llama"), to="mamba", calibration_ids=calib(teacher))
    with pytest.raises(ValueError, match="calibration"):
        linearize.convert(tiny_model("llama"))


def test_convert_unsupported_architecture_lists_supported():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="not supported; supported: llama, mistral, qwen2, qwen3, gemma3_text"):
        linearize.convert(model, calibration_ids=torch.ones(1, 8, dtype=torch.long))


def test_linearize_layer_converts_one_module():
    teacher = tiny_model("qwen3")
    attn = teacher.model.layers[2].self_attn
    gdn = linearize.linearize_layer(attn)
    assert gdn.q_proj is attn.q_proj and gdn.q_norm is attn.q_norm
    teacher.model.layers[2].self_attn = gdn
    assert torch.isfinite(teacher(ids(teacher)).logits).all()


@pytest.mark.parametrize("teacher_name, layers", [("smollm2", [0, 15, 29]), ("gemma3", [0, 5, 17])])
def test_convert_real_teacher_block_equals_equations(request, teacher_name, layers):
    """Real GGUF teachers (SmolLM2-135M: Llama; Gemma 3 270M: q/k norms, head_dim 256, one KV head,
    layer 5 global, the others sliding-window): the converted block at init vs the seed's equations."""
    teacher, tok = request.getfixturevalue(teacher_name)
    x = text_ids(tok, 64)  # shorter than Gemma's 512-token window: sliding and global layers agree
    caps = capture_attention(teacher, x, layers)
    for i in layers:
        attn = teacher.model.layers[i].self_attn
        q, k, v = (t.double() for t in project_qkv(attn, caps[i].hidden_states, caps[i].position_embeddings))
        sm = softmax_attention(q, k, v, scale=attn.scaling).flatten(2)
        assert (sm - caps[i].output).norm() / caps[i].output.norm() < 1e-5
        gdn = linearize.linearize_layer(attn, None, caps[i].hidden_states, caps[i].position_embeddings)
        ref = taylor_direct(q, k, v, gdn.scaling, "stable", rho=gdn.rho.double(), beta_max=gdn.options.beta_max)
        out = gdn.attention_output(caps[i].hidden_states, caps[i].position_embeddings)
        assert ((out.double() - ref.flatten(2)).norm() / ref.norm()).item() < 1e-5


def test_convert_gemma3_real_teacher_end_to_end(gemma3):
    """Whole Gemma 3 270M converted: every non-attention weight untouched, decoding equals the full forward."""
    teacher, tok = gemma3
    model = copy.deepcopy(teacher)
    before = {k: v.clone() for k, v in model.state_dict().items() if ".self_attn." not in k}
    model = linearize.convert(model, tokenizer=tok, calibration_tokens=128, keep_softmax=[5])
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert model.config.linearize["softmax_layers"] == [5]
    x = text_ids(tok, 24)
    full = model(x).logits
    inc, _ = incremental_logits(model, x, torch.ones_like(x), torch.arange(24)[None], prefill=16)
    assert (inc - full).abs().max() / full.abs().max() < 1e-4


def test_convert_state_lives_in_transformers_linear_attention_cache_layer():
    """Each GDN layer's decoding state is a transformers LinearAttentionLayer in the model's Cache: beam
    reordering permutes it (the next step equals the step after a prefill of the permuted batch), and
    reset empties it."""
    from transformers.cache_utils import LinearAttentionLayer

    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=calib(teacher), keep_softmax=[1])
    x = ids(model, B=3, T=9)
    perm = torch.tensor([2, 0, 1])

    def prefill(inp):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(inp[:, :-1], use_cache=True, **cache_kwargs(cache))
        return cache

    reordered, direct = prefill(x), prefill(x[perm])
    assert [isinstance(layer, LinearAttentionLayer) for layer in reordered.layers] == [True, False, True, True]
    reordered.reorder_cache(perm)
    with torch.no_grad():
        a = model(x[perm, -1:], use_cache=True, **cache_kwargs(reordered)).logits
        b = model(x[perm, -1:], use_cache=True, **cache_kwargs(direct)).logits
    assert (a - b).abs().max() < 1e-5 and reordered.get_seq_length() == 9
    reordered.reset()
    assert reordered.get_seq_length() == 0 and reordered.layers[0].state is None and reordered.layers[0].sums is None


def test_linearize_layer_refuses_projection_shapes_it_cannot_reuse():
    teacher = tiny_model("llama")
    attn = teacher.model.layers[0].self_attn
    attn.v_proj = torch.nn.Linear(attn.v_proj.in_features, attn.v_proj.out_features + attn.head_dim, bias=False)
    with pytest.raises(ValueError, match="v_proj.out_features is 48, expected 32"):
        linearize.linearize_layer(attn)


def test_convert_surgery_guard_names_the_changed_parameter():
    from linearize.conversion import check_surgery

    model = tiny_model("llama")
    before = {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()}
    check_surgery(before, before)  # unchanged: passes
    name = "model.layers.0.mlp.up_proj.weight"
    for after, what in (({**before, name: (before[name][0], torch.Size([1]))}, "changed the shape"),
                        ({**before, name: (before[name][0] + 4, before[name][1])}, "replaced the tensor"),
                        ({n: v for n, v in before.items() if n != name}, "dropped"),
                        ({**before, "model.layers.0.mlp.extra": (0, torch.Size([1]))}, "unexpected parameter")):
        with pytest.raises(RuntimeError, match=what):
            check_surgery(before, after)


def test_import_linearize_is_cheap_and_registers_on_first_use(tmp_path):
    """``import linearize`` loads neither torch nor transformers; the first API access registers the
    converted classes, so from_pretrained knows a converted directory's model_type."""
    import subprocess
    import sys

    linearize.save(linearize.convert(tiny_model("qwen3"), calibration_ids=calib(tiny_model("qwen3"))), None, tmp_path / "m")
    code = (
        "import sys, linearize\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'import linearize is not lazy'\n"
        "from transformers import AutoModelForCausalLM\n"
        "try:\n"
        f"    AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r})\n"
        "    raise SystemExit('known before registration')\n"
        "except ValueError:\n"
        "    pass\n"
        "linearize.convert  # first access of the API\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'm')!r})\n"
        "print(type(m).__name__, type(m.model.layers[0].self_attn).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["LinearizedQwen3ForCausalLM", "GDNAttention"]
