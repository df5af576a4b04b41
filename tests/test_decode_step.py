"""The fused decode step (``linearize.ops.decode``) against the composed reference — ``taylor_front`` for one
token with carried running sums, ``gated_delta_rule_step``, ``taylor_back`` — in float64: the PyTorch body
in float64, the Triton kernel under TRITON_INTERPRET=1 (conftest.py) in fp32 and with fp16 inputs, on fresh
random inputs; and T steps from a zero state against the whole-sequence path at every position. The
kernel's output is allocated NaN-poisoned, so an element it never writes fails. The gpu tests at the end
run the compiled kernel in bf16 and fp32 (and under a CUDA graph) on a GPU."""

from __future__ import annotations

import pytest
import torch

from linearize.ops import gated_delta_rule, gated_delta_rule_step, taylor_back, taylor_front
from linearize.ops.decode import taylor_gdn_step_
from linearize.ops.taylor import RunningSums

f64 = torch.float64
BETA_MAX = 1.0
CASES = [  # (N, H, G, K, V, counts before the step)
    (1, 2, 1, 64, 64, [0]),  # t = 1: no state update, o = hᵀq + v
    (3, 2, 3, 64, 64, [0, 1, 37]),  # GQA, t = 1 and t = 2 in one batch
    (2, 2, 2, 128, 128, [5, 100_000]),  # a long context: β small, α close to 1
    (2, 1, 4, 40, 48, [3, 9]),  # K and V not powers of two (masked lanes)
    (1, 1, 4, 256, 256, [17]),  # Gemma 3's head_dim: several V tiles
]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def step_inputs(N, H, G, K, V, counts, seed, mask=None):
    """Fresh random inputs of one step (float64): keys with a shared offset, as real keys have; running sums
    whose means are near that offset; a random state; corrections around their identity value."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=f64)  # noqa: E731
    count = torch.tensor(counts, dtype=f64)
    spread = count.clamp_min(1).sqrt()[:, None, None]
    return dict(
        q=rn(N, H * G, K), k=rn(N, H, K) + 0.5, v=rn(N, H, V) + 0.2,
        state=0.1 * rn(N, H, K, V),
        sum_k=count[:, None, None] * (0.5 + rn(N, H, K) / spread),
        sum_v=count[:, None, None] * (0.2 + rn(N, H, V) / spread),
        count=count,
        rho=0.5 + torch.rand(H, generator=gen, dtype=f64),
        beta_factor=2 * torch.sigmoid(rn(N, H)), gate_factor=torch.exp(0.3 * rn(N, H)),
        beta_max=BETA_MAX, scale=K**-0.5, mask=mask,
    )


def composed(x):
    """The reference: taylor_front (one token, carried sums) → gated_delta_rule_step → taylor_back, in float64.
    Returns ``(o, state, sum_k, sum_v, count)``."""
    d = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    q = d["q"] * d["scale"]
    mask = d["mask"][:, None] if d["mask"] is not None else None
    front = taylor_front(q[:, None], d["k"][:, None], d["v"][:, None], form="stable", rho=d["rho"],
                         beta_max=d["beta_max"], beta_factor=d["beta_factor"][:, None], mask=mask,
                         initial=RunningSums(d["sum_k"], d["sum_v"], d["count"]))
    g = front.g * d["gate_factor"][:, None]
    o, h = gated_delta_rule_step(q, front.k[:, 0], front.v[:, 0], g[:, 0], front.beta[:, 0], d["state"])
    o = taylor_back(o[:, None], front.v_mean)[:, 0]
    return o, h, front.sums.k, front.sums.v, front.sums.count


def cast(x, dtype, state_dtype):
    """q, k, v in ``dtype``; the state, sums and count (updated in place) in ``state_dtype``; the factors float32
    (float64 with a float64 state)."""
    small = torch.float64 if state_dtype == f64 else torch.float32
    out = dict(x)
    for n in ("q", "k", "v"):
        out[n] = x[n].to(dtype)
    for n in ("state", "sum_k", "sum_v", "count"):
        out[n] = x[n].to(state_dtype).clone()
    for n in ("rho", "beta_factor", "gate_factor"):
        out[n] = x[n].to(small)
    return out


def run_step(x, backend):
    args = [x[n] for n in ("q", "k", "v", "state", "sum_k", "sum_v", "count", "rho", "beta_factor", "gate_factor",
                           "beta_max", "scale")]
    return taylor_gdn_step_(*args, mask=x["mask"], backend=backend)


def check_step(x, backend, tol_o, tol_state):
    """One step on ``x`` (cast already) against :func:`composed` on the same (rounded) values; returns the errors."""
    ref = composed(x)
    o = run_step(x, backend)
    assert o.dtype == x["v"].dtype and o.shape == ref[0].shape
    assert torch.isfinite(o).all()
    errs = {"o": rel(o, ref[0]), "state": rel(x["state"], ref[1]), "sum_k": rel(x["sum_k"], ref[2]),
            "sum_v": rel(x["sum_v"], ref[3])}
    assert torch.equal(x["count"].double(), ref[4])
    assert errs["o"] < tol_o, errs
    assert max(errs["state"], errs["sum_k"], errs["sum_v"]) < tol_state, errs
    return errs


def masks(N):
    """No mask, and one with the first sequence a padding step (the rest real)."""
    return [None, torch.tensor([False] + [True] * (N - 1))]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_mask", [False, True])
def test_torch_step_equals_composed_reference(case, with_mask):
    N, H, G, K, V, counts = case
    x = step_inputs(N, H, G, K, V, counts, seed=K + V + N, mask=masks(N)[with_mask])
    check_step(cast(x, f64, f64), "torch", 1e-12, 1e-12)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_mask", [False, True])
@pytest.mark.parametrize("dtype, tol_o", [(torch.float32, 1e-5), (torch.float16, 5e-4)])
def test_triton_step_equals_composed_reference(poisoned, case, with_mask, dtype, tol_o):
    """fp32: the kernel's own float32 error; fp16 inputs: plus the output's one rounding to fp16 (≤ 2⁻¹¹ of it)."""
    N, H, G, K, V, counts = case
    x = step_inputs(N, H, G, K, V, counts, seed=3 * K + V + N, mask=masks(N)[with_mask])
    check_step(cast(x, dtype, torch.float32), "triton", tol_o, 1e-5)


def test_padding_step_leaves_everything_untouched():
    """A padding step updates nothing, bit for bit, and returns hᵀ(scale·q) + Σv/max(count, 1)."""
    x = cast(step_inputs(2, 2, 2, 16, 16, [0, 6], seed=1, mask=torch.tensor([False, False])), f64, f64)
    before = {n: x[n].clone() for n in ("state", "sum_k", "sum_v", "count")}
    o = run_step(x, "torch")
    for n, t in before.items():
        assert torch.equal(x[n], t), n
    want = torch.einsum("nhkv,nhgk->nhgv", before["state"], x["q"].view(2, 2, 2, 16) * x["scale"])
    want = want + (before["sum_v"] / before["count"].clamp_min(1)[:, None, None])[:, :, None]
    assert rel(o, want.reshape(2, 4, 16)) < 1e-14


def sequence_inputs(B, T, H, G, K, V, seed):
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=f64)  # noqa: E731
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    mask[1, 9] = False  # and a hole
    return dict(q=rn(B, T, H * G, K), k=rn(B, T, H, K) + 0.5, v=rn(B, T, H, V), rho=0.5 + torch.rand(H, generator=gen,
                dtype=f64), beta_factor=2 * torch.sigmoid(rn(B, T, H)), gate_factor=torch.exp(0.3 * rn(B, T, H)),
                mask=mask, scale=K**-0.5)


def whole_sequence(s):
    """taylor_front over the whole sequence → the reference GDN loop → taylor_back, in float64."""
    q = s["q"] * s["scale"]
    front = taylor_front(q, s["k"], s["v"], form="stable", rho=s["rho"], beta_max=BETA_MAX,
                         beta_factor=s["beta_factor"], mask=s["mask"])
    o, h = gated_delta_rule(q, front.k, front.v, front.g * s["gate_factor"], front.beta, output_final_state=True,
                            backend="reference")
    return taylor_back(o, front.v_mean), h, front.sums


def steps_against_whole_sequence(backend, dtype, tol_o, tol_state, device="cpu"):
    """T steps from a zero state (padding included) against :func:`whole_sequence` on the same rounded q, k, v:
    the output at every position, the final state, the running sums and the count."""
    B, T, H, G, K, V = 2, 24, 2, 2, 32, 64
    s = sequence_inputs(B, T, H, G, K, V, seed=11)
    s.update({n: s[n].to(dtype).double() for n in ("q", "k", "v")})
    ref_o, ref_h, ref_sums = whole_sequence(s)
    sd = f64 if dtype == f64 else torch.float32
    s = {n: (x.to(device) if torch.is_tensor(x) else x) for n, x in s.items()}
    z = lambda *shape: torch.zeros(*shape, dtype=sd, device=device)  # noqa: E731
    state, sum_k, sum_v, count = z(B, H, K, V), z(B, H, K), z(B, H, V), z(B)
    outs = []
    for t in range(T):
        outs.append(taylor_gdn_step_(
            s["q"][:, t].to(dtype), s["k"][:, t].to(dtype), s["v"][:, t].to(dtype), state, sum_k, sum_v, count,
            s["rho"].to(sd), s["beta_factor"][:, t].to(sd), s["gate_factor"][:, t].to(sd), BETA_MAX, s["scale"],
            mask=s["mask"][:, t], backend=backend))
    o = torch.stack(outs, 1).cpu()
    errs = [rel(o[:, t], ref_o[:, t]) for t in range(T)]
    assert max(errs) < tol_o, errs
    finals = [rel(state.cpu(), ref_h), rel(sum_k.cpu(), ref_sums.k), rel(sum_v.cpu(), ref_sums.v)]
    assert max(finals) < tol_state, finals
    assert torch.equal(count.cpu().double(), ref_sums.count)


@pytest.mark.parametrize("backend, dtype, tol", [("torch", f64, 1e-12), ("triton", torch.float32, 1e-5),
                                                 ("triton", torch.float16, 5e-4)])
def test_steps_from_zero_equal_whole_sequence(poisoned, backend, dtype, tol):
    steps_against_whole_sequence(backend, dtype, tol, 1e-12 if dtype == f64 else 1e-5)


def test_auto_backend_off_cuda_is_torch_and_rejects_bad_shapes():
    x = cast(step_inputs(1, 2, 1, 8, 8, [2], seed=0), torch.float32, torch.float32)
    o = run_step(x, "auto")
    assert o.shape == (1, 2, 8)
    x = cast(step_inputs(1, 2, 1, 8, 8, [2], seed=0), torch.float32, torch.float32)
    x["state"] = x["state"].transpose(-1, -2)  # not contiguous: the kernel could not update it in place
    with pytest.raises(ValueError, match="contiguous"):
        run_step(x, "triton")


# ---- on a GPU: the compiled kernel ------------------------------------------------------------------------
GPU_CASES = [  # many programs at once, so the last-arriver update of Σk and count runs concurrently
    (64, 8, 4, 128, 128, None),
    (8, 3, 3, 64, 64, None),
    (4, 1, 4, 256, 256, None),
    (16, 4, 2, 128, 128, "mask"),
]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu_inputs(case, seed):
    N, H, G, K, V, m = case
    counts = [(i * 7919) % 5000 if i % 5 else 0 for i in range(N)]  # t = 1 and long contexts mixed
    mask = (torch.arange(N) % 3 != 1) if m else None
    x = step_inputs(N, H, G, K, V, counts, seed=seed, mask=mask)
    return {n: (t.cuda() if torch.is_tensor(t) else t) for n, t in x.items()}


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("dtype, tol_o", [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
def test_triton_step_on_gpu(compiled, case, dtype, tol_o):
    x = cast(gpu_inputs(case, seed=case[0] + case[3]), dtype, torch.float32)
    for _ in range(3):  # consecutive launches: each one's tickets start from the last one's reset
        check_step(x, "auto", tol_o, 1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, tol_o", [(torch.float32, 1e-5), (torch.bfloat16, 4e-3)])
def test_steps_from_zero_equal_whole_sequence_on_gpu(compiled, dtype, tol_o):
    steps_against_whole_sequence("auto", dtype, tol_o, 1e-5, device="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_step_in_a_cuda_graph(compiled, dtype):
    """The step captured once and replayed: the same states and outputs as eager steps."""
    case = (4, 2, 2, 64, 64, "mask")
    eager, graphed = (cast(gpu_inputs(case, seed=5), dtype, torch.float32) for _ in range(2))
    run_step(graphed, "triton")  # compiles the kernel and makes the tickets outside the capture
    run_step(eager, "triton")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_step(graphed, "triton")
    for _ in range(4):
        graph.replay()
        o = run_step(eager, "triton")
        torch.cuda.synchronize()
        assert torch.equal(out, o)
        for n in ("state", "sum_k", "sum_v", "count"):
            assert torch.equal(graphed[n], eager[n]), n
