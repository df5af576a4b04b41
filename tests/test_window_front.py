"""The window block's old stream on the fused Triton front (linearize.layers.window_front, TRITON_INTERPRET=1)
against the PyTorch front with its mask, in float64: the block's output and the gradients of every parameter
and of its input, on packed rows whose documents are longer and shorter than window + sinks, and on rows of
one document each (no cu_seqlens)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import needs_interpreter, tiny_model
from test_convert import ids

import linearize
from linearize.calibration import NEW_PARAMETERS
from linearize.eval import capture_attention
from linearize.layers import GDNOptions
from linearize.layers import gdn_attention as block_module
from linearize.layers.paths import fused_window_path
from linearize.layers.window_front import document_pieces


def positions(rows: list[list[int]]) -> torch.Tensor:
    """Position ids ``(B, T)`` of rows packing documents of these lengths."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])


CASES = {  # name: (options, document lengths per row)
    # window + sinks = 6: documents longer, equal (no old token) and shorter, one of a single token
    "gdn": (dict(window=4, sinks=2), [[3, 21, 6, 10], [1, 25, 7, 7]]),
    "all-short": (dict(window=8, sinks=3), [[4, 11, 9, 1, 7, 8], [10, 10, 10, 10]]),
    "no-sinks": (dict(window=5, sinks=0), [[5, 6, 29], [40]]),
    "unpacked": (dict(window=4, sinks=1), [[40], [40]]),  # rows of one document each: no cu_seqlens
    "deltanet": (dict(window=3, sinks=2, target="deltanet"), [[2, 30, 8], [17, 23]]),
    "kda": (dict(window=3, sinks=1, target="kda", decay_rank=2), [[9, 31], [4, 36]]),
    "conv-gate-cache": (dict(window=4, sinks=2, short_conv=3, output_gate=True, sparse_cache=2), [[12, 28], [40]]),
}


def converted(options: GDNOptions):
    """A tiny Llama converted with ``options``, calibrated on the 48 tokens every test here uses."""
    teacher = tiny_model("llama")
    return linearize.convert(copy.deepcopy(teacher), to=options.target, options=options,
                             calibration_ids=ids(teacher, B=1, T=48, seed=1))


def set_fused_front(model, fused: bool | None) -> None:
    """``GDNOptions.fused_front`` of every converted block of ``model``."""
    for layer in model.model.layers:
        layer.self_attn.options = dataclasses.replace(layer.self_attn.options, fused_front=fused)


def count_fused_calls(monkeypatch) -> list:
    """A list that gets an entry at every call of the block's :func:`fused_old_stream` from now on."""
    calls = []
    inner = block_module.fused_old_stream
    monkeypatch.setattr(block_module, "fused_old_stream", lambda *a: calls.append(1) or inner(*a))
    return calls


