"""Host cost of the Triton operator's own Python, per call, with every kernel launch stubbed out.

    python scripts/bench_host.py --output results/bench_host.json

On small teachers the GPU forward is host-bound (``bench_kernels.py``: SmolLM2's forward is 0.28 ms through
Python against 0.10 ms replayed from a CUDA graph). This times what our launchers add on top of Triton's
launches — layouts, tables, settings, allocations, autograd — on CPU tensors, with each ``kernel[grid](...)``
replaced by a no-op: no GPU and no Triton launch path, so any machine can run it and A/B host-side changes.
Only the forward: its tensor operations are allocations and views, which cost the CPU what they cost the host
on a GPU machine; the backward launcher ends in dtype casts of whole gradients, which would be CPU work here
(``meta`` tensors are no better: their allocations run Python shape checks).
Prints and writes the minimum over rounds (µs per call).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.ops.triton import chunk_bwd, chunk_fwd  # noqa: E402
from linearize.ops.triton.function import chunk_gated_delta_rule_triton  # noqa: E402

SHAPES = {"smollm2": (4, 4096, 9, 3, 64, 64), "llama3-8b": (2, 4096, 32, 8, 128, 128), "2x8192": (2, 8192, 16, 16, 128, 128)}


class _NoLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stub_kernels():
    """Replace every Triton kernel of the two launcher modules with a no-op (cached settings tables dropped)."""
    import triton

    for module in (chunk_fwd, chunk_bwd):
        for name in dir(module):
            if isinstance(getattr(module, name), triton.runtime.JITFunction) and name.endswith("_kernel"):
                setattr(module, name, _NoLaunch())
        cached = getattr(module, "_launch_settings", None)
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()


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


def time_shape(name: str, calls: int, rounds: int) -> dict:
    B, T, HQ, H, K, V = SHAPES[name]
    bf16 = dict(dtype=torch.bfloat16)  # never read: the kernels do not run
    q, k, v = torch.empty(B, T, HQ, K, **bf16), torch.empty(B, T, H, K, **bf16), torch.empty(B, T, H, V, **bf16)
    g, beta = torch.empty(B, T, H), torch.empty(B, T, H, **bf16)
    fwd = per_call_us(lambda: chunk_gated_delta_rule_triton(q, k, v, g, beta, scale=K**-0.5), calls, rounds)
    print(f"{name:10s} forward {fwd:6.1f} us  (our Python per call, kernel launches stubbed)")
    return {"shape": name, "B": B, "T": T, "q_heads": HQ, "kv_heads": H, "K": K, "V": V, "forward_host_us": round(fwd, 2)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    stub_kernels()
    rows = [time_shape(name, args.calls, args.rounds) for name in args.shapes.split(",")]
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "torch": torch.__version__,
                                           "calls": args.calls, "rounds": args.rounds, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
