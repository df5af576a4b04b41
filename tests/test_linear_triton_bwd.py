"""The Triton backward of the decayed linear attention (ops/triton/linear_bwd.py): output, final state and
the gradients of q, k, v, g, w, the initial state and v_offset against autograd through the float64
recurrent definition — interpreted on the CPU (fp32; fp16: the interpreter's bf16 dots are wrong) and
compiled on a CUDA GPU (``-m gpu``, NaN-poisoned buffers, fp32 and bf16)."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_interpreter
from test_linear_ops import inputs, rel

from linearize.ops.linear import linear_attention

f64 = torch.float64
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dw", "dh0", "dv_offset"]
SHAPES = [  # (B, T, H, G, K, V, cu_seqlens)
    (2, 63, 2, 1, 16, 16, None),  # T not a multiple of the chunk
    (1, 150, 2, 3, 32, 16, None),  # GQA, three chunks
    (1, 130, 2, 2, 16, 32, [0, 17, 17, 81, 130]),  # packed, with an empty document
    (1, 90, 1, 2, 24, 80, [0, 0, 70, 90, 90]),  # empty first and last documents; K, V not powers of two, 2 V blocks
    (2, 1, 1, 2, 8, 8, None),
]
ids = lambda s: "x".join(map(str, s[:6])) + ("-packed" if s[6] else "")  # noqa: E731


def grads(backend, q, k, v, g, w, h0, offset, cu, *, final=True, seed=11):
    """Output, final state and every input's gradient under a random loss on both (None where not used)."""
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in (q, k, v, g, w, h0, offset)]
    o, h = linear_attention(*leaves[:5], scale=0.7, initial_state=leaves[5], output_final_state=final,
                            cu_seqlens=cu, backend=backend, v_offset=leaves[6])
    gen = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=f64).to(o.device)).sum()
    if final:
        loss = loss + (h.double() * torch.randn(h.shape, generator=gen, dtype=f64).to(h.device)).sum()
    loss.backward()
    return [o.detach(), h.detach() if final else None] + [x.grad if x is not None else None for x in leaves]


def check(dtype, device, B, T, H, G, K, V, cu, *, h0=True, final=True, decay=1.0, tol=None):
    N = len(cu) - 1 if cu else B
    q, k, v, g, w, s0 = inputs(B, T, H, G, K, V, seed=T + K + G, N=N)
    g = g * decay - float(decay > 1)  # strong decays: exp(−decay − 1) … exp(−1) per step
    offset = torch.randn(B, T, H, V, dtype=f64, generator=torch.Generator().manual_seed(1))
    cu_t = torch.tensor(cu) if cu else None
    q, k, v, offset = (x.to(dtype) for x in (q, k, v, offset))  # the kernels' inputs; the reference sees the same values
    g, w = g.float(), w.float()
    s0 = s0.float() if h0 else None
    dev = lambda x: x.to(device) if x is not None else None  # noqa: E731
    # the float64 reference on the kernels' device (test_linear_triton.check says why), compared on the CPU
    ref = grads("reference", *(dev(x.double()) if x is not None else None for x in (q, k, v, g, w, s0, offset)),
                cu_t, final=final)
    ref = [x.cpu() if x is not None else None for x in ref]
    got = grads("triton", *map(dev, (q, k, v, g, w, s0, offset, cu_t)), final=final)
    tol = tol or TOL[dtype]
    for name, a, b in zip(NAMES, got, ref):
        a, b = (None if x is None or x.numel() == 0 else x for x in (a, b))  # no token: the loop leaves None
        assert (a is None) == (b is None), name
        if a is None:
            continue
        a = a.double().cpu()
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= tol, (name, rel(a, b))
    assert got[2].dtype == dtype and (not h0 or got[7].dtype == torch.float32)


def test_linear_attention_decay_gradient_identity_float64():
    """What the backward's dg rests on: over each sequence, ``dg_t = Σ_{s≥t} (Σ_g q_s·dq_s − k_s·dk_s) +
    ⟨dh_T, h_T⟩``, with every gradient from autograd through the recurrent definition."""
    cu = [0, 17, 17, 81, 130]
    q, k, v, g, w, h0 = inputs(1, 130, 2, 3, 8, 8, seed=4, N=4)
    out = grads("reference", q, k, v, g, w, h0, None, torch.tensor(cu), seed=5)
    hT, (dq, dk, dg) = out[1], (out[i] for i in (2, 3, 5))
    gen = torch.Generator().manual_seed(5)  # grads' loss weights: those of o, then those of the final state
    torch.randn(out[0].shape, generator=gen, dtype=f64)
    dhT = torch.randn(hT.shape, generator=gen, dtype=f64)
    per_token = (q * dq).view(1, 130, 2, 3, 8).sum((3, 4)) - (k * dk).sum(-1)  # (1, T, H)
    for n, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        want = per_token[0, s:e].flip(0).cumsum(0).flip(0) + (dhT[n] * hT[n]).sum((-1, -2))
        assert torch.allclose(dg[0, s:e], want, rtol=1e-10, atol=1e-10), n


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_linear_attention_triton_grads_interpreted_equal_reference(shape, poisoned):
    needs_interpreter()
    check(torch.float32, "cpu", *shape)


