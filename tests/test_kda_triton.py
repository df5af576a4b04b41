"""The Triton forward of KDA (ops/triton/kda_fwd.py) against the float64 recurrent definition
(``kda_reference``): interpreted on the CPU (fp32, fp16: the interpreter's bf16 dots are wrong) and compiled
on a CUDA GPU (``-m gpu``, NaN-poisoned buffers, fp32 and bf16), output and final state. Strong decays
(down to e⁻⁵ per step and channel) make a chunk decay by far more than float32's range, so an exp(−G) split
anywhere would overflow."""

from __future__ import annotations

import pytest
import torch
from conftest import needs_interpreter
from test_kda import kda_inputs
from test_linear_ops import rel

from linearize.ops.kda import kda_reference

f64 = torch.float64
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
SHAPES = [  # (B, T, H, G, K, V, cu_seqlens, decay)
    (2, 63, 2, 1, 16, 16, None, 5.0),  # T not a multiple of the chunk, strong decays
    (1, 150, 1, 3, 16, 16, None, 1.0),  # GQA G=3, three chunks
    (1, 130, 2, 2, 16, 32, [0, 17, 17, 81, 130], 5.0),  # packed, an empty document
    (1, 90, 1, 2, 24, 20, [0, 0, 70, 90, 90], 2.0),  # empty first and last documents; K, V not powers of two
    (2, 1, 1, 2, 8, 8, None, 1.0),
    # keys wider than the prepare kernel's 64 channels (kda_fwd.PREPARE_BK): two key blocks, the second masked
    (1, 100, 1, 2, 96, 40, [0, 37, 100], 2.0),
]
ids = lambda s: "x".join(map(str, s[:6])) + ("-packed" if s[6] else "") + f"-decay{s[7]:g}"  # noqa: E731


def check(dtype, device, B, T, H, G, K, V, cu, decay, tol=None):
    N = len(cu) - 1 if cu else B
    q, k, v, g, beta = kda_inputs(B, T, H, G, K, V, seed=T + K + G, decay=decay)
    gen = torch.Generator().manual_seed(1)
    h0 = torch.randn(N, H, K, V, dtype=f64, generator=gen)
    offset = 0.1 * torch.randn(B, T, H, V, dtype=f64, generator=gen)  # small beside o: it must not dilute o's error
    cu_t = torch.tensor(cu) if cu else None
    low = [x.to(dtype) for x in (q, k, v)]  # the kernels' inputs, and the reference on the same rounded values
    g, beta, h0 = g.float(), beta.float(), h0.float()
    dev = lambda x: x.to(device)  # noqa: E731
    # the float64 reference on the kernels' device (on a GPU its steps are launches; on the CPU 2×2048 tokens of
    # sixteen 128-wide heads took minutes a test), compared on the CPU
    ref, h_ref = kda_reference(*(dev(x.double()) for x in (*low, g, beta)), scale=0.7, initial_state=dev(h0.double()),
                               output_final_state=True, cu_seqlens=cu_t)
    ref, h_ref = ref.cpu() + offset.repeat_interleave(G, 2), h_ref.cpu()
    from linearize.ops.triton.kda_fwd import kda_fwd

    q, k, v, g, beta = map(dev, (*low, g, beta))
    o, h, _ = kda_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=0.7, initial_state=dev(h0), output_final_state=True,
                      cu_seqlens=None if cu_t is None else dev(cu_t), v_offset=dev(offset.float()))
    assert o.dtype == dtype and h.dtype == torch.float32
    tol = tol or TOL[dtype]
    for name, got, want in (("o", o, ref), ("final_state", h, h_ref)):
        got = got.double().cpu()
        assert torch.isfinite(got).all(), name
        assert rel(got, want) <= tol, (name, rel(got, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_kda_triton_interpreted_equals_reference(dtype, shape, poisoned):
    needs_interpreter()
    check(dtype, "cpu", *shape)


# every shape compiles the kernels anew (head counts and sizes are constexprs): a few small ones, two at
# real sizes, and Gemma's 256-wide heads among the slow tests
GPU_SHAPES = [SHAPES[0], SHAPES[2], SHAPES[3], (2, 2048, 4, 4, 128, 128, None, 1.0),
              (1, 3000, 2, 7, 64, 64, [0, 1000, 1001, 3000], 5.0),
              pytest.param((1, 700, 1, 4, 256, 256, None, 1.0), marks=pytest.mark.slow, id="1x700x1x4x256x256")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=ids)
def test_kda_triton_gpu_equals_reference(dtype, shape, compiled):
    check(dtype, "cuda", *shape)


def test_state_kernel_launch_follows_programs_against_sms(monkeypatch):
    """The forward state kernel takes (8 warps, 3 stages) only where its programs are no more than the SMs
    and the tiles are 16-bit with keys up to 128 wide (the replays' case): on a GPU of 132 SMs, 2×8192 at 16
    heads of 128 (V blocks of 32: 128 programs) does, 8×2048 (256 programs) keeps (4, 2), as do float32
    tiles and 256-wide keys; off CUDA nothing changes."""
    from linearize.ops.triton import kda_fwd
    from linearize.ops.triton.layout import Layout

    def launch(B, T, K=128, dtype=torch.bfloat16, sms=132):
        monkeypatch.setattr(kda_fwd, "sms_for", lambda programs, device: sms)
        L = Layout(torch.zeros(B, T, 16, K, dtype=dtype), torch.zeros(B, T, 16, 128, dtype=dtype), None)
        return kda_fwd.state_launch(L, kda_fwd.kda_state_bv(L))

    assert launch(2, 8192) == (8, 3)
    assert launch(8, 2048) == (4, 2)
    assert launch(2, 8192, dtype=torch.float32) == (4, kda_fwd.kda_stages(128, True, "state"))
    assert launch(2, 8192, K=256) == (4, 2)
    assert launch(2, 8192, sms=None) == (4, 2)
