"""linearize.decoding against transformers' own generate() on the same converted models (greedy and
sampled, left-padded batches, end of text), and its graph path against its eager path on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import linearize
from linearize.decoding import Decoder, Sampling, next_tokens, plain_generate_kwargs
from linearize.layers.gdn_attention import GDNAttention
from linearize.layers.options import GDNOptions


def calib(model, T=48, seed=1):
    return torch.randint(1, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


def converted(family="llama", keep_softmax=None, **options):
    teacher = tiny_model(family)
    return linearize.convert(teacher, calibration_ids=calib(teacher), keep_softmax=keep_softmax,
                             options=GDNOptions(**options))


def left_padded(model, lengths=(11, 7, 3), seed=3):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    x = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, n in enumerate(lengths):
        x[i, T - n:] = torch.randint(1, model.config.vocab_size, (n,), generator=g)
        mask[i, T - n:] = 1
    return x, mask


CASES = [
    dict(family="llama"),  # the pure Taylor-GDN block
    dict(family="llama", window=4, sinks=2),  # decoding crosses the window and fills the sinks
    dict(family="qwen3", window=4, sinks=2, short_conv=3, output_gate=True),
    dict(family="gemma3_text", window=4, sinks=1),  # the model builds sliding-window masks at every step
    dict(family="llama", window=4, sinks=2, keep_softmax=1),  # hybrid: a KV cache beside the states
    dict(family="llama", window=4, sinks=2, write_gate=True),  # steps through the composed ops, not the kernels
    dict(family="llama", window=4, sinks=2, mix_order=2),  # so does the second-order mix, with Σkkᵀ in the state
    dict(family="llama", window=4, sinks=2, sparse_cache=3),  # a cache that fills, then evicts, on the device
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_greedy_equals_transformers_generate(case):
    model = converted(**case)
    x, mask = left_padded(model)
    want = model.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    dec = Decoder(model)
    got = dec.generate(x, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(got, want)
    assert dec.timing.steps == 11 and not dec.timing.graphed


@pytest.mark.parametrize("case", [dict(), dict(window=4, sinks=2), dict(window=3, sinks=1, short_conv=2),
                                  dict(window=4, sinks=2, to="deltanet"), dict(window=3, sinks=1, sparse_cache=3)],
                         ids=["pure", "window", "window-conv", "deltanet", "sparse-cache"])
def test_fused_decode_steps_equal_the_composed_ops(case):
    """The fused steps (ops.decode, ops.window_step; their PyTorch bodies here) against the composed ops of
    the layer, step by step over a left-padded batch, in float64."""
    from test_convert import incremental_logits

    case = dict(case)
    to = case.pop("to", "gdn")
    teacher = tiny_model("llama").double()
    model = linearize.convert(teacher, to=to, calibration_ids=calib(teacher), options=GDNOptions(**case))
    x, mask = left_padded(model, lengths=(14, 9))
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    fused, _ = incremental_logits(model, x, mask, pos, prefill=3)
    for layer in model.model.layers:
        layer.self_attn.fused_step = False
    composed, _ = incremental_logits(model, x, mask, pos, prefill=3)
    keep = mask.bool()
    assert torch.allclose(fused[keep], composed[keep], rtol=1e-10, atol=1e-10)


def test_capture_runs_with_the_collector_collected_and_off():
    """A dropped model with a decoder (``generate()`` attaches one) is a reference cycle that only the collector
    frees; ``collector_paused``, around the graph's capture, frees it first and keeps the collector from running
    (and freeing an earlier graph) inside, then puts it back as it was."""
    import gc
    import weakref

    from linearize.decoding import collector_paused

    class Held:  # a model and what points back at it
        pass

    a = Held()
    a.me = a
    gone = weakref.ref(a)
    del a
    gc.enable()
    with collector_paused():
        assert gone() is None and not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_sampling_equals_transformers_generate():
    """Same seed, same random draws: temperature, top-k and top-p applied as transformers applies them."""
    model = converted(window=4, sinks=2)
    x, mask = left_padded(model)
    for kw in (dict(temperature=0.7), dict(top_k=5), dict(top_p=0.8), dict(temperature=1.3, top_k=20, top_p=0.9)):
        torch.manual_seed(0)
        want = model.generate(x, attention_mask=mask, max_new_tokens=10, do_sample=True, pad_token_id=0,
                              **{"top_k": 0, **kw})
        torch.manual_seed(0)
        got = Decoder(model).generate(x, attention_mask=mask, max_new_tokens=10, sampling=Sampling(do_sample=True, **kw))
        assert torch.equal(got, want), kw


def test_next_tokens_filters_like_the_logits_processors():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    for temperature, top_k, top_p in ((1.0, 0, 0.5), (0.5, 7, 1.0), (2.0, 10, 0.7)):
        ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            ref = TopKLogitsWarper(top_k)(None, ref)
        if top_p < 1:
            ref = TopPLogitsWarper(top_p)(None, ref)
        allowed = torch.isfinite(ref)
        s = Sampling(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
        draws = torch.stack([next_tokens(logits, s, torch.Generator().manual_seed(i)) for i in range(300)], 1)
        assert allowed.gather(1, draws).all()
        # every allowed token of decent probability shows up: the filter keeps no less than the reference
        probs = ref.softmax(-1)
        for row in range(4):
            seen = set(draws[row].tolist())
            assert {i for i in range(50) if probs[row, i] > 0.05} <= seen
    assert torch.equal(next_tokens(logits, Sampling()), logits.argmax(-1))


def test_end_of_text_pads_finished_rows_and_stops():
    model = converted(window=4, sinks=2)
    x, mask = left_padded(model)
    free = Decoder(model).generate(x, attention_mask=mask, max_new_tokens=12)
    eos = int(free[0, x.shape[1] + 2])  # row 0 says it at its third new token
    dec = Decoder(model, check_every=1)
    got = dec.generate(x, attention_mask=mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    want = model.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want[:, : got.shape[1]])  # generate() stops when every row is done, like this
    assert (got[0, x.shape[1] + 3:] == 0).all()


@pytest.mark.parametrize("kw", [dict(do_sample=False), dict(do_sample=True, temperature=0.8),
                                dict(do_sample=True, top_p=0.7, top_k=0), dict(do_sample=True, top_k=7)])
def test_plain_generate_calls_resolve_as_transformers_does(kw):
    """What model.generate() hands the decoder on a GPU, checked here against transformers' own generate()
    (defaults included: sampling without top_k takes transformers' top-k of 50)."""
    model = converted(window=4, sinks=2)
    x, mask = left_padded(model)
    kw = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0, **kw)
    plan = plain_generate_kwargs(model, kw)
    torch.manual_seed(0)
    want = model.generate(x, **kw)  # on the CPU: transformers' own generate()
    torch.manual_seed(0)
    assert torch.equal(Decoder(model, graph=False).generate(x, **plan), want)


