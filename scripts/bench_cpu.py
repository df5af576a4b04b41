"""CPU-side benchmarks of the GDN operator; any machine, no GPU.

    python scripts/bench_cpu.py ops --output results/bench_ops_cpu.json
    python scripts/bench_cpu.py host --output results/bench_host.json

``ops``: the chunkwise PyTorch operator against the reference loop on the CPU, median wall time and speed
ratio (default shape B=1, T=4096, 9 query / 3 KV heads, d=64, fp32: SmolLM2's attention geometry).

``host``: what the Triton launchers' own Python costs per forward call — layouts, tables, settings,
allocations, autograd — on CPU tensors, with every ``kernel[grid](...)`` replaced by a no-op, so host-side
changes can be compared anywhere. Only the forward: its tensor operations are allocations and views, which
cost the CPU what they cost the host on a GPU machine; the backward ends in dtype casts of whole gradients,
which would be CPU work here. Prints and writes the minimum over rounds (µs per call).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import pkgutil
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.ops import gated_delta_rule  # noqa: E402

HOST_SHAPES = {"smollm2": (4, 4096, 9, 3, 64, 64), "llama3-8b": (2, 4096, 32, 8, 128, 128),
               "2x8192": (2, 8192, 16, 16, 128, 128)}


def command() -> str:
    return " ".join(["python", *sys.argv])


def write(path: Path | None, result: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


# ---------------------------------------------------------------- ops: chunkwise vs reference


def timeit(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def bench_ops(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    B, T, Hq, H, D = args.batch, args.seq_len, args.q_heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, Hq, D, generator=gen)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.1
    beta = torch.rand(B, T, H, generator=gen)
    run = {b: (lambda b=b: gated_delta_rule(q, k, v, g, beta, output_final_state=True, backend=b))
           for b in ("torch", "reference")}
    with torch.no_grad():
        o_c, _ = run["torch"]()
        o_r, _ = run["reference"]()
        err = ((o_c - o_r).norm() / o_r.norm()).item()
        t_chunk = timeit(run["torch"], args.repeats)
        t_ref = timeit(run["reference"], 3)
    med_c, med_r = statistics.median(t_chunk), statistics.median(t_ref)
    print(f"B={B} T={T} heads={Hq}/{H} d={D} fp32, {torch.get_num_threads()} threads")
    print(f"reference loop: {med_r * 1e3:9.1f} ms (median of {len(t_ref)})")
    print(f"chunkwise:      {med_c * 1e3:9.1f} ms (median of {len(t_chunk)})")
    print(f"speed-up: {med_r / med_c:.1f}x; rel. error {err:.2e}")
    return {
        "command": command(),
        "shape": {"B": B, "T": T, "q_heads": Hq, "kv_heads": H, "head_dim": D, "dtype": "float32"},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__},
        "chunk_s": t_chunk, "reference_s": t_ref, "chunk_median_s": med_c, "reference_median_s": med_r,
        "speedup": med_r / med_c, "rel_error_chunk_vs_reference": err,
    }


# ---------------------------------------------------------------- host: the launchers' own Python


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels() -> None:
    """Replace every Triton kernel of the operator's modules with a no-op and drop the cached settings
    (which hold the kernels)."""
    import triton

    import linearize.ops.triton as package

    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for name, obj in list(vars(module).items()):
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, _NoLaunch())
            elif hasattr(obj, "cache_clear") and name.endswith("_settings"):
                obj.cache_clear()


def per_call_us(fn, calls: int, rounds: int) -> float:
    for _ in range(max(10, calls // 20)):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def bench_host(args) -> dict:
    from linearize.ops.triton.function import chunk_gated_delta_rule_triton

    stub_kernels()
    rows = []
    for name in args.shapes.split(","):
        B, T, HQ, H, K, V = HOST_SHAPES[name]
        bf16 = dict(dtype=torch.bfloat16)  # never read: the kernels do not run
        q, k, v = torch.empty(B, T, HQ, K, **bf16), torch.empty(B, T, H, K, **bf16), torch.empty(B, T, H, V, **bf16)
        g, beta = torch.empty(B, T, H), torch.empty(B, T, H, **bf16)
        call = functools.partial(chunk_gated_delta_rule_triton, q, k, v, g, beta, scale=K**-0.5)
        fwd = per_call_us(call, args.calls, args.rounds)
        print(f"{name:10s} forward {fwd:6.1f} us  (our Python per call, kernel launches stubbed)")
        rows.append({"shape": name, "B": B, "T": T, "q_heads": HQ, "kv_heads": H, "K": K, "V": V,
                     "forward_host_us": round(fwd, 2)})
    return {"command": command(), "torch": torch.__version__, "calls": args.calls, "rounds": args.rounds, "rows": rows}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    ops = sub.add_parser("ops", help="chunkwise vs reference operator on the CPU")
    ops.add_argument("--batch", type=int, default=1)
    ops.add_argument("--seq-len", type=int, default=4096)
    ops.add_argument("--q-heads", type=int, default=9)
    ops.add_argument("--kv-heads", type=int, default=3)
    ops.add_argument("--head-dim", type=int, default=64)
    ops.add_argument("--repeats", type=int, default=5, help="timed runs of the chunkwise path (reference: 3)")
    ops.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    host = sub.add_parser("host", help="the Triton launchers' own Python per forward, kernels stubbed")
    host.add_argument("--shapes", default=",".join(HOST_SHAPES), help=f"comma-separated, from {', '.join(HOST_SHAPES)}")
    host.add_argument("--calls", type=int, default=2000)
    host.add_argument("--rounds", type=int, default=5)
    for q in (ops, host):
        q.add_argument("--output", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args()
    if args.what == "host" and any(s not in HOST_SHAPES for s in args.shapes.split(",")):
        p.error(f"--shapes takes names from {', '.join(HOST_SHAPES)}; got {args.shapes!r}")
    write(args.output, bench_ops(args) if args.what == "ops" else bench_host(args))


if __name__ == "__main__":
    main()
