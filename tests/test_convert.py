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


def test_convert_layers_global_converts_only_full_attention_layers():
    """Gemma 3's sliding-window layers keep a cache of fixed size already; "global" converts the others."""
    teacher = tiny_model("gemma3_text")  # layer_types: five sliding, then one full
    x = ids(teacher)
    with torch.no_grad():
        want = teacher(x, output_hidden_states=True).hidden_states
    model = linearize.convert(tiny_model("gemma3_text"), calibration_ids=calib(teacher), layers="global")
    assert model.config.linearize["gdn_layers"] == [5]
    assert [isinstance(layer.self_attn, GDNAttention) for layer in model.model.layers] == [False] * 5 + [True]
    with torch.no_grad():
        got = model(x, output_hidden_states=True).hidden_states
    for i in range(6):  # the embeddings and the output of every sliding layer: the teacher's
        torch.testing.assert_close(got[i], want[i])
    assert not torch.allclose(got[6], want[6])
    every = linearize.convert(tiny_model("llama"), calibration_ids=calib(teacher), layers="global")
    assert every.config.linearize["gdn_layers"] == [0, 1, 2, 3]  # no sliding windows: every layer is global
    from linearize.config import RecipeError, check_conversion

    for keep in ("1", "5,"):  # keeping the one global layer leaves nothing to convert: the CLI and recipes refuse
        with pytest.raises(RecipeError, match="nothing would be converted"):
            check_conversion("global", keep, 6, config=teacher.config)
    check_conversion("global", "0", 6, config=teacher.config)
    with pytest.raises(RecipeError, match="every layer of this model attends over a sliding window"):
        check_conversion("global", None, 4, config=tiny_model("mistral", sliding_window=16).config)
    with pytest.raises(ValueError, match="every layer of this model attends over a sliding window"):
        linearize.convert(tiny_model("mistral", sliding_window=16), calibration_ids=calib(teacher), layers="global")