def test_other_generate_calls_stay_with_transformers():
    model = converted()
    assert plain_generate_kwargs(model, dict(max_new_tokens=4, num_beams=2)) is None
    assert plain_generate_kwargs(model, dict(do_sample=False)) is None  # no max_new_tokens: max_length rules
    greedy = plain_generate_kwargs(model, dict(max_new_tokens=4, do_sample=False, temperature=0.0))
    assert greedy["sampling"] == Sampling()  # greedy ignores the temperature, as transformers does
    model.generation_config.repetition_penalty = 1.3
    assert plain_generate_kwargs(model, dict(max_new_tokens=4)) is None


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_kept_cache_loaded_from_a_new_prefill_continues_it(case):
    """What a replayed graph relies on: the states of one prefill, copied into another cache's tensors,
    continue as the prefill itself would (steps compared, eagerly, in float64)."""
    from transformers import DynamicCache

    from linearize.compat import cache_kwargs
    from linearize.decoding import _load_states

    model = converted(**case).double().eval()
    x, mask = left_padded(model)
    y, ymask = left_padded(model, lengths=(5, 12, 9), seed=8)

    def prefill(ids, m):
        cache = DynamicCache(config=model.config)
        model(ids, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp_min(0), **cache_kwargs(cache),
              use_cache=True)
        return cache

    def steps(cache, m, n=6):
        pos = (m.cumsum(-1) - 1).clamp_min(0)[:, -1:]
        tok, out = torch.full((3, 1), 5), []
        with torch.no_grad():
            for i in range(n):
                logits = model(input_ids=tok, position_ids=pos + 1 + i, **cache_kwargs(cache), use_cache=True,
                               decode_step=True).logits[:, -1]
                tok = logits.argmax(-1, keepdim=True)
                out.append(logits)
        return torch.stack(out)

    with torch.no_grad():
        kept, fresh = prefill(x, mask), prefill(y, ymask)
        tensors = [t.data_ptr() for layer in kept.layers for t in layer.recurrent_states.values() if t is not None]
        assert tensors and _load_states(kept, fresh)
    assert [t.data_ptr() for layer in kept.layers for t in layer.recurrent_states.values() if t is not None] == tensors
    want = steps(prefill(y, ymask), ymask)
    assert torch.equal(steps(kept, ymask), want)
    assert not _load_states(kept, DynamicCache(config=model.config))  # nothing prefilled: refused


