"""The Triton forward of the decayed linear attention (ops/triton/linear_fwd.py) against the float64
recurrent definition: under the Triton interpreter on the CPU (fp32, fp16: the interpreter's bf16 dots are
wrong), and compiled on a CUDA GPU (``-m gpu``, NaN-poisoned buffers), output and final state."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import needs_interpreter, tiny_model
from test_convert import incremental_logits
from test_linear_ops import inputs, rel
from test_vala import blocks, calib, ids

import linearize
from linearize.ops.linear import linear_attention, linear_attention_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SHAPES = [  # (B, T, H, G, K, V, cu_seqlens)
    (2, 63, 2, 1, 16, 16, None),
    (1, 150, 2, 3, 32, 16, None),
    (1, 130, 2, 2, 16, 32, [0, 17, 17, 81, 130]),
    (2, 1, 1, 2, 8, 8, None),
]


def check(dtype, device, B, T, H, G, K, V, cu, tol=None):
    N = len(cu) - 1 if cu else B
    q, k, v, g, w, h0 = inputs(B, T, H, G, K, V, seed=T + K, N=N)
    cu_t = torch.tensor(cu) if cu else None
    offset = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    low = [x.to(dtype) for x in (q, k, v)]  # the kernels' inputs, and the reference on the same rounded values
    dev = lambda x: x.to(device)  # noqa: E731
    # the float64 reference on the kernels' device (on a GPU its steps are launches, on the CPU minutes at the
    # real head sizes), compared on the CPU
    ref, h_ref = linear_attention_reference(*(dev(x.double()) for x in low), dev(g), dev(w), scale=0.7,
                                            initial_state=dev(h0), output_final_state=True, cu_seqlens=cu_t)
    ref, h_ref = ref.cpu() + offset.repeat_interleave(G, 2), h_ref.cpu()
    o, h = linear_attention(*map(dev, low), dev(g.float()), dev(w.float()), scale=0.7, initial_state=dev(h0.float()),
                            output_final_state=True, cu_seqlens=None if cu_t is None else dev(cu_t), backend="triton",
                            v_offset=dev(offset.float()))
    assert o.dtype == dtype and h.dtype == torch.float32
    tol = tol or TOL[dtype]
    for name, got, want in (("o", o, ref), ("final_state", h, h_ref)):
        got = got.double().cpu()
        assert torch.isfinite(got).all(), name
        assert rel(got, want) <= tol, (name, rel(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + ("-packed" if s[6] else ""))
def test_linear_attention_triton_interpreted_equals_reference(dtype, shape, poisoned):
    needs_interpreter()
    check(dtype, "cpu", *shape)


@pytest.mark.parametrize("shape", [SHAPES[1], (1, 130, 2, 2, 32, 16, [0, 17, 17, 81, 130])],
                         ids=lambda s: "x".join(map(str, s[:6])) + ("-packed" if s[6] else ""))
def test_linear_state_kernel_split_over_key_blocks(monkeypatch, shape):
    """The forward state kernel with a state's key rows split over programs, as a GPU with more SMs than
    (sequence, head) pairs × V blocks launches it: output and final state as the float64 reference."""
    needs_interpreter()
    from linearize.ops.triton import linear_fwd

    monkeypatch.setattr(linear_fwd, "linear_state_bk", lambda layout, bv, device, chains=None: 16)
    check(torch.float32, "cpu", *shape)


def test_linear_output_kernel_over_several_v_blocks(monkeypatch):
    """The output kernel with each state's value columns in blocks of 16 (V = 32: two, as at the real head sizes,
    where V blocks are 64 wide), packed documents and two query heads per KV head: output and final state as
    the float64 reference."""
    needs_interpreter()
    from linearize.ops.triton import linear_fwd

    monkeypatch.setattr(linear_fwd, "linear_bv", lambda K, V: 16)
    check(torch.float32, "cpu", *SHAPES[2])


def test_linear_state_bk_splits_keys_only_while_programs_leave_sms_idle(monkeypatch):
    """K = V = 128 on a GPU of 132 SMs: one sequence of 16 heads (V blocks of 16: 128 programs) takes K blocks
    of 64; eight sequences keep whole key rows; off CUDA the rows stay whole."""
    from linearize.ops.triton import linear_fwd
    from linearize.ops.triton.layout import Layout

    def layout(B):
        return Layout(torch.zeros(B, 64, 16, 128), torch.zeros(B, 64, 16, 128), None)

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert linear_fwd.linear_state_bk(layout(1), 16, cpu) == 128
    monkeypatch.setattr(linear_fwd, "sms_for", lambda programs, device: 132)
    assert linear_fwd.linear_state_bk(layout(1), 16, gpu) == 64
    assert linear_fwd.linear_state_bk(layout(1), 64, gpu) == 32
    assert linear_fwd.linear_state_bk(layout(8), 64, gpu) == 128


@pytest.mark.parametrize("E", [1, 2])
@pytest.mark.parametrize("shape", [SHAPES[1], (1, 330, 2, 2, 16, 16, [0, 17, 17, 81, 330]), (2, 200, 1, 3, 16, 16, None)],
                         ids=lambda s: "x".join(map(str, s[:6])) + ("-packed" if s[6] else ""))
def test_linear_state_chain_cut_in_segments(monkeypatch, shape, E):
    """The forward's state chain cut into segments of E chunks (each segment's own state and decay, the chain
    over the segments, each segment again from its entering state), as a GPU cuts a few long sequences:
    output and final state as the float64 reference, an initial state given, with a document shorter than a
    segment, an empty one and segments of one chunk among them."""
    needs_interpreter()
    from linearize.ops.triton import linear_fwd

    monkeypatch.setattr(linear_fwd, "linear_segment", lambda layout, device: E)
    check(torch.float32, "cpu", *shape)
    check(torch.float16, "cpu", *shape)


def test_linear_segment_cuts_only_few_long_chains(monkeypatch):
    """On a GPU of 132 SMs one sequence of 16 KV heads and 16K tokens (256 chunks) is cut into segments, eight
    such sequences too (128 pairs); nine (144 pairs) fill the SMs whole, and 8K tokens (128 chunks) are too few
    to cut; off CUDA nothing is cut."""
    from linearize.ops.triton import linear_fwd
    from linearize.ops.triton.layout import Layout

    def layout(B, T, cu=None):
        return Layout(torch.zeros(B, T, 16, 128), torch.zeros(B, T, 16, 128), cu)

    assert linear_fwd.linear_segment(layout(1, 16384), torch.device("cpu")) == 0
    monkeypatch.setattr(linear_fwd, "sms_for", lambda programs, device: 132)
    gpu = torch.device("cuda")
    assert linear_fwd.linear_segment(layout(1, 16384), gpu) == linear_fwd.SEGMENT
    assert linear_fwd.linear_segment(layout(8, 16384), gpu) == linear_fwd.SEGMENT
    assert linear_fwd.linear_segment(layout(9, 16384), gpu) == 0
    assert linear_fwd.linear_segment(layout(1, 8192), gpu) == 0
    packed = layout(1, 16384 + 100, torch.tensor([0, 100, 16384 + 100]))
    assert packed.longest == 256 and linear_fwd.linear_segment(packed, gpu) == linear_fwd.SEGMENT


def test_linear_attention_triton_takes_gradients():
    """backend='triton' differentiates through the backward kernels (tests/test_linear_triton_bwd.py checks
    their values); 'auto' off CUDA stays on the chunkwise PyTorch form."""
    needs_interpreter()
    q, k, v, g, w, _ = inputs(1, 20, 2, 2, 8, 8, seed=0, dtype=torch.float32)
    q.requires_grad_(True)
    o, _ = linear_attention(q, k, v, g, w, backend="triton")
    assert type(o.grad_fn).__name__ == "LinearAttentionFunctionBackward"
    o, _ = linear_attention(q, k, v, g, w)
    assert o.requires_grad and type(o.grad_fn).__name__ != "LinearAttentionFunctionBackward"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES + [(2, 2048, 4, 4, 128, 128, None), (1, 3000, 2, 7, 64, 64, [0, 1000, 1001, 3000]),
                                            (1, 700, 1, 4, 256, 256, None)],
                         ids=lambda s: "x".join(map(str, s[:6])) + ("-packed" if s[6] else ""))
def test_linear_attention_triton_gpu_equals_reference(dtype, shape):
    from _poison import poisoned_outputs

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 interprets the kernels; run the gpu tests with TRITON_INTERPRET=0")
    with poisoned_outputs():
        check(dtype, "cuda", *shape)


def test_vala_block_on_the_triton_forward_equals_torch():
    """A converted model's inference (full forward, prefill + decode from the cache) on the interpreted kernels."""
    needs_interpreter()
    teacher = tiny_model("llama")
    model = linearize.convert(teacher, to="linear", calibration_ids=calib(teacher))
    x = ids(model, B=2, T=70)
    mask, pos = torch.ones_like(x), torch.arange(70)[None].expand(2, -1)
    with torch.no_grad():
        want = model(x).logits
        for blk in blocks(model):
            blk.options.backend = "triton"
        assert rel(model(x).logits, want) <= 1e-5
        inc, _ = incremental_logits(model, x, mask, pos, prefill=66)
        assert rel(inc, want) <= 1e-5
