"""The Triton backward of KDA (ops/triton/kda_bwd.py): output, final state and the gradients of q, k, v, the
per-channel g, beta, the initial state and v_offset against autograd through the float64 recurrent
definition (``kda_reference``) — interpreted on the CPU (fp32; fp16: the interpreter's bf16 dots are wrong)
and compiled on a CUDA GPU (``-m gpu``, NaN-poisoned buffers, fp32 and bf16)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _calls import counted_calls
from conftest import needs_interpreter
from test_kda import kda_inputs
from test_kda_triton import GPU_SHAPES, SHAPES, TOL, ids
from test_linear_ops import rel

from linearize.ops.kda import kda_reference

f64 = torch.float64
NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0", "dv_offset"]


def grads(fn, q, k, v, g, beta, h0, offset, cu, *, final=True, seed=11):
    """Output, final state and every input's gradient under a random loss on both (None where not used).
    ``fn`` None: the reference, with ``v_offset`` added after it."""
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None
              for x in (q, k, v, g, beta, h0, offset)]
    kw = dict(scale=0.7, initial_state=leaves[5], output_final_state=final, cu_seqlens=cu)
    if fn is None:
        o, h = kda_reference(*leaves[:5], **kw)
        o = o + leaves[6].repeat_interleave(q.shape[2] // k.shape[2], 2)
    else:
        o, h = fn(*leaves[:5], v_offset=leaves[6], **kw)
    gen = torch.Generator().manual_seed(seed)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=f64).to(o.device)).sum()
    if final:
        loss = loss + (h.double() * torch.randn(h.shape, generator=gen, dtype=f64).to(h.device)).sum()
    loss.backward()
    return [o.detach(), h.detach() if final else None] + [x.grad if x is not None else None for x in leaves]


def check(dtype, device, B, T, H, G, K, V, cu, decay, *, h0=True, final=True, tol=None):
    from linearize.ops.triton.kda_bwd import kda_triton

    N = len(cu) - 1 if cu else B
    q, k, v, g, beta = kda_inputs(B, T, H, G, K, V, seed=T + K + G, decay=decay)
    gen = torch.Generator().manual_seed(1)
    s0 = torch.randn(N, H, K, V, dtype=f64, generator=gen).float() if h0 else None
    offset = torch.randn(B, T, H, V, dtype=f64, generator=gen)
    cu_t = torch.tensor(cu) if cu else None
    q, k, v, offset = (x.to(dtype) for x in (q, k, v, offset))  # the kernels' inputs, the reference's values
    g, beta = g.float(), beta.float()
    dev = lambda x: x.to(device) if x is not None else None  # noqa: E731
    # the float64 reference on the kernels' device (test_kda_triton.check says why), compared on the CPU
    ref = grads(None, *(dev(x.double()) if x is not None else None for x in (q, k, v, g, beta, s0, offset)), cu_t,
                final=final)
    ref = [x.cpu() if x is not None else None for x in ref]
    got = grads(kda_triton, *map(dev, (q, k, v, g, beta, s0, offset, cu_t)), final=final)
    tol = tol or TOL[dtype]
    for name, a, b in zip(NAMES, got, ref):
        a, b = (None if x is None or x.numel() == 0 else x for x in (a, b))  # no token: the loop leaves None
        assert (a is None) == (b is None), name
        if a is None:
            continue
        a = a.double().cpu()
        assert torch.isfinite(a).all(), name
        assert rel(a, b) <= tol, (name, rel(a, b))
    assert got[2].dtype == dtype and got[5].dtype == torch.float32 and (not h0 or got[7].dtype == torch.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_kda_triton_grads_interpreted_equal_reference(shape, poisoned):
    needs_interpreter()
    check(torch.float32, "cpu", *shape)


@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[3]], ids=ids)
def test_kda_triton_grads_interpreted_fp16(shape, poisoned):
    needs_interpreter()
    check(torch.float16, "cpu", *shape)


def test_kda_triton_grads_without_states():
    """No initial state and no final state: dh0 is None, and the state's gradient starts from zero."""
    needs_interpreter()
    check(torch.float32, "cpu", 1, 70, 1, 2, 16, 16, None, 3.0, h0=False, final=False)