@pytest.mark.parametrize("case", CASES + [dict(family="qwen3", window=4, sinks=2, keep_softmax=2)],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_static_step_equals_the_eager_step(case):
    """The step a graph records — GDN states in place, a hybrid's softmax keys and values in fixed-size
    buffers under a 4-D mask — run without a graph: the tokens of the growing-cache path, on a second call
    too (the kept buffers loaded with other prompts)."""
    from linearize.decoding import graphable

    model = converted(**case)
    assert graphable(model)
    dec = Decoder(model, graph=False, static=True, kv_bucket=8)
    kept = []
    for lengths, seed in (((11, 7, 3), 3), ((4, 12, 9), 5)):
        x, mask = left_padded(model, lengths=lengths, seed=seed)
        want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=12)
        assert torch.equal(dec.generate(x, attention_mask=mask, max_new_tokens=12), want)
        kept.append(next(iter(dec._graphs.values()))[1])
    assert kept[0] is kept[1]  # the second call loaded the kept cache, built nothing
    lengths = {layer.get_seq_length() for layer in kept[0].layers}
    assert lengths == {x.shape[1] + 11}, lengths  # every layer counts the prompt and the 11 steps alike
    assert len(dec._graphs) == 1  # one set of buffers: same batch, same bucket of 8 slots (24)
    x, mask = left_padded(model, lengths=(20, 2, 5), seed=6)  # 20 + 12 slots: another bucket
    want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(dec.generate(x, attention_mask=mask, max_new_tokens=12), want)
    assert len(dec._graphs) == (1 if "keep_softmax" not in case else 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_chunked_prefill_equals_one_prefill(case):
    """A prompt fed 4 tokens at a time (left padding filling whole chunks of some rows) continues as the
    whole prompt at once does, in float64: the same logits to rounding, the same tokens."""
    model = converted(**case).double().eval()
    x, mask = left_padded(model, lengths=(11, 2, 7))
    want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=8)
    got = Decoder(model, graph=False, prefill_chunk=4).generate(x, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, want)
    from transformers import DynamicCache

    from linearize.compat import cache_kwargs

    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        full = model(x, attention_mask=mask, position_ids=pos, **cache_kwargs(DynamicCache(config=model.config)),
                     use_cache=True).logits[:, -1]
        cache = DynamicCache(config=model.config)
        for i in range(0, x.shape[1], 4):
            part = model(x[:, i:i + 4], attention_mask=mask[:, :i + 4], position_ids=pos[:, i:i + 4],
                         **cache_kwargs(cache), use_cache=True).logits[:, -1]
    assert (part - full).abs().max() < 1e-9 * full.abs().max()


