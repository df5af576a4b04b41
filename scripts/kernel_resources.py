"""Registers, spills (stack bytes) and shared memory of every GDN Triton kernel, compiled for the H200
(sm_90) on any machine, no GPU needed: Triton compiles the kernel, its bundled ``cuobjdump`` reads the cubin.

    python scripts/kernel_resources.py --output results/kernel_resources.json
    python scripts/kernel_resources.py --K 64 --heads 9/3 --dtype fp32
    python scripts/kernel_resources.py --scan --output results/kernel_shared_scan.json

``--scan`` compiles every kernel under the launchers' settings over head counts, head sizes, dtypes and
every V block the state kernels' rule can pick, and flags shared memory over the H200's 232,448 bytes: such
a launch fails there with OutOfResources, and which settings do can depend on the head count.

A kernel with STACK > 0 spills registers to local memory; that is the first thing to fix when it is slow.
The launch settings are the launchers' own (``chunk_fwd.launch_settings`` and ``chunk_bwd.launch_settings``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.ops.triton import chunk_bwd as cb  # noqa: E402
from linearize.ops.triton import chunk_fwd as cf  # noqa: E402

TABLES = {"chunk_indices", "group_indices", "cu_seqlens", "chunk_offsets"}
# pointer arguments stored in the input dtype (the rest are float32 buffers)
INPUT_DTYPE = {"q", "k", "v", "w", "u", "tm", "dvl", "ddl", "v_new", "hs", "dhs", "do", "dq", "dk", "dv", "o", "h0", "dh0"}


def resources(fn, consts: dict, warps: int, stages: int, dtype: str) -> dict:
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in TABLES:
            sig[n] = "*i32"
        elif n == "scale":
            sig[n] = "fp32"
        else:
            sig[n] = f"*{dtype}" if n in INPUT_DTYPE else "*fp32"
    src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    t0 = time.perf_counter()
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    seconds = time.perf_counter() - t0  # Triton's cache answers repeats at once: a fresh TRITON_CACHE_DIR times compiles
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    return {"regs": int(m[1]), "stack_bytes": int(m[2]), "static_shared": int(m[3]),
            "shared_bytes": c.metadata.shared, "warps": warps, "stages": stages, "compile_s": round(seconds, 2)}


H200_SHARED = 232448  # bytes of shared memory one block may use on sm_90


def scan() -> dict:
    """Shared memory of every kernel under the launch settings, worst case over head layouts; prints overflows."""
    worst = {}
    for (K, dtype), (H, G) in itertools.product(
            [(64, "bf16"), (128, "bf16"), (256, "bf16"), (64, "fp32"), (128, "fp32"), (256, "fp32")],
            [(1, 1), (3, 4), (8, 4), (16, 1)]):
        for module in (cf, cb):
            for name, (fn, consts, warps, stages) in module.launch_settings(H, G, K, K, dtype == "fp32").items():
                bvs = [consts.get("BV")]
                if name.startswith("state"):  # the V block the rule may halve to at low parallelism
                    bvs = sorted({consts["BV"], *[b for b in (16, 32) if b < consts["BV"]]})
                for bv in bvs:
                    c = {**consts, "BV": bv} if bv is not None else consts
                    shared = resources(fn, c, warps, stages, dtype)["shared_bytes"]
                    key = f"{name} K={K} {dtype} BV={bv}"
                    if shared > H200_SHARED:
                        print(f"OVER: {key} heads {H * G}/{H} stages {stages}: {shared} B", flush=True)
                    if shared >= worst.get(key, {}).get("shared_bytes", -1):
                        worst[key] = {"shared_bytes": shared, "heads": f"{H * G}/{H}", "stages": stages,
                                      "over_h200": shared > H200_SHARED}
    return worst


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--K", type=int, default=128, help="head size (K = V)")
    p.add_argument("--heads", default="16/16", help="query/KV heads")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--scan", action="store_true", help="every launch setting over head layouts, K, dtypes (slow)")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if args.scan:
        worst = scan()
        over = [k for k, r in worst.items() if r["over_h200"]]
        print(f"{len(worst)} kernel settings, {len(over)} over the H200's shared memory{': ' if over else ''}{', '.join(over)}")
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "target": "sm_90",
                                               "triton": triton.__version__, "limit_bytes": H200_SHARED,
                                               "worst_case": worst}, indent=1))
        return
    HQ, H = map(int, args.heads.split("/"))
    K = V = args.K
    shape = dict(H=H, G=HQ // H, K=K, V=V, ieee=args.dtype == "fp32")
    rows = {}
    for module in (cf, cb):
        for name, (fn, consts, warps, stages) in module.launch_settings(**shape).items():
            rows[name] = {**consts, **resources(fn, consts, warps, stages, args.dtype)}
            r = rows[name]
            print(f"{name:12s} BV={consts.get('BV', '-'):>3} warps={warps} stages={stages}: regs {r['regs']:3d}, "
                  f"stack {r['stack_bytes']:5d} B{' (SPILLS)' if r['stack_bytes'] else ''}, shared {r['shared_bytes']} B, "
                  f"compiled in {r['compile_s']:.1f} s")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "target": "sm_90",
                                           "triton": triton.__version__, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