def test_kda_triton_grads_channel_slices():
    """Keys wider than one slice of ``_intra_bwd_kernel`` (32 channels): K = 72 takes three, the last one mostly
    masked; packed documents and two query heads per KV head."""
    needs_interpreter()
    check(torch.float32, "cpu", 1, 100, 1, 2, 72, 16, [0, 30, 100], 3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kda_backward_from_the_kept_forward_equals_the_one_that_computes_it_again(dtype, monkeypatch):
    """With the forward's prepare and state outputs kept (``KEEP_FORWARD``), the backward runs neither again
    and its outputs are the very values of the backward that computes them again (fp16 through the prepare
    kernel's scale·γ⊙q written by the forward's pass); a forward that wants no gradient keeps nothing."""
    needs_interpreter()
    from linearize.ops.triton import kda_bwd
    from linearize.ops.triton.kda_bwd import kda_triton

    q, k, v, g, beta = kda_inputs(1, 100, 1, 2, 32, 16, seed=5, decay=3.0)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    g, beta = g.float(), beta.float()
    h0 = torch.randn(2, 1, 32, 16, generator=torch.Generator().manual_seed(2))
    offset = torch.randn(1, 100, 1, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    cu = torch.tensor([0, 40, 100])
    calls = counted_calls(monkeypatch, kda_bwd, ["kda_prepare", "kda_states"])  # the backward's own calls
    monkeypatch.setattr(kda_bwd, "KEEP_FORWARD", False)
    again = grads(kda_triton, q, k, v, g, beta, h0, offset, cu)
    assert calls == {"kda_prepare": 1, "kda_states": 1}
    monkeypatch.setattr(kda_bwd, "KEEP_FORWARD", True)
    kept = grads(kda_triton, q, k, v, g, beta, h0, offset, cu)
    assert calls == {"kda_prepare": 1, "kda_states": 1}  # none more
    for name, a, b in zip(NAMES, kept, again):
        assert (a is None and b is None) or torch.equal(a, b), name
    # nothing kept where autograd will not differentiate: under no_grad with leaves that require gradients,
    # and with gradients on but no leaf requiring one; the output the same
    asked = []
    real_fwd = kda_bwd.kda_fwd
    monkeypatch.setattr(kda_bwd, "kda_fwd", lambda **kw: asked.append(kw["keep"]) or real_fwd(**kw))
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, g, beta, h0, offset)]
    with torch.no_grad():
        o, _ = kda_triton(*leaves[:5], scale=0.7, initial_state=leaves[5], output_final_state=True, cu_seqlens=cu,
                          v_offset=leaves[6])
    o2, _ = kda_triton(q, k, v, g, beta, scale=0.7, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                       v_offset=offset)
    assert asked == [False, False] and torch.equal(o, kept[0]) and torch.equal(o2, kept[0])


def test_gated_delta_rule_routes_a_per_channel_g_to_the_kernels():
    """``gated_delta_rule(backend="triton")`` with a per-channel g differentiates through the KDA kernels
    (equal to the chunkwise PyTorch form); ``"auto"`` off CUDA keeps the PyTorch form."""
    needs_interpreter()
    from linearize.ops import gated_delta_rule

    q, k, v, g, beta = (x.float() for x in kda_inputs(1, 20, 2, 2, 8, 8, seed=0, decay=2.0))
    q.requires_grad_(True)
    o, _ = gated_delta_rule(q, k, v, g, beta, backend="triton")
    assert type(o.grad_fn).__name__ == "KDAFunctionBackward"
    want, _ = gated_delta_rule(q, k, v, g, beta)
    assert type(want.grad_fn).__name__ != "KDAFunctionBackward"
    assert rel(o.detach().double(), want.detach().double()) <= 1e-5