@pytest.mark.parametrize("reload", [False, True], ids=["converted", "reloaded"])
@pytest.mark.parametrize("keep_softmax", [None, 1], ids=["all-gdn", "hybrid"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_chunked_prefill_masks_stay_one_chunk_wide(family, keep_softmax, reload, tmp_path):
    """Fed in chunks of 4, a model of GDN layers only builds masks over each chunk's own columns, whatever
    the context so far (the masks' width was the prefill's memory that grew with the prompt); a hybrid's
    softmax layer still gets the columns of every token seen. Left padding keeps the masks 4-D. The same
    for the model saved and loaded back (its config says which layers are softmax)."""
    model = converted(family, keep_softmax=keep_softmax, window=4, sinks=2).eval()
    if reload:
        from linearize.saving import load, save

        save(model, None, tmp_path / "m")
        model = load(tmp_path / "m")
    x, mask = left_padded(model, lengths=(15, 6, 9))
    widths = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kw: widths.append((type(mod).__name__, kw["attention_mask"].shape[-1]))
        if kw.get("attention_mask") is not None and kw["attention_mask"].dim() == 4 else None, with_kwargs=True)
        for layer in model.model.layers]
    try:
        Decoder(model, graph=False, prefill_chunk=4).generate(x, attention_mask=mask, max_new_tokens=1)
    finally:
        for h in hooks:
            h.remove()
    assert widths, "the padded prompt should reach the layers as 4-D masks"
    gdn = [w for name, w in widths if name == "GDNAttention"]
    softmax = [w for name, w in widths if name != "GDNAttention"]
    if keep_softmax is None:
        assert not softmax and max(gdn) <= 4, widths
    elif family == "llama":
        assert max(softmax) == x.shape[1], widths  # the last chunk's keys: the whole prompt
    else:  # Gemma's kept layer slides: the window's older columns beside the chunk's
        assert max(softmax) > 4, widths


def test_static_decoding_of_other_targets_and_one_token():
    """A second static call on blocks without stacked projections (VaLA), and a call of one new token
    (no step at all), give the eager path's tokens."""
    for to in ("linear", "deltanet"):
        teacher = tiny_model("llama")
        model = linearize.convert(teacher, calibration_ids=calib(teacher), to=to,
                                  options=GDNOptions(window=0, sinks=0))
        dec = Decoder(model, graph=False, static=True)
        for seed in (3, 4):
            x, mask = left_padded(model, seed=seed)
            for n in (6, 1):
                want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=n)
                assert torch.equal(dec.generate(x, attention_mask=mask, max_new_tokens=n), want)


def test_dropped_decode_caches_follow_writes_the_version_counter_misses():
    from linearize.decoding import drop_decode_caches

    model = converted(window=4, sinks=2).eval()
    x, mask = left_padded(model)
    Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=4)  # builds the stacked copies
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.model.layers:
            v = block.self_attn.v_proj.weight
            v.data.copy_(torch.randn(v.shape, generator=g))  # as peft's merge writes: no version bump
    drop_decode_caches(model)
    got = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=8)
    try:
        GDNAttention.stacked_step = False
        want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=8)
    finally:
        GDNAttention.stacked_step = True
    assert torch.equal(got, want)


def test_static_step_with_eager_attention_equals_the_eager_step():
    """The additive 4-D mask of eager attention (SDPA's is boolean)."""
    model = converted(window=4, sinks=2, keep_softmax=1)
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    x, mask = left_padded(model)
    want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=12)
    dec = Decoder(model, graph=False, static=True, kv_bucket=8)
    assert torch.equal(dec.generate(x, attention_mask=mask, max_new_tokens=12), want)
    assert dec._graphs[(3, 24)][2].mask.dtype == model.dtype


def test_sliding_softmax_layers_are_not_recorded():
    from linearize.decoding import graphable

    model = converted(family="gemma3_text", window=4, sinks=1, keep_softmax=2)
    kept = model.config.linearize["softmax_layers"]
    if all(model.config.layer_types[i] == "full_attention" for i in kept):
        pytest.skip("the kept layers are all of full attention")
    assert not graphable(model)
    with pytest.raises(ValueError, match="static decoding needs"):
        Decoder(model, static=True)


