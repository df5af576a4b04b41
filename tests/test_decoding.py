"""linearize.decoding against transformers' own generate() on the same converted models (greedy and
sampled, left-padded batches, end of text), and its graph path against its eager path on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

import linearize
from linearize.decoding import Decoder, Sampling, next_tokens, plain_generate_kwargs
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
                                  dict(window=4, sinks=2, to="deltanet")], ids=["pure", "window", "window-conv", "deltanet"])
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


def test_sampling_options_checked():
    for bad in (dict(temperature=0), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            Sampling(**bad)
    with pytest.raises(ValueError, match="graph decoding needs a CUDA device"):
        Decoder(converted(), graph=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_graph_path_equals_eager_path_on_gpu(case):
    model = converted(**case).cuda()
    x, mask = left_padded(model, lengths=tuple(range(3, 23)))  # 20 prompts
    x, mask = x.cuda(), mask.cuda()
    eager = Decoder(model, graph=False).generate(x, attention_mask=mask, max_new_tokens=24)
    dec = Decoder(model, graph=True)
    graphed = dec.generate(x, attention_mask=mask, max_new_tokens=24)
    assert dec.timing.graphed and torch.equal(graphed, eager)
    again = dec.generate(x, attention_mask=mask, max_new_tokens=24)  # a second call captures afresh
    assert torch.equal(again, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_model_generate_on_gpu_takes_the_graph_and_equals_transformers():
    model = converted(window=4, sinks=2).cuda()
    x, mask = left_padded(model, lengths=tuple(range(3, 23)))
    x, mask = x.cuda(), mask.cuda()
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
    base = type(model).__mro__[1]  # the teacher's class: transformers' own generate()
    assert torch.equal(model.generate(x, **kw), base.generate(model, x, **kw))
