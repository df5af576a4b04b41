"""The one-pass forward of the decayed linear attention (ops/triton/linear_fused.py) against the float64
recurrent definition: whole chains and chains cut in segments, under the Triton interpreter (fp16) and
compiled on a CUDA GPU (``-m gpu``, bf16, NaN-poisoned buffers); and the rules that pick it."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import needs_interpreter
from test_linear_triton import SHAPES, check

from linearize.ops.triton import linear_fused
from linearize.ops.triton.layout import Layout

CUT = [SHAPES[1], (1, 330, 2, 2, 16, 16, [0, 17, 17, 81, 330]), (2, 200, 1, 3, 16, 16, None)]


def forced(monkeypatch, E: int) -> list:
    """Every forward takes the one pass with chains of ``E`` chunks (0: whole); the list records each call."""
    calls = []

    def rule(layout, device):
        calls.append(E)
        return E

    monkeypatch.setattr(linear_fused, "fused_segment", rule)
    monkeypatch.setattr(linear_fused, "ONE_PASS", True)
    return calls


def shape_id(s):
    return "x".join(map(str, s[:6])) + ("-packed" if s[6] else "")


@pytest.mark.parametrize("E", [0, 1, 2, 4])
@pytest.mark.parametrize("shape", CUT, ids=shape_id)
def test_linear_fused_forward_equals_reference(monkeypatch, shape, E, poisoned):
    """The one pass over whole chains (E = 0) and over segments of E chunks started from the state the chain
    over the segments gives each: output and final state as the float64 reference, an initial state and a
    value offset given, with a document shorter than a segment, an empty one and GQA among them."""
    needs_interpreter()
    calls = forced(monkeypatch, E)
    check(torch.float16, "cpu", *shape)
    assert calls == [E]


@pytest.mark.parametrize("E", [0, 2])
def test_linear_fused_forward_over_several_v_blocks(monkeypatch, E):
    """V blocks of 16 over V = 32 (two programs per chain, as 64-wide blocks over the real V = 128), packed
    documents, two query heads per KV head."""
    needs_interpreter()
    forced(monkeypatch, E)
    monkeypatch.setattr(linear_fused, "linear_bv", lambda K, V: 16)
    check(torch.float16, "cpu", *SHAPES[2])


def test_only_16_bit_inputs_and_keys_up_to_128_take_the_one_pass(monkeypatch):
    def layout(dtype, K):
        return Layout(torch.zeros(1, 64, 2, K, dtype=dtype), torch.zeros(1, 64, 2, 64, dtype=dtype), None)

    monkeypatch.setattr(linear_fused, "ONE_PASS", False)
    assert not linear_fused.use_fused(layout(torch.bfloat16, 128))  # the switch off: two stages everywhere
    monkeypatch.setattr(linear_fused, "ONE_PASS", True)
    assert linear_fused.use_fused(layout(torch.bfloat16, 128)) and linear_fused.use_fused(layout(torch.float16, 64))
    assert not linear_fused.use_fused(layout(torch.float32, 128))
    assert not linear_fused.use_fused(layout(torch.bfloat16, 256))


def test_fused_segment_cuts_only_chains_too_few_for_the_sms(monkeypatch):
    """On a GPU of 132 SMs (K = V = 128, 16 heads, V blocks of 64): 4×4096 (128 whole-chain programs, ≥ 66)
    and 8×2048 stay whole; 2×8192 and 1×16384 (64, 32) are cut in segments of 16 chunks (512 programs);
    Llama-3-8B's 2×4096 with 8 KV heads in 8 (16 segments: 256); SmolLM2's 4×4096 with 3 KV heads of 64 in
    4 (the least); a single sequence of 4 chunks is not cut; off CUDA nothing is."""
    def layout(B, T, H=16, K=128):
        return Layout(torch.zeros(B, T, H, K), torch.zeros(B, T, H, K), None)

    assert linear_fused.fused_segment(layout(2, 8192), torch.device("cpu")) == 0
    monkeypatch.setattr(linear_fused, "sms_for", lambda programs, device: 132)
    gpu = torch.device("cuda")
    got = {name: linear_fused.fused_segment(lay, gpu) for name, lay in {
        "4x4096": layout(4, 4096), "8x2048": layout(8, 2048), "2x8192": layout(2, 8192), "1x16384": layout(1, 16384),
        "llama": layout(2, 4096, 8), "smollm2": layout(4, 4096, 3, 64), "short": layout(1, 256, 1)}.items()}
    assert got == {"4x4096": 0, "8x2048": 0, "2x8192": 16, "1x16384": 16, "llama": 8, "smollm2": 4, "short": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("E", [0, 4, 16])
@pytest.mark.parametrize("shape", [(2, 2048, 4, 4, 128, 128, None), (1, 3000, 2, 7, 64, 64, [0, 1000, 1001, 3000]),
                                   (1, 5000, 3, 1, 128, 128, [0, 70, 4000, 5000])], ids=shape_id)
def test_linear_fused_forward_gpu_equals_reference(monkeypatch, shape, E):
    from _poison import poisoned_outputs

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("TRITON_INTERPRET=1 interprets the kernels; run the gpu tests with TRITON_INTERPRET=0")
    calls = forced(monkeypatch, E)
    with poisoned_outputs():
        check(torch.bfloat16, "cuda", *shape)
    assert calls == [E]