def test_convert_layers_global_generates_as_its_forward():
    """Gemma 3 with its global layer converted decodes through its cache (sliding layers and the GDN state
    side by side) to the tokens its full forward picks."""
    from linearize.layers import GDNOptions

    teacher = tiny_model("gemma3_text")
    model = linearize.convert(teacher, calibration_ids=calib(teacher), layers="global",
                              options=GDNOptions(window=4, sinks=1))
    x = ids(model, B=1, T=20)  # longer than the sliding layers' window of 8 and the block's 4 + 1
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    out = model.generate(x, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    seq = x
    for _ in range(12):
        with torch.no_grad():
            logits = model(seq).logits[:, -1]
        logits[:, eos] = float("-inf")  # what min_new_tokens does
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


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


# --- GDNOptions(short_conv=K): a learnable causal depthwise convolution on q, k, v ---------------------------


def random_convs(model_or_block, seed=0, scale=0.4):
    """Trained-looking short-convolution taps on every GDN block: identity plus noise."""
    blocks = [model_or_block] if isinstance(model_or_block, GDNAttention) else [
        m for m in model_or_block.modules() if isinstance(m, GDNAttention)]
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in blocks:
            for name in ("q_conv", "k_conv", "v_conv"):
                w = getattr(b, name)
                w.add_(torch.randn(w.shape, generator=gen) * scale)


def conv_by_loops(x, w):
    """Reference causal depthwise convolution of ONE document: x (L, C), w (C, K), explicit loops."""
    L, C = x.shape
    K = w.shape[1]
    y = torch.zeros_like(x)
    for t in range(L):
        for j in range(K):
            src = t - (K - 1) + j
            if src >= 0:
                y[t] += w[:, j] * x[src]
    return y


def block_reference(gdn, h, cos, sin, split_docs=True, docs=((0, 15), (15, 40))):
    """The block with short_conv on one packed row, independently: per document, the projections, the
    convolution by loops, the norms, RoPE, then the Taylor equations (float64). ``split_docs=False``
    convolves the whole row (a convolution that crosses the document start), for the test's power."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    d = gdn.head_dim
    raw = [lin(h).double() for lin in (gdn.q_proj, gdn.k_proj, gdn.v_proj)]  # (T, C) each
    convs = [getattr(gdn, n).double() for n in ("q_conv", "k_conv", "v_conv")]
    if not split_docs:
        raw = [conv_by_loops(x, w) for x, w in zip(raw, convs)]
    outs = []
    for a, e in docs:
        q, k, v = (x[a:e] if not split_docs else conv_by_loops(x[a:e], w) for x, w in zip(raw, convs))
        q, k, v = (x.view(1, e - a, -1, d) for x in (q, k, v))
        if getattr(gdn, "q_norm", None) is not None:
            q, k = gdn.q_norm.double()(q), gdn.k_norm.double()(k)
        q, k = apply_rotary_pos_emb(q, k, cos[None, a:e].double(), sin[None, a:e].double(), unsqueeze_dim=2)
        outs.append(taylor_direct(q, k, v, gdn.scaling, "stable", rho=gdn.rho.double(), beta_max=gdn.options.beta_max))
    return torch.cat(outs, 1).flatten(2)[0]  # (T, Hq·D)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_convert_short_conv_is_the_identity_at_init(family):
    """short_conv=4 at init: the same model as without it, packed documents and decoding included."""
    from linearize.layers import GDNOptions

    teacher = tiny_model(family)
    plain = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib(teacher))
    conv = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib(teacher), options=GDNOptions(short_conv=4))
    assert all(getattr(m, "q_conv", None) is not None for m in conv.modules() if isinstance(m, GDNAttention))
    assert torch.equal(plain.model.layers[0].self_attn.rho, conv.model.layers[0].self_attn.rho)
    x = ids(teacher, B=2, T=40)
    pos = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
    with torch.no_grad():
        assert (plain(x, position_ids=pos).logits - conv(x, position_ids=pos).logits).abs().max() < 1e-6
        mask, p = torch.ones_like(x), torch.arange(40)[None].expand(2, -1)
        a, _ = incremental_logits(plain, x, mask, p, prefill=30)
        b, _ = incremental_logits(conv, x, mask, p, prefill=30)
    assert (a - b).abs().max() < 1e-6


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gdn_block_short_conv_equals_reference_per_document(family):
    """Random taps, a packed batch (two documents per row): the block equals the per-document reference
    (convolution by loops inside each document, then the Taylor equations); a convolution that crossed
    the document start would be far from it."""
    from linearize.layers import GDNOptions

    teacher = tiny_model(family)
    x = ids(teacher, B=2, T=40)
    pos = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
    cap = capture_attention(teacher, x, [1], position_ids=pos)[1]
    gdn = linearize.linearize_layer(teacher.model.layers[1].self_attn, GDNOptions(short_conv=4),
                                    cap.hidden_states, cap.position_embeddings)
    random_convs(gdn)
    out = gdn.attention_output(cap.hidden_states, cap.position_embeddings, pos).detach().double()
    cos, sin = (t.expand(2, -1, -1) for t in cap.position_embeddings)
    for b in range(2):
        ref = block_reference(gdn, cap.hidden_states[b], cos[b], sin[b])
        crossing = block_reference(gdn, cap.hidden_states[b], cos[b], sin[b], split_docs=False)
        assert ((out[b] - ref).norm() / ref.norm()).item() < 1e-5
        assert ((out[b] - crossing).norm() / ref.norm()).item() > 1e-3  # the test can see a crossing


@pytest.mark.parametrize("keep", [None, [1]])
@pytest.mark.parametrize("prefill", [2, 13])
def test_convert_short_conv_prefill_and_decode_equal_full_forward(keep, prefill):
    """Random taps: prefill (shorter or longer than the kernel) then token-by-token decoding equals the
    full forward; the cache keeps the last K-1 inputs; beam reordering permutes them; reset empties them."""
    from linearize.layers import GDNOptions

    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=calib(teacher), keep_softmax=keep, options=GDNOptions(short_conv=4))
    random_convs(model)
    x = ids(model, B=2, T=20)
    mask = torch.ones_like(x)
    pos = torch.arange(20)[None].expand(2, -1)
    with torch.no_grad():
        full = model(x, attention_mask=mask).logits
        inc, cache = incremental_logits(model, x, mask, pos, prefill=prefill)
    assert (inc - full).abs().max() < 1e-4
    layer = cache.layers[0]
    assert [t.shape for t in layer.conv_inputs] == [(2, 3, 64), (2, 3, 32), (2, 3, 32)]
    with torch.no_grad():  # layer 0's last three v_proj inputs
        v = model.model.layers[0].self_attn.v_proj(model.model.layers[0].input_layernorm(model.model.embed_tokens(x[:, -3:])))
    assert torch.allclose(layer.conv_inputs[2], v, atol=1e-6)
    perm = torch.tensor([1, 0])
    before = layer.conv_inputs[0].clone()
    cache.reorder_cache(perm)
    assert torch.equal(layer.conv_inputs[0], before[perm])
    cache.reset()
    assert layer.conv_inputs is None and cache.get_seq_length() == 0


def test_convert_short_conv_left_padding_matches_unpadded():
    """Random taps: a left-padded row equals the row alone, in the full forward and while decoding (no
    tap reads the padding)."""
    from linearize.layers import GDNOptions

    teacher = tiny_model("llama")
    model = linearize.convert(teacher, calibration_ids=calib(teacher), options=GDNOptions(short_conv=3))
    random_convs(model)
    a, b = ids(model, B=1, T=18, seed=5), ids(model, B=1, T=12, seed=6)
    pad = 6
    x = torch.cat([a, torch.cat([torch.full((1, pad), 7, dtype=torch.long), b], 1)])
    mask = torch.ones_like(x)
    mask[1, :pad] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full_b, full_a = model(b).logits, model(a).logits
        padded = model(x, attention_mask=mask, position_ids=pos).logits
        inc, _ = incremental_logits(model, x, mask, pos, prefill=8)
    assert (padded[1, pad:] - full_b[0]).abs().max() < 1e-4
    assert (padded[0] - full_a[0]).abs().max() < 1e-4
    assert (inc[1, pad:] - full_b[0]).abs().max() < 1e-4


def test_convert_short_conv_save_load_round_trip(tmp_path):
    from linearize.layers import GDNOptions

    teacher = tiny_model("qwen3")
    model = linearize.convert(teacher, calibration_ids=calib(teacher), options=GDNOptions(short_conv=5))
    random_convs(model)
    x = ids(model)
    ref = model(x).logits
    linearize.save(model, None, tmp_path / "out")
    for loaded in (AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), linearize.load(tmp_path / "out")):
        assert loaded.config.linearize["options"]["short_conv"] == 5
        got = loaded.model.layers[2].self_attn
        assert got.options.short_conv == 5
        assert torch.equal(got.k_conv, model.model.layers[2].self_attn.k_conv)
        assert torch.equal(loaded(x).logits, ref)


def test_gdn_block_short_conv_gradients():
    """The convolution's gradient: gradcheck (float64) across a document start and a cached past, and
    through the block every tap of q_conv, k_conv and v_conv gets a gradient."""
    from linearize.layers import GDNOptions
    from linearize.layers.short_conv import causal_conv, since_document_start

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    past = torch.randn(2, 3, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    since = since_document_start(torch.tensor([0, 4, 9]), 9).expand(2, -1)
    assert since[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]
    assert torch.autograd.gradcheck(lambda x, w: causal_conv(x, w, since)[0], (x, w))
    assert torch.autograd.gradcheck(lambda x, w, p: causal_conv(x, w, None, p)[0], (x, w, past))

    teacher = tiny_model("llama")
    x = ids(teacher, B=2, T=40)
    pos = torch.cat([torch.arange(15), torch.arange(25)]).repeat(2, 1)
    cap = capture_attention(teacher, x, [0], position_ids=pos)[0]
    gdn = linearize.linearize_layer(teacher.model.layers[0].self_attn, GDNOptions(short_conv=4))
    out = gdn.attention_output(cap.hidden_states, cap.position_embeddings, pos)
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    for name in ("q_conv", "k_conv", "v_conv"):
        g = getattr(gdn, name).grad
        assert g is not None and torch.isfinite(g).all() and (g.abs().sum(0) > 0).all(), name


def test_gdn_options_short_conv_checked_and_off_the_fused_path():
    from linearize.layers import GDNOptions, fused_path

    for bad in (1, 9, -2, 2.5, True):
        with pytest.raises(ValueError, match="short_conv must be 0 .off. or a kernel size from 2 to 8"):
            GDNOptions(short_conv=bad)
    h = torch.zeros(1, 4, 8)
    assert fused_path(GDNOptions(fused_front=True), h) or not linearize.ops._triton_usable(h)
    assert not fused_path(GDNOptions(fused_front=True, short_conv=4), h)


def test_token_mask_reads_padding_and_additive_masks():
    from linearize.layers.gdn_attention import token_mask

    pad = torch.tensor([[0, 1, 1], [1, 1, 1]])  # a user's padding mask: 1 = token
    want = pad.bool()
    assert torch.equal(token_mask(pad, 2, 3), want)
    assert torch.equal(token_mask(pad.bool(), 2, 3), want)
    additive = torch.zeros(2, 1, 3, 3)  # 0 = attend; the diagonal says whether a token sees itself
    additive[0, 0, 0, 0] = float("-inf")
    assert torch.equal(token_mask(additive, 2, 3), want)
    assert token_mask(torch.ones(2, 3, dtype=torch.long), 2, 3) is None  # no padding: no mask


def test_token_mask_is_read_once_for_one_mask_and_again_when_it_changes():
    """The layers of one forward pass the same mask: it is read once (the same tensor comes back), read again
    when written in place or for another shape, and one read under inference mode is not handed to a forward
    that trains (an inference tensor cannot be saved for the backward)."""
    from linearize.layers.gdn_attention import token_mask

    pad = torch.tensor([[0, 1, 1], [1, 1, 1]])
    first = token_mask(pad, 2, 3)
    assert token_mask(pad, 2, 3) is first
    pad[1, 0] = 0  # in place
    assert torch.equal(token_mask(pad, 2, 3), torch.tensor([[False, True, True], [False, True, True]]))
    assert token_mask(pad, 2, 2) is None  # the last two columns: no padding
    with torch.inference_mode():
        assert token_mask(pad, 2, 3).is_inference()
    assert not token_mask(pad, 2, 3).is_inference()


@pytest.mark.parametrize("options", [dict(), dict(window=4, sinks=2, output_gate=True)], ids=["pure", "window-gate"])
def test_calibration_steps_fit_the_new_parameters_and_leave_the_teachers(options):
    """convert(calibration_steps=N) lowers each block's error against the teacher on the calibration rows,
    trains only the block's own parameters, and leaves every teacher weight bit for bit."""
    from linearize.calibration import NEW_PARAMETERS, fit_block
    from linearize.eval import relative_error
    from linearize.layers.options import GDNOptions

    teacher = tiny_model("llama")
    with torch.no_grad():  # sharper attention than random weights give: something for the fit to fix
        for layer in teacher.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
    weights = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    c = calib(teacher, T=64)
    caps = capture_attention(teacher, c)
    base = linearize.convert(copy.deepcopy(teacher), calibration_ids=c, options=GDNOptions(**options))
    fitted = linearize.convert(copy.deepcopy(teacher), calibration_ids=c, options=GDNOptions(**options),
                               calibration_steps=30)
    errs = [[relative_error(m.model.layers[i].self_attn.attention_output(cap.hidden_states, cap.position_embeddings),
                            cap.output) for m in (base, fitted)] for i, cap in caps.items()]
    assert all(after <= before for before, after in errs), errs  # never worse on these rows
    assert sum(a for _, a in errs) < 0.9 * sum(b for b, _ in errs), errs  # and better overall
    for n, p in fitted.named_parameters():
        if n in weights:
            assert torch.equal(p, weights[n]), n
        else:
            assert n.endswith(NEW_PARAMETERS), n
    block = copy.deepcopy(base.model.layers[0].self_attn)
    cap = caps[0]
    got = fit_block(block, cap.hidden_states, cap.position_embeddings, cap.output, steps=0)
    assert got["before"] == got["after"]
    with pytest.raises(ValueError, match="calibration_steps must be >= 0"):
        linearize.convert(copy.deepcopy(teacher), calibration_ids=c, calibration_steps=-1)