@pytest.mark.parametrize("h0,final", [(False, False), (True, False), (False, True)])
def test_linear_attention_triton_grads_without_states(h0, final):
    needs_interpreter()
    check(torch.float32, "cpu", 1, 100, 2, 2, 16, 16, [0, 40, 40, 100], h0=h0, final=final)


def test_linear_attention_triton_grads_strong_decay():
    """Decays down to exp(−31) per step: no exponent in the backward is positive either, and every result
    within 1e-6 of the float64 loop over 1,000 tokens — the in-chunk decays between two tokens summed from
    the g between them; taken as differences of G (|G| reaches thousands) dg's error was 1.2e-5, the
    output's 7.8e-7 (an fp32 loop: 1e-7)."""
    needs_interpreter()
    check(torch.float32, "cpu", 1, 1000, 2, 2, 64, 64, None, decay=30.0, tol=1e-6)


def test_linear_attention_triton_narrow_state_blocks(monkeypatch):
    """With few (sequence, head) pairs for the GPU's SMs the state kernels take narrower V blocks than the
    output kernels (16 of V = 40 here: two full blocks and a masked one, against one block of 64), and key
    rows split in two blocks of 32 where K = 64; forced on the interpreter as a 132-SM GPU would pick them,
    the output, final state and every gradient still match the reference."""
    needs_interpreter()
    from linearize.ops.triton import linear_fwd
    from linearize.ops.triton.layout import Layout
    from linearize.ops.triton.settings import state_bv

    monkeypatch.setattr(linear_fwd, "sms_for", lambda programs, device: 132)
    assert state_bv(16, 40, True, 3 * 2, 132) == 16 and linear_fwd.linear_bv(16, 40) == 64  # 3 documents × 2 heads
    cu = [0, 40, 40, 150]
    layout = Layout(torch.zeros(1, 150, 4, 64), torch.zeros(1, 150, 2, 40), torch.tensor(cu))
    assert linear_fwd.linear_state_bk(layout, 16, torch.device("cpu")) == 32
    check(torch.float32, "cpu", 1, 150, 2, 2, 16, 40, cu)
    check(torch.float32, "cpu", 1, 150, 2, 2, 64, 40, cu)


def test_linear_attention_triton_grads_one_query_head_two_v_blocks():
    """One query head per KV head and V = 80 in two V blocks, packed with empty documents: output, final state
    and every gradient as the reference."""
    needs_interpreter()
    check(torch.float32, "cpu", 1, 90, 2, 1, 24, 80, [0, 0, 70, 90, 90])


@pytest.mark.parametrize("shape", [(1, 90, 1, 1, 24, 80, [0, 0, 70, 90, 90]), (2, 70, 1, 1, 128, 128, None)], ids=ids)
def test_linear_attention_triton_grads_with_dv_in_the_dq_pass(monkeypatch, shape):
    """dv made by the dq/dk pass (``linear_bwd.dv_in_dqkwg``) at one query head per KV head: two V blocks, packed
    with empty documents, and the real rule's 128-wide heads: every gradient as the reference."""
    needs_interpreter()
    from linearize.ops.triton import linear_bwd

    monkeypatch.setattr(linear_bwd, "dv_in_dqkwg", lambda layout, E: True)
    check(torch.float32, "cpu", *shape)


def test_dv_in_the_dq_pass_only_at_one_query_head_wide_keys_and_whole_chains(monkeypatch):
    from linearize.ops.triton import linear_bwd
    from linearize.ops.triton.layout import Layout
    from linearize.ops.triton.linear_bwd import dv_in_dqkwg

    def layout(HQ, K, dtype=torch.bfloat16):
        return Layout(torch.zeros(1, 64, HQ, K, dtype=dtype), torch.zeros(1, 64, 2, 64, dtype=dtype), None)

    monkeypatch.setattr(linear_bwd, "DV_IN_DQ", False)
    assert not dv_in_dqkwg(layout(2, 128), 0)  # the switch off: the dv kernel everywhere
    monkeypatch.setattr(linear_bwd, "DV_IN_DQ", True)
    assert dv_in_dqkwg(layout(2, 128), 0) and dv_in_dqkwg(layout(2, 96), 0)
    assert not dv_in_dqkwg(layout(2, 128), 16)  # chains cut
    assert not dv_in_dqkwg(layout(4, 128), 0)  # two query heads per KV head
    assert not dv_in_dqkwg(layout(2, 64), 0) and not dv_in_dqkwg(layout(2, 256), 0)
    assert not dv_in_dqkwg(layout(2, 128, torch.float32), 0)  # 16-bit only