def test_a_16_bit_backward_is_refused_where_ptxas_miscompiles_it(monkeypatch):
    """ptxas 12.8 (Triton 3.6's) miscompiles the backward's 16-bit tensor-core products: a CUDA bf16/fp16
    call that will want gradients is refused with what to do; fp32, ptxas 12.9+ and the CPU go on."""
    import linearize.ops.triton.kda_bwd as kb

    cuda = torch.device("cuda")
    monkeypatch.setattr(kb, "ptxas_version", lambda: (12, 8))
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(RuntimeError, match="needs ptxas >= 12.9.*TRITON_PTXAS_PATH"):
            kb.check_backward_compiler(dtype, cuda)
        assert not kb.backward_compiles(dtype, cuda)  # backend="auto" trains these through PyTorch
    kb.check_backward_compiler(torch.float32, cuda)
    kb.check_backward_compiler(torch.bfloat16, torch.device("cpu"))
    assert kb.backward_compiles(torch.float32, cuda) and kb.backward_compiles(torch.bfloat16, torch.device("cpu"))
    for version in ((12, 9), (13, 0), None):
        monkeypatch.setattr(kb, "ptxas_version", lambda v=version: v)
        kb.check_backward_compiler(torch.bfloat16, cuda)
        assert kb.backward_compiles(torch.bfloat16, cuda)


def fake_ptxas(path, release: str):
    """An executable at ``path`` that answers ``--version`` as CUDA's ptxas does, with ``release``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho 'ptxas: NVIDIA (R) Ptx optimizing assembler'\n"
                    f"echo 'Cuda compilation tools, release {release}, V{release}.88'\necho 'Build cuda_{release}'\n")
    path.chmod(0o755)
    return path


def test_a_ptxas_release_is_read_off_its_version_line(tmp_path):
    """The release of a ptxas comes off ``ptxas --version`` (CUDA's lines); None where there is none to ask."""
    from linearize.ops.triton.ptxas import ptxas_release

    assert ptxas_release(fake_ptxas(tmp_path / "a" / "ptxas", "13.0")) == (13, 0)
    assert ptxas_release(fake_ptxas(tmp_path / "b" / "ptxas", "12.8")) == (12, 8)
    assert ptxas_release(tmp_path / "missing") is None


def test_the_refusal_and_the_fallback_name_a_newer_toolkit_ptxas(monkeypatch, tmp_path):
    """Where Triton's ptxas miscompiles the 16-bit backward, the refusal (``backend="triton"``) and the warning
    of ``backend="auto"``'s PyTorch fallback (once a dtype) name the CUDA toolkit's ptxas when it is 12.9+
    (``$CUDA_HOME/bin``), and say what to look for when it is older or absent."""
    import warnings

    import linearize.ops.triton.kda_bwd as kb
    from linearize.ops.triton import ptxas

    monkeypatch.setattr(kb, "ptxas_version", lambda: (12, 8))
    cuda = torch.device("cuda")
    for release, named in (("13.0", True), ("12.8", False), (None, False)):
        home = tmp_path / str(release)
        if release:
            fake_ptxas(home / "bin" / "ptxas", release)
        monkeypatch.setenv("CUDA_HOME", str(home))
        ptxas.toolkit_ptxas.cache_clear()
        kb.warn_torch_backward.cache_clear()
        with pytest.raises(RuntimeError) as refused:
            kb.check_backward_compiler(torch.bfloat16, cuda)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            kb.warn_torch_backward(torch.bfloat16)
            kb.warn_torch_backward(torch.bfloat16)  # once
        assert len(said) == 1 and "PyTorch chunkwise form" in str(said[0].message)
        for line in (str(refused.value), str(said[0].message)):
            assert ("ptxas 12.8" in line) and ("TRITON_PTXAS_PATH" in line)
            assert (f"TRITON_PTXAS_PATH={home / 'bin' / 'ptxas'}" in line) == named
    ptxas.toolkit_ptxas.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_trains_a_16_bit_kda_through_pytorch_where_ptxas_miscompiles_it(monkeypatch):
    """``backend="auto"`` on CUDA, bf16, gradients wanted, under a ptxas that would miscompile the kernels'
    backward: the chunkwise PyTorch form, with the warning; without gradients, the kernels."""
    import linearize.ops.triton.kda_bwd as kb
    from linearize.ops import gated_delta_rule

    monkeypatch.setattr(kb, "ptxas_version", lambda: (12, 8))
    kb.warn_torch_backward.cache_clear()
    q, k, v, g, beta = (x.float().cuda() for x in kda_inputs(1, 70, 2, 1, 32, 32, seed=3, decay=1.0))
    q, k, v = (x.bfloat16() for x in (q, k, v))
    with pytest.warns(UserWarning, match="PyTorch chunkwise form.*ptxas 12.8"):
        o, _ = gated_delta_rule(q.requires_grad_(), k, v, g, beta, backend="auto")
    assert type(o.grad_fn).__name__ != "KDAFunctionBackward"
    with torch.no_grad():
        o, _ = gated_delta_rule(q, k, v, g, beta, backend="auto")
    want, _ = gated_delta_rule(q, k, v, g, beta, backend="triton")
    assert torch.equal(o, want)
    kb.warn_torch_backward.cache_clear()


def test_the_backward_compiler_is_asked_before_a_forward_that_will_want_gradients(monkeypatch):
    """``kda_triton`` checks the backward's compiler before its forward runs, and only when gradients will follow."""
    import linearize.ops.triton.kda_bwd as kb

    needs_interpreter()
    asked = []
    monkeypatch.setattr(kb, "check_backward_compiler", lambda dtype, device: asked.append((dtype, device.type)))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 20, 1, 16, generator=gen) for _ in range(3))
    g = -torch.rand(1, 20, 1, 16, generator=gen)
    beta = torch.rand(1, 20, 1, generator=gen)
    with torch.no_grad():
        kb.kda_triton(q, k, v, g, beta)
    assert asked == []
    kb.kda_triton(q, k.requires_grad_(), v, g, beta)
    assert asked == [(torch.float32, "cpu")]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=ids)
