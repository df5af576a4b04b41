"""Chunkwise vs reference GDN operator on the CPU: median wall time and speed ratio.

    python scripts/bench_ops_cpu.py --output results/bench_ops_cpu.json

Default shape: B=1, T=4096, 9 query / 3 KV heads, d=64, fp32 (SmolLM2's attention geometry).
Target (issue 2): chunkwise ≥ 5× faster than the reference loop.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.ops import gated_delta_rule  # noqa: E402


def timeit(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--q-heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed runs of the chunkwise path (reference: 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--output", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    B, T, Hq, H, D = args.batch, args.seq_len, args.q_heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, Hq, D, generator=gen)
    k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.1
    beta = torch.rand(B, T, H, generator=gen)

    run = {b: (lambda b=b: gated_delta_rule(q, k, v, g, beta, output_final_state=True, backend=b)) for b in ("torch", "reference")}
    with torch.no_grad():
        o_c, s_c = run["torch"]()
        o_r, s_r = run["reference"]()
        err = ((o_c - o_r).norm() / o_r.norm()).item()
        t_chunk = timeit(run["torch"], args.repeats)
        t_ref = timeit(run["reference"], 3)
    med_c, med_r = statistics.median(t_chunk), statistics.median(t_ref)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "shape": {"B": B, "T": T, "q_heads": Hq, "kv_heads": H, "head_dim": D, "dtype": "float32"},
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "chunk_s": t_chunk,
        "reference_s": t_ref,
        "chunk_median_s": med_c,
        "reference_median_s": med_r,
        "speedup": med_r / med_c,
        "rel_error_chunk_vs_reference": err,
        "target_speedup": 5.0,
    }
    print(f"B={B} T={T} heads={Hq}/{H} d={D} fp32, {torch.get_num_threads()} threads")
    print(f"reference loop: {med_r * 1e3:9.1f} ms (median of {len(t_ref)})")
    print(f"chunkwise:      {med_c * 1e3:9.1f} ms (median of {len(t_chunk)})")
    print(f"speed-up: {med_r / med_c:.1f}x (target >= 5x); rel. error {err:.2e}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