@pytest.mark.parametrize("E", [1, 2])
@pytest.mark.parametrize("shape", [SHAPES[1], (1, 330, 2, 2, 16, 16, [0, 17, 17, 81, 330]), SHAPES[3]], ids=ids)
def test_linear_attention_triton_grads_with_state_chains_cut(monkeypatch, shape, E):
    """The state chains of the forward, its recomputation and the backward cut into segments of E chunks, as a
    GPU cuts a few long sequences (``linear_fwd.linear_segment``): output, final state and every gradient as the
    reference, with and without an initial state and a final state's gradient, documents empty or shorter than
    a segment among them."""
    needs_interpreter()
    from linearize.ops.triton import linear_bwd, linear_fwd

    for module in (linear_fwd, linear_bwd):
        monkeypatch.setattr(module, "linear_segment", lambda layout, device: E)
    check(torch.float32, "cpu", *shape)
    check(torch.float32, "cpu", *shape, h0=False, final=False)


def test_linear_attention_triton_grads_fp16_interpreted(poisoned):
    needs_interpreter()
    check(torch.float16, "cpu", 1, 130, 2, 2, 16, 32, [0, 17, 17, 81, 130])


def test_linear_attention_triton_grads_of_an_all_empty_batch():
    """Every document empty: no chunk to run, the final state's gradient passes to the initial state."""
    needs_interpreter()
    check(torch.float32, "cpu", 1, 0, 2, 2, 8, 8, [0, 0, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES + [(2, 2048, 4, 4, 128, 128, None), (1, 3000, 2, 7, 64, 64, [0, 1000, 1001, 3000]),
                                            (1, 700, 1, 4, 256, 256, None)], ids=ids)
def test_linear_attention_triton_grads_gpu_equal_reference(dtype, shape, compiled):
    check(dtype, "cuda", *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_attention_triton_grads_gpu_dv_in_the_dq_pass(monkeypatch, dtype, compiled):
    """One query head per KV head at 128-wide heads, where the GPU's rule makes dv in the dq/dk pass."""
    from linearize.ops.triton import linear_bwd
    from linearize.ops.triton.layout import Layout
    from linearize.ops.triton.linear_bwd import dv_in_dqkwg

    monkeypatch.setattr(linear_bwd, "DV_IN_DQ", True)
    cu = [0, 700, 701, 3000]
    x = torch.zeros(1, 3000, 2, 128, dtype=dtype)
    assert dv_in_dqkwg(Layout(x, x, torch.tensor(cu)), 0) == (dtype != torch.float32)
    check(dtype, "cuda", 1, 3000, 2, 1, 128, 128, cu)
    check(dtype, "cuda", 2, 1000, 2, 1, 128, 128, None, decay=30.0, h0=False, final=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_attention_triton_grads_gpu_strong_decay_and_no_states(dtype, compiled):
    check(dtype, "cuda", 1, 1000, 2, 2, 64, 64, None, decay=30.0)
    check(dtype, "cuda", 1, 1000, 2, 2, 64, 64, [0, 300, 300, 1000], h0=False, final=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_attention_triton_grads_gpu_state_chains_cut(monkeypatch, dtype, compiled):
    """The GPU's own rule cutting the state chains (a document of 16,384 tokens, 256 chunks, beside a short one,
    two heads), and segments of two chunks forced at a GPU test's shape:
    output, final state and every gradient as the reference."""
    from linearize.ops.triton import linear_bwd, linear_fwd
    from linearize.ops.triton.layout import Layout

    cu = [0, 100, 16484]
    layout = Layout(torch.zeros(1, 16484, 4, 64, device="cuda"), torch.zeros(1, 16484, 2, 64, device="cuda"),
                    torch.tensor(cu, device="cuda"))
    assert layout.longest == 256 and linear_fwd.linear_segment(layout, torch.device("cuda")) == linear_fwd.SEGMENT
    check(dtype, "cuda", 1, 16484, 2, 2, 64, 64, cu)
    for module in (linear_fwd, linear_bwd):
        monkeypatch.setattr(module, "linear_segment", lambda layout, device: 2)
    check(dtype, "cuda", 1, 1000, 2, 2, 64, 64, [0, 300, 300, 1000], decay=30.0)


def test_vala_block_training_on_the_triton_kernels_equals_torch():
    """A converted model's loss and every parameter's gradient on the interpreted forward and backward
    kernels, against the chunkwise PyTorch form (fp32, packed rows through the model's own calls)."""
    from conftest import tiny_model
    from test_vala import blocks, calib, ids

    import linearize

    needs_interpreter()
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, to="linear", calibration_ids=calib(teacher)).train()
    x = ids(model, B=2, T=70)
    found = []
    for backend in ("torch", "triton"):
        for blk in blocks(model):
            blk.options.backend = backend
        model.zero_grad()
        loss = model(x, labels=x).loss
        loss.backward()
        found.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_t, want), (loss_k, got) = found
    assert rel(loss_k, loss_t) <= 1e-6
    assert want.keys() == got.keys() and any("gate_proj" in n for n in got)
    for n in want:
        assert torch.isfinite(got[n]).all() and rel(got[n], want[n]) <= 1e-5, (n, rel(got[n], want[n]))