@pytest.mark.parametrize("cache", [0, 3])
def test_compiled_blocks_compute_the_same_and_put_the_model_back(cache):
    """The norms, MLPs and GDN step inputs compiled for a captured step give the eager model's tokens and logits (to
    float32 rounding: the compiler reorders sums), and leave the model's own modules afterwards."""
    from linearize.compiling import compiled_blocks

    model = converted(family="llama", window=4, sinks=2, sparse_cache=cache).eval()
    x, mask = left_padded(model)
    block = model.model.layers[0]
    own = lambda m, name: m.__dict__.get(name)  # noqa: E731  (a method on the instance: the fused kernels' forward)
    before = (own(block.mlp, "forward"), own(block.input_layernorm, "forward"), own(block.self_attn, "step_inputs"))
    assert before[0] is not None and before[1] is not None  # a converted model's fused MLP and norm
    want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=8)
    with torch.no_grad():
        logits = model(x, attention_mask=mask).logits
        with compiled_blocks(model):
            assert own(block.mlp, "forward") is not before[0] and own(block.self_attn, "step_inputs") is not None
            got = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=8)
            compiled_logits = model(x, attention_mask=mask).logits
    assert torch.equal(got, want)
    assert (compiled_logits - logits).abs().max() < 1e-5 * logits.abs().max()
    after = (own(block.mlp, "forward"), own(block.input_layernorm, "forward"), own(block.self_attn, "step_inputs"))
    assert all(a is b for a, b in zip(after, before)), (after, before)  # compiled, then put back as they were


@pytest.mark.parametrize("case", [dict(family="llama"), dict(family="llama", window=4, sinks=2, sparse_cache=3)],
                         ids=["taylor", "window-cache"])
def test_compiled_steps_decode_the_same_and_put_the_model_back(case, monkeypatch):
    """Every GDN block's whole decode step compiled (the eager decoder's ``compile=True``, a CPU's path) gives the
    eager steps' tokens — through the Taylor step, and through the window's, whose cache fills and evicts in
    place — and the blocks' own ``_step`` afterwards; ``Decoder(compile=True)`` without a graph decodes so."""
    import linearize.decoding as decoding
    from linearize.compiling import compiled_steps

    model = converted(**case).eval()
    x, mask = left_padded(model)
    attn = [m for m in model.modules() if isinstance(m, GDNAttention)]
    want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=10)
    with compiled_steps(model):
        assert all("_step" in a.__dict__ for a in attn)  # compiled, on the instance
        got = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(got, want)
    assert not any("_step" in a.__dict__ for a in attn)
    used = []
    monkeypatch.setattr(decoding, "compiled_steps", lambda m, on: used.append(on) or compiled_steps(m, on))
    assert torch.equal(Decoder(model, graph=False, compile=True).generate(x, attention_mask=mask, max_new_tokens=10), want)
    assert used == [True]


def test_prefilled_states_have_the_standard_strides_whatever_the_prompt_length():
    """A prefill's states are slices of its whole-prompt tensors; the cache keeps them with row-major strides (size-1
    dimensions' too), so that a compiled decode step — whose guards read every stride — compiles once per batch
    size, not once per prompt length."""
    from transformers import DynamicCache

    from linearize.compat import cache_kwargs
    from linearize.layers.cache import GDNStateLayer

    model = converted(family="llama", window=4, sinks=2, sparse_cache=3).eval()
    for B, T in ((1, 5), (2, 9), (3, 30)):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.randint(1, model.config.vocab_size, (B, T)), **cache_kwargs(cache), use_cache=True)
        layers = [layer for layer in cache.layers if isinstance(layer, GDNStateLayer)]
        assert layers
        for layer in layers:
            for i, x in layer.recurrent_states.items():
                if layer.is_recurrent_states_initialized[i]:
                    assert x.stride() == torch.empty(x.shape).stride(), (T, i, x.shape, x.stride())