def test_kda_triton_grads_gpu_equal_reference(dtype, shape, compiled):
    check_on_gpu(dtype, shape)


def check_on_gpu(dtype, shape):
    """:func:`check` on CUDA; where Triton's ptxas would miscompile a 16-bit backward (conftest.py hands the
    tests a newer one where it finds it), that the call is refused, then a skip that says so."""
    from linearize.ops.triton.kda_bwd import backward_compiles, ptxas_version

    if not backward_compiles(dtype, torch.device("cuda")):
        with pytest.raises(RuntimeError, match="needs ptxas >= 12.9"):
            check(dtype, "cuda", *shape)
        pytest.skip(f"ptxas {ptxas_version()} miscompiles the 16-bit backward (refused); set TRITON_PTXAS_PATH to 12.9+")
    check(dtype, "cuda", *shape)


def switch_runs_in_each_pass(flag, shape, dtype, monkeypatch):
    """``kda_fwd.<flag>`` off in both passes, on in the forward's launches alone and in the backward's alone, on
    ``shape``'s inputs: the forward's output and q's gradient of each, asserted to show that the switch changed
    the forward's bits (on in the forward) and the backward's (on in the backward) and nothing else."""
    from linearize.ops.triton import kda_fwd
    from linearize.ops.triton.kda_bwd import kda_triton

    inputs = [x.to(dtype) if i < 3 else x.float() for i, x in enumerate(kda_inputs(*shape[:6], seed=3, decay=shape[7]))]

    def output_and_dq(forward, backward):
        leaves = [x.clone().requires_grad_(True) for x in inputs]
        monkeypatch.setattr(kda_fwd, flag, forward)
        o = kda_triton(*leaves, scale=0.7)[0]
        monkeypatch.setattr(kda_fwd, flag, backward)
        (o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum().backward()
        return o.detach(), leaves[0].grad

    off, on_forward, on_backward = output_and_dq(False, False), output_and_dq(True, False), output_and_dq(False, True)
    assert not torch.equal(on_forward[0], off[0])
    assert torch.equal(on_backward[0], off[0]) and not torch.equal(on_backward[1], off[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sub_chunk_dots_equal_reference_and_differ_from_the_steps(dtype, monkeypatch):
    """The pairs inside the sub-chunks as dots through anchored offsets (``kda_fwd.SUB_CHUNK_DOTS``): forward and
    every gradient against the float64 reference, where the spans allow them (decays down to e⁻¹ a step: the
    dots), where they do not (e⁻⁵: the row-by-row steps, in the programs whose span passes the limit) and on
    packed documents; the mild case's outputs differ from the steps' in their last bits (the dots ran); with
    no limit, the strong decays' factors leave fp16 and the result with them (the limit is what keeps it)."""
    needs_interpreter()
    from linearize.ops.triton import kda_fwd
    from linearize.ops.triton.kda_bwd import kda_triton

    mild, strong, packed = SHAPES[1], SHAPES[0], SHAPES[2]
    monkeypatch.setattr(kda_fwd, "CHUNK_DOTS", False)  # the sub-chunk dots alone, never the whole chunk's
    switch_runs_in_each_pass("SUB_CHUNK_DOTS", mild, dtype, monkeypatch)
    monkeypatch.setattr(kda_fwd, "SUB_CHUNK_DOTS", True)
    for shape in (mild, strong, packed):
        check(dtype, "cpu", *shape)
    if dtype == torch.float16:  # the strong decays' factors, unbounded, leave fp16: inf and NaN come out
        monkeypatch.setitem(kda_fwd.SUB_CHUNK_SPAN, torch.float16, float("inf"))
        x = [t.to(dtype) if i < 3 else t.float() for i, t in enumerate(kda_inputs(*strong[:6], seed=5, decay=strong[7]))]
        assert not torch.isfinite(kda_triton(*x, scale=0.7)[0]).all()


MILD = [(1, 150, 1, 3, 16, 16, None, 0.1), (1, 130, 2, 2, 16, 32, [0, 17, 17, 81, 130], 0.1)]  # GQA G=3; packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunk_dots_equal_reference_and_differ_from_the_sub_chunk_dots(dtype, monkeypatch):
    """Every pair of a chunk as one dot through offsets from its middle row (``kda_fwd.CHUNK_DOTS``, a program's
    mode 2): forward and every gradient against the float64 reference where the chunks' spans allow it (decays
    down to e^-0.1 a step: GQA, packed documents), where only the sub-chunks' do (e^-1) and where neither (e^-5:
    the steps); on the mild decays the forward's outputs and the backward's gradients each differ from the
    sub-chunk dots' in their last bits (mode 2 ran in each)."""
    needs_interpreter()
    from linearize.ops.triton import kda_fwd

    switch_runs_in_each_pass("CHUNK_DOTS", MILD[0], dtype, monkeypatch)
    monkeypatch.setattr(kda_fwd, "CHUNK_DOTS", True)
    for shape in (*MILD, SHAPES[1], SHAPES[0]):
        check(dtype, "cpu", *shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [*MILD, SHAPES[2], (2, 2048, 4, 4, 128, 128, None, 0.1)], ids=ids)
def test_chunk_dots_gpu_equal_reference(shape, monkeypatch, compiled):
    """Every pair of a chunk as one dot (``kda_fwd.CHUNK_DOTS``) compiled, bf16: forward and every gradient against
    the float64 reference on mild decays (mode 2), strong ones (the sub-chunks or the steps) and a real head size."""
    from linearize.ops.triton import kda_fwd

    monkeypatch.setattr(kda_fwd, "CHUNK_DOTS", True)
    check_on_gpu(torch.bfloat16, shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], GPU_SHAPES[3]], ids=ids)
def test_sub_chunk_dots_gpu_equal_reference(shape, monkeypatch, compiled):
    """The dots inside the sub-chunks compiled (``kda_fwd.SUB_CHUNK_DOTS``), bf16: forward and every gradient
    against the float64 reference, on strong decays (the steps in most programs), packed documents, and a real
    head size."""
    from linearize.ops.triton import kda_fwd

    monkeypatch.setattr(kda_fwd, "SUB_CHUNK_DOTS", True)
    monkeypatch.setattr(kda_fwd, "CHUNK_DOTS", False)
    check_on_gpu(torch.bfloat16, shape)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flushed_exps_gpu_equal_reference(compiled):
    """The decays' exps as one ex2 with denormals flushed (``tiles.FLUSH_EXP``), bf16: forward and every gradient
    against the float64 reference on strong decays (factors far below e^-87), packed documents and a real head
    size — in a process of its own, since the flag is read when the kernels compile."""
    code = ("import torch, triton.language as tl\n"
            "from linearize.ops.triton import tiles\n"
            "tiles.FLUSH_EXP = tl.constexpr(True)\n"
            "from test_kda_triton import GPU_SHAPES, SHAPES\n"
            "from test_kda_triton_bwd import check\n"
            "for shape in (SHAPES[0], SHAPES[2], GPU_SHAPES[3]):\n"
            "    check(torch.bfloat16, 'cuda', *shape)\n")
    tests = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=900)