def block_run(gdn, cap, pos, fused: bool, dtype=torch.float32):
    """The block's output on ``cap``'s input and the gradients of a fixed random projection of it."""
    gdn = copy.deepcopy(gdn).to(dtype)
    gdn.options = dataclasses.replace(gdn.options, fused_front=fused)
    h = cap.hidden_states.detach().to(dtype).requires_grad_(True)
    out = gdn.attention_output(h, tuple(x.to(dtype) for x in cap.position_embeddings), pos)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (out.double() * w).sum().backward()
    grads = {n: p.grad for n, p in gdn.named_parameters() if p.grad is not None}
    return out.detach().double(), {n: x.double() for n, x in {**grads, "hidden_states": h.grad}.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_window_block_fused_old_stream_equals_pytorch_front(name, monkeypatch):
    """Against the PyTorch front in float64: the output to 1e-5, every gradient to 1e-4 or, where the
    PyTorch front in float32 is farther off than that, to twice its distance. (The decay correction's
    gradient is such a case: the float32 PyTorch path is 6e-4 off with the short convolution.)"""
    needs_interpreter()
    options, rows = CASES[name]
    teacher = tiny_model("llama")
    pos = positions(rows)
    cap = capture_attention(teacher, ids(teacher, B=len(rows), T=pos.shape[1]), [0], position_ids=pos)[0]
    gdn = linearize.linearize_layer(teacher.model.layers[0].self_attn, GDNOptions(**options))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # off the identity, so that every new parameter acts
        for n, p in gdn.named_parameters():
            if n.endswith(NEW_PARAMETERS):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    calls = count_fused_calls(monkeypatch)
    ref, ref_g = block_run(gdn, cap, pos, fused=False, dtype=torch.float64)
    base, base_g = block_run(gdn, cap, pos, fused=False)
    assert not calls
    got, got_g = block_run(gdn, cap, pos, fused=True)
    assert calls, "the fused old stream was not taken"
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    assert ref_g.keys() == got_g.keys() and {"rho", "mix_bias", "beta_proj.weight", "k_proj.weight"} <= ref_g.keys()
    for n in ref_g:  # documents all shorter than window + sinks: the old stream's gradients are 0 on both paths
        err, err_base = (got_g[n] - ref_g[n]).norm(), (base_g[n] - ref_g[n]).norm()
        assert torch.isfinite(got_g[n]).all() and err <= max(1e-4 * ref_g[n].norm(), 2 * err_base), (n, err, err_base)
    if name == "all-short":
        assert got_g["rho"].abs().max() == 0 and got_g["mix_bias"].abs().max() == 0


def test_document_pieces_cut_every_document_after_window_plus_sinks():
    cu = torch.tensor([0, 3, 3, 10, 16, 17])  # an empty document, one of exactly 6 tokens, one of 1
    assert document_pieces(cu, 1, 17, 4, "cpu").tolist() == [0, 3, 7, 10, 14, 16, 17]
    assert document_pieces(cu, 1, 17, 6, "cpu").tolist() == [0, 3, 9, 10, 16, 17]
    assert document_pieces(cu, 1, 17, 6, "cpu") is document_pieces(cu, 1, 17, 6, "cpu")  # one tensor for every layer
    assert document_pieces(None, 3, 5, 2, "cpu").tolist() == [0, 2, 5, 7, 10, 12, 15]
    assert document_pieces(None, 2, 5, 9, "cpu").tolist() == [0, 5, 10]
    with torch.inference_mode():  # a prefill under inference mode remembers offsets a training step may save
        rows, pieces = document_pieces(None, 4, 7, 2, "cpu"), document_pieces(torch.tensor([0, 5, 9]), 1, 9, 2, "cpu")
    assert not rows.is_inference() and not pieces.is_inference()


def test_fused_window_path_rule():
    """Where asked, or by default on CUDA without gradients (never on the CPU by default); the stable form,
    no mask, a fresh sequence; and never with a write gate or the second-order mix."""
    h = torch.zeros(1, 4, 8)
    on = GDNOptions(window=4, sinks=1, fused_front=True)
    assert fused_window_path(on, h) or not linearize.ops._triton_usable(h)
    with torch.no_grad():
        assert not fused_window_path(GDNOptions(window=4), h)  # by default on CUDA only
    assert not fused_window_path(GDNOptions(fused_front=True), h)  # no window: fused_path decides
    for off in (dict(form="seed"), dict(write_gate=True), dict(mix_order=2), dict(fused_front=False)):
        assert not fused_window_path(dataclasses.replace(on, **off), h), off
    assert not fused_window_path(on, h, mask=torch.ones(1, 4, dtype=torch.bool))
    assert not fused_window_path(on, h, fresh=False)
    assert not fused_window_path(on, h.double())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_window_path_by_default_without_gradients_on_gpu(compiled):
    """On CUDA the default (``fused_front=None``) takes the fused front where no gradient is wanted and the
    PyTorch front where one is: a converted model's logits equal those of the same weights with ``True``
    under ``no_grad`` (scoring without a cache, and a prefill into an empty one) and those with ``False``
    with gradients on, bit for bit; under ``no_grad`` the two fronts differ, so the comparisons can fail."""
    h = torch.zeros(1, 4, 8, device="cuda")
    with torch.no_grad():
        assert fused_window_path(GDNOptions(window=4), h)
    assert not fused_window_path(GDNOptions(window=4), h)
    model = converted(GDNOptions(window=4, sinks=2)).to("cuda")
    x = ids(model, B=2, T=40).to("cuda")

    def logits(fused, use_cache):
        set_fused_front(model, fused)
        return model(x, use_cache=use_cache).logits.detach()

    for use_cache in (False, True):
        with torch.no_grad():
            default, fused, pytorch = logits(None, use_cache), logits(True, use_cache), logits(False, use_cache)
        assert torch.equal(default, fused), use_cache
        assert not torch.equal(fused, pytorch), use_cache
        assert torch.equal(logits(None, use_cache), logits(False, use_cache)), use_cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_block_fused_old_stream_on_gpu(dtype, compiled):
    """The compiled kernels, SmolLM2's head shapes (9 query, 3 KV heads of 64), window 64 and 4 sinks, on
    packed rows: against the PyTorch front in float64 on the CPU, the fused path is as close as the PyTorch
    front in ``dtype`` on the GPU (fp32: to 1e-4 where that is closer; bf16: twice its distance)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=576, intermediate_size=96, num_hidden_layers=1, num_attention_heads=9,
                      num_key_value_heads=3, max_position_embeddings=4096)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(cfg)
    gdn = linearize.linearize_layer(teacher.model.layers[0].self_attn, GDNOptions(window=64, sinks=4))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in gdn.named_parameters():
            if n.endswith(NEW_PARAMETERS):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    pos = positions([[30, 900, 68, 26], [1024], [500, 60, 300, 164]])
    h = torch.randn(*pos.shape, cfg.hidden_size, generator=g)
    pe = teacher.model.rotary_emb(h, pos)
    runs = {}
    for name, dev, dt, fused in (("ref", "cpu", torch.float64, False), ("torch", "cuda", dtype, False),
                                 ("fused", "cuda", dtype, True)):
        block = copy.deepcopy(gdn).to(dev, dt)
        block.options = dataclasses.replace(block.options, fused_front=fused)
        x = h.to(dev, dt).requires_grad_(True)
        out = block.attention_output(x, tuple(t.to(dev, dt) for t in pe), pos.to(dev))
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dev)
        (out.double() * w).sum().backward()
        grads = {n: p.grad.double().cpu() for n, p in block.named_parameters() if p.grad is not None}
        runs[name] = {"output": out.detach().double().cpu(), "hidden_states": x.grad.double().cpu(), **grads}
    ref = runs["ref"]
    assert ref.keys() == runs["fused"].keys()
    for n in ref:
        err, err_torch = ((runs[k][n] - ref[n]).norm() / ref[n].norm() for k in ("fused", "torch"))
        bound = max(1e-4, 2 * err_torch) if dtype == torch.float32 else 2 * err_torch + 1e-3
        assert torch.isfinite(runs["fused"][n]).all() and err <= bound, (n, err, err_torch)


def test_recipe_key_fused_front_reaches_every_block(tiny_dir, tmp_path):
    """``convert.fused_front`` of a recipe is the converted blocks' ``GDNOptions.fused_front`` (null by default);
    anything but true, false or null is refused."""
    from linearize.config import load_recipe
    from linearize.distill.losses import gdn_layers
    from linearize.distill.setup import cleanup, setup

    base = [f"teacher.model={tiny_dir}", "convert.window=4", "convert.sinks=1", "device=cpu", "precision=fp32",
            f"output.dir={tmp_path / 'run'}"]
    assert load_recipe(None, base).convert.fused_front is None
    with pytest.raises(Exception, match="fused_front"):
        load_recipe(None, [*base, "convert.fused_front=maybe"])
    run = setup(load_recipe(None, [*base, "convert.fused_front=true"]), resume=False)
    try:
        blocks = list(gdn_layers(run.student).values())
        assert blocks and all(b.options.fused_front is True for b in blocks)
    finally:
        cleanup(run)


PREFILL_CASES = ["gdn", "deltanet", "kda", "conv-gate-cache"]


def check_fused_prefill(name: str, monkeypatch, device: str, tol: float) -> None:
    """A prompt's prefill into an empty cache takes the fused front (``fused_front=True``) and leaves the state
    and running sums the PyTorch front leaves: the prompt's logits and those of the decode steps after it
    match the PyTorch front's, for a prompt longer than window + sinks and for one shorter (no old token)."""
    from test_convert import incremental_logits

    model = converted(GDNOptions(**CASES[name][0], fused_front=False)).to(device)
    calls = count_fused_calls(monkeypatch)
    x = ids(model, B=2, T=30).to(device)
    mask, pos = torch.ones_like(x), torch.arange(30, device=device)[None].expand(2, -1)
    for prefill in (22, 3):
        ref = incremental_logits(model, x, mask, pos, prefill)[0]
        assert not calls
        set_fused_front(model, True)
        got = incremental_logits(model, x, mask, pos, prefill)[0]
        assert len(calls) == len(model.model.layers), "the prefill did not take the fused front"
        assert ((got - ref).norm() / ref.norm()).item() < tol, prefill
        set_fused_front(model, False)
        calls.clear()


@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_through_the_fused_front_continues_as_the_pytorch_front(name, monkeypatch):
    needs_interpreter()
    check_fused_prefill(name, monkeypatch, "cpu", 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_through_the_fused_front_on_gpu(name, monkeypatch, compiled):
    """The same on the compiled kernels in float32 (the decode steps on the GPU's step kernels)."""
    check_fused_prefill(name, monkeypatch, "cuda", 1e-4)


def check_chunked_fused_prefill(name: str, monkeypatch, device: str, tol: float) -> None:
    """A prompt fed in chunks of 8 (``Decoder(prefill_chunk=8)``'s calls): the first into the empty cache on the
    fused front, the others continuing its state and running sums on the PyTorch front; every logit as the
    whole prompt's in one call on the PyTorch front."""
    from transformers import DynamicCache

    from linearize.compat import cache_kwargs

    model = converted(GDNOptions(**CASES[name][0], fused_front=False)).to(device)
    x = ids(model, B=2, T=30).to(device)
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        set_fused_front(model, True)
        calls = count_fused_calls(monkeypatch)
        kw = cache_kwargs(DynamicCache(config=model.config))
        got = torch.cat([model(x[:, i:i + 8], position_ids=torch.arange(i, min(i + 8, 30), device=device)[None].expand(2, -1),
                               use_cache=True, **kw).logits for i in range(0, 30, 8)], 1)
    assert len(calls) == len(model.model.layers), "only the first chunk takes the fused front"
    assert ((got - ref).norm() / ref.norm()).item() < tol


@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_chunked_prefill_continues_the_fused_front(name, monkeypatch):
    needs_interpreter()
    check_chunked_fused_prefill(name, monkeypatch, "cpu", 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gdn", "kda"])
def test_chunked_prefill_continues_the_fused_front_on_gpu(name, monkeypatch, compiled):
    """The same on the compiled kernels in float32."""
    check_chunked_fused_prefill(name, monkeypatch, "cuda", 1e-4)


def check_lean_prefill(monkeypatch, device: str, dtype: torch.dtype, backend: str, tol: float) -> None:
    """A 16-bit model's prefill on the fused front with the window and mix kernels (no gradient) keeps q in its
    dtype from the projection to the mix, and its prompt and decode logits stay those of the same weights in
    float32 on the PyTorch paths (``backend="torch"``), to the dtype's rounding."""
    from test_convert import incremental_logits

    import linearize.ops.triton.mix as mix

    options = GDNOptions(window=4, sinks=2, backend=backend, fused_front=True)
    model = converted(options)
    ref_model = copy.deepcopy(model).to(device)
    for layer in ref_model.model.layers:
        layer.self_attn.options = dataclasses.replace(options, backend="torch", fused_front=False)
    seen = []
    inner = mix.mix_by_mass_triton
    monkeypatch.setattr(mix, "mix_by_mass_triton", lambda *a, **k: seen.append(a[3].dtype) or inner(*a, **k))
    x = ids(model, B=2, T=30).to(device)
    mask, pos = torch.ones_like(x), torch.arange(30, device=device)[None].expand(2, -1)
    with torch.no_grad():
        ref = incremental_logits(ref_model, x, mask, pos, 22)[0]
        assert not seen
        got = incremental_logits(model.to(device, dtype), x, mask, pos, 22)[0].float()
    assert seen[: len(model.model.layers)] == [dtype] * len(model.model.layers), "q left its dtype before the mix"
    assert ((got - ref).norm() / ref.norm()).item() < tol


def test_fp16_prefill_on_the_kernels_reads_q_in_fp16(monkeypatch):
    needs_interpreter()
    check_lean_prefill(monkeypatch, "cpu", torch.float16, "triton", 3e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bf16_prefill_on_the_kernels_reads_q_in_bf16_on_gpu(monkeypatch, compiled):
    """The same on the compiled kernels in bf16, where ``backend="auto"`` takes them."""
    check_lean_prefill(monkeypatch, "cuda", torch.bfloat16, "auto", 2e-2)