def test_a_failed_capture_decodes_eagerly_when_the_graph_was_not_asked_for(monkeypatch):
    """What an automatic decoder (graph=None) does where the capture fails: warn, then decode eagerly with
    the same tokens; one asked for a graph raises."""
    model = converted(window=4, sinks=2)
    x, mask = left_padded(model)
    want = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=6)

    def fail(*a, **k):
        raise RuntimeError("operation not permitted when stream is capturing")

    dec = Decoder(model, graph=False, static=True)
    monkeypatch.setattr(dec, "_plain_static_step", fail)
    with pytest.raises(RuntimeError, match="capturing"):
        dec.generate(x, attention_mask=mask, max_new_tokens=6)
    dec.graph, dec._auto = True, True  # as on a GPU with graph=None (the recording replaced by the failure)
    monkeypatch.setattr(dec, "_recorded_step", fail)
    with pytest.warns(RuntimeWarning, match="decodes eagerly"):
        assert torch.equal(dec.generate(x, attention_mask=mask, max_new_tokens=6), want)
    assert not dec.graph and not dec.static


def test_a_copied_model_gets_its_own_kept_decoder():
    import copy

    model = converted(window=4, sinks=2)
    model.__dict__["_linearize_decoder"] = dec = Decoder(model, graph=False)
    dec._graphs[3] = ("captured",)
    twin = copy.deepcopy(model)
    kept = twin.__dict__["_linearize_decoder"]
    assert kept is not dec and kept.model is twin and kept._graphs == {} and dec._graphs
    x, mask = left_padded(twin)
    assert torch.equal(kept.generate(x, attention_mask=mask, max_new_tokens=4),
                       dec.generate(x, attention_mask=mask, max_new_tokens=4))


def test_sampling_options_checked():
    for bad in (dict(temperature=0), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Sampling(**bad)
    with pytest.raises(ValueError, match="graph decoding needs a CUDA device"):
        Decoder(converted(), graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_graph_path_equals_eager_path_on_gpu(case):
    model = converted(**case).cuda()
    x, mask = left_padded(model, lengths=tuple(range(3, 23)))  # 20 prompts
    x, mask = x.cuda(), mask.cuda()
    eager = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=24)
    dec = Decoder(model, graph=True)
    graphed = dec.generate(x, attention_mask=mask, max_new_tokens=24)
    assert dec.timing.graphed and torch.equal(graphed, eager)
    assert dec.timing.capture_s > 0
    y, ymask = left_padded(model, lengths=tuple(range(30, 10, -1)), seed=7)  # same batch, other prompts
    y, ymask = y.cuda(), ymask.cuda()
    again = dec.generate(y, attention_mask=ymask, max_new_tokens=24)  # replays the kept graph
    assert dec.timing.capture_s == 0
    assert torch.equal(again, Decoder(model, graph=False).generate(y, attention_mask=ymask, max_new_tokens=24))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_graph_path_equals_eager_path_on_gpu():
    model = converted(window=4, sinks=2).cuda()
    x, mask = left_padded(model, lengths=tuple(range(3, 23)))
    x, mask = x.cuda(), mask.cuda()
    eager = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=24)
    dec = Decoder(model, graph=True, compile=True)
    mlp = model.model.layers[0].mlp
    before = mlp.__dict__.get("forward")  # the fused kernels' forward on the instance (linearize/modules/patch.py)
    assert torch.equal(dec.generate(x, attention_mask=mask, max_new_tokens=24), eager)
    assert mlp.__dict__.get("forward") is before  # the model is put back after the capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("keep", [None, 1], ids=["gdn", "hybrid"])
def test_model_generate_on_gpu_takes_the_graph_and_equals_transformers(keep):
    model = converted(window=4, sinks=2, keep_softmax=keep).cuda()
    x, mask = left_padded(model, lengths=tuple(range(3, 23)))
    x, mask = x.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    base = type(model).__mro__[1]  # the teacher's class: transformers' own generate()
    from linearize import decoding

    decoding._GRAPH_FAILED.clear()  # a capture that failed falls back to transformers' loop, with a warning
    assert torch.equal(model.generate(x, **kw), base.generate(model, x, **kw))
    assert not decoding._GRAPH_FAILED, decoding._GRAPH_FAILED
    assert model.__dict__["_linearize_decoder"].timing.graphed
