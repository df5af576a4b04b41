"""Registers, spills (stack bytes) and shared memory of every GDN Triton kernel, compiled for the H200
(sm_90) on any machine, no GPU needed: Triton compiles the kernel, its bundled ``cuobjdump`` reads the cubin.

    python scripts/kernel_resources.py --output results/kernel_resources.json
    python scripts/kernel_resources.py --K 64 --heads 9/3 --dtype fp32
    python scripts/kernel_resources.py --scan --output results/kernel_shared_scan.json
    python scripts/kernel_resources.py --no-decay   # the same kernels without a decay (the deltanet target)

``--scan`` compiles every kernel under the launchers' settings over head counts, head sizes, dtypes and
every V block the state kernels' rule can pick, and flags shared memory over the H200's 232,448 bytes: such
a launch fails there with OutOfResources, and which settings do can depend on the head count.

A kernel with STACK > 0 spills registers to local memory; that is the first thing to fix when it is slow.
The launch settings are the launchers' own (``chunk_fwd.launch_settings`` and ``chunk_bwd.launch_settings``).

``--launchers`` (the KDA and linear-attention kernels) takes nothing from a table: it calls the host launchers
themselves (``kda_fwd``, ``kda_bwd``, ``linear_attention_triton``, ``linear_attention_triton_bwd``) on CPU
tensors of each case's dtype and head layout with ``JITFunction.run`` replaced by a recorder, then compiles
every recorded launch through Triton's own binder: the argument dtypes, 16-byte alignment hints, constexprs
(BK, BV, G, …), num_warps and num_stages are exactly those a GPU launch would compile with. Shared memory
depends on the Triton version: compile with the GPU's (``PYTHONPATH`` at a ``pip install --target`` of it).
The table-driven modes above pass no alignment hints, and can read less than a launch needs: the KDA backward
state kernel (bf16, K = 128, G = 1) reads 114,688 B without them and 245,760 B, the H200's error, with them.

    PYTHONPATH=/tmp/triton36 python scripts/kernel_resources.py --launchers --jobs 2 --dtypes bf16,fp16 \
        --output results/kernel_shared_scan_kda.json
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
SCALARS = {"scale": "fp32", "p0": "i32"}  # the non-pointer arguments (p0: a launch's first output group)
# pointer arguments stored in the input dtype (the rest are float32 buffers)
INPUT_DTYPE = {"q", "k", "v", "w", "u", "tm", "dvl", "ddl", "v_new", "hs", "dhs", "do", "dq", "dk", "dv", "o", "h0", "dh0"}


def resources(fn, consts: dict, warps: int, stages: int, dtype: str) -> dict:
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in TABLES:
            sig[n] = "*i32"
        elif n in SCALARS:
            sig[n] = SCALARS[n]
        else:
            sig[n] = f"*{dtype}" if n in INPUT_DTYPE else "*fp32"
    src = ASTSource(fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    t0 = time.perf_counter()
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    seconds = time.perf_counter() - t0  # Triton's cache answers repeats at once: a fresh TRITON_CACHE_DIR times compiles
    return {**cubin_resources(c), "warps": warps, "stages": stages, "compile_s": round(seconds, 2)}


def cubin_resources(c) -> dict:
    """Registers, stack (spill) bytes and static shared memory as ``cuobjdump`` reads them from a compiled
    kernel's cubin, the shared memory the launch asks for (``metadata.shared``), and the static count of its SASS
    instructions and of its ``MUFU.EX2`` (the exps)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", "-sass", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out)
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+([A-Z][A-Z0-9_.]*)", out)  # one per SASS instruction (static count)
    return {"regs": int(m[1]), "stack_bytes": int(m[2]), "static_shared": int(m[3]), "shared_bytes": c.metadata.shared,
            "instructions": len(ops), "exp2": sum(op.startswith("MUFU.EX2") for op in ops)}


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

# --launchers: (source, dtype, query heads, KV heads, K, V). The bench's and the GPU tests' layouts, and a grid
# of dtypes × head sizes at one head per KV head and at four (the query-head loops of the backward and of the
# output kernels fold away at G = 1, so G = 1 and G > 1 compile differently; the head count itself only
# enters through strides).
TEST_SHAPES = [(2, 1, 16, 16), (2, 2, 16, 32), (1, 2, 24, 20), (2, 3, 32, 16), (1, 2, 8, 8), (4, 4, 128, 128),
               (2, 7, 64, 64), (1, 4, 256, 256), (2, 2, 64, 64)]  # (H, G, K, V) of tests/test_{kda,linear}_triton*.py
GRID = [(d, hq, hq // g, k, k) for d in ("fp32", "bf16", "fp16") for k in (64, 128, 256) for hq, g in ((16, 1), (32, 4))]
BENCH = [("bf16", 16, 16, 128, 128), ("bf16", 9, 3, 64, 64), ("bf16", 32, 8, 128, 128)]  # scripts/bench_kernels.py
TESTS = [(d, h * g, h, k, v) for d in ("fp32", "bf16") for h, g, k, v in TEST_SHAPES]
# 16-bit first: IEEE fp32 kernels (FMA dots) take ptxas minutes each
CASES = sorted({c: None for c in BENCH + TESTS + GRID}, key=lambda c: c[0] == "fp32")
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def record_launches(dtype: str, HQ: int, H: int, K: int, V: int, T: int = 64) -> list:
    """``(kernel, args, kwargs)`` of every launch the KDA and linear-attention launchers make, forward and
    backward, with an initial state, the final state, a v offset and its gradient (as the GPU tests run them)."""
    import torch
    from triton.runtime.jit import JITFunction

    from linearize.ops.triton.kda_bwd import kda_bwd
    from linearize.ops.triton.kda_fwd import kda_fwd
    from linearize.ops.triton.linear_bwd import linear_attention_triton_bwd
    from linearize.ops.triton.linear_fwd import linear_attention_triton

    dt = getattr(torch, TORCH_DTYPES[dtype])
    x = lambda *s, d=dt: torch.zeros(1, T, *s, dtype=d)  # noqa: E731
    q, k, v, do = x(HQ, K), x(H, K), x(H, V), x(HQ, V)
    h0, dht = torch.zeros(1, H, K, V), torch.zeros(1, H, K, V)
    launches, run = [], JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kw: launches.append((self, args, kw))
    try:
        _, _, tm = kda_fwd(q=q, k=k, v=v, g=x(H, K, d=torch.float32), beta=x(H), scale=0.5, initial_state=h0,
                           output_final_state=True, cu_seqlens=None, v_offset=x(H, V))
        kda_bwd(q=q, k=k, v=v, g=x(H, K, d=torch.float32), beta=x(H), scale=0.5, initial_state=h0, do=do, dht=dht,
                cu_seqlens=None, tm=tm)
        g, w = x(H, d=torch.float32), x(H, d=torch.float32)
        linear_attention_triton(q, k, v, g, w, scale=0.5, initial_state=h0, output_final_state=True, v_offset=x(H, V))
        linear_attention_triton_bwd(q=q, k=k, v=v, g=g, w=w, scale=0.5, initial_state=h0, do=do, dht=dht,
                                    cu_seqlens=None)
    finally:
        JITFunction.run = run
    return launches


def compile_launch(fn, args, kwargs) -> tuple[str, dict, dict]:
    """Compile one recorded launch for sm_90 as ``JITFunction.run`` would: ``(key, its constexprs, resources)``."""
    from triton import knobs
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    kwargs = {**kwargs, "debug": kwargs.get("debug", fn.debug) or knobs.runtime.debug}
    for opt in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # run's options, where this Triton has them
        if hasattr(knobs.compilation, opt):
            kwargs[opt] = getattr(knobs.compilation, opt)
    bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    consts = {fn.arg_names[path[0]]: v for path, v in constexprs.items() if not isinstance(v, (type(None), str))}
    key = f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"
    key += " " + " ".join(f"{n}={v}" for n, v in consts.items())
    key += f" warps={options.num_warps} stages={options.num_stages} {json.dumps(signature, sort_keys=True)}"
    c = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return key, consts, {**cubin_resources(c), "warps": options.num_warps, "stages": options.num_stages}


def scan_case(case: tuple) -> list[dict]:
    dtype, HQ, H, K, V = case
    source = "+".join(n for n, cases in (("bench", BENCH), ("test", TESTS), ("grid", GRID)) if case in cases)
    rows, seen = [], set()
    for fn, args, kwargs in record_launches(dtype, HQ, H, K, V):
        key, consts, r = compile_launch(fn, args, kwargs)
        if key in seen:  # the backward runs the forward's prepare and state kernels again, alike
            continue
        seen.add(key)
        kernel = key.split(" ")[0]
        rows.append({"source": source, "dtype": dtype, "heads": f"{HQ}/{H}", "K": K, "V": V, "kernel": kernel,
                     **{n: consts[n] for n in ("BK", "BV", "SUB") if n in consts}, **r,
                     "over_h200": r["shared_bytes"] > H200_SHARED})
        print(f"{source:15s} {dtype} {HQ}/{H} K={K} V={V} {kernel:28s} BV={consts.get('BV', '-')} warps={r['warps']} "
              f"stages={r['stages']}: shared {r['shared_bytes']:6d} B{' OVER' if rows[-1]['over_h200'] else ''}, "
              f"regs {r['regs']}, stack {r['stack_bytes']} B", flush=True)
    return rows


def scan_launchers(jobs: int, dtypes: list[str]) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("--launchers compiles the kernels: unset TRITON_INTERPRET")
    cases = [c for c in CASES if c[0] in dtypes]
    if jobs == 1:
        return [r for case in cases for r in scan_case(case)]
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return [r for rows in pool.imap(scan_case, cases) for r in rows]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--K", type=int, default=128, help="head size (K = V)")
    p.add_argument("--heads", default="16/16", help="query/KV heads")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--scan", action="store_true", help="every launch setting over head layouts, K, dtypes (slow)")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--launchers", action="store_true",
                   help="the KDA and linear-attention kernels as their launchers launch them, over CASES (slow)")
    p.add_argument("--jobs", type=int, default=1, help="compiling processes for --launchers")
    p.add_argument("--dtypes", default="bf16,fp16,fp32", help="--launchers: the cases of these input dtypes")
    p.add_argument("--no-decay", action="store_true",
                   help="the GDN kernels compiled without a decay (USE_G False: the deltanet target's g=None)")
    args = p.parse_args()
    if args.launchers:
        rows = scan_launchers(args.jobs, args.dtypes.split(","))
        over, spills = [r for r in rows if r["over_h200"]], [r for r in rows if r["stack_bytes"]]
        print(f"{len(rows)} launches compiled, {len(over)} over the H200's {H200_SHARED} B of shared memory, "
              f"{len(spills)} spilling registers")
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps({
                "command": " ".join(["python", *sys.argv]), "target": "sm_90", "triton": triton.__version__,
                "limit_bytes": H200_SHARED, "launches": len(rows), "over_h200": len(over),
                "max_shared_bytes": max(r["shared_bytes"] for r in rows), "spilling": len(spills),
                "rows": rows}, indent=1))
        return
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
            consts = {**consts, "USE_G": not args.no_decay}
            rows[name] = {**consts, **resources(fn, consts, warps, stages, args.dtype)}
            r = rows[name]
            print(f"{name:12s} BV={consts.get('BV', '-'):>3} warps={warps} stages={stages}: regs {r['regs']:3d}, "
                  f"stack {r['stack_bytes']:5d} B{' (SPILLS)' if r['stack_bytes'] else ''}, shared {r['shared_bytes']} B, "
                  f"{r['instructions']} instructions ({r['exp2']} exp2), compiled in {r['compile_s']:.1f} s")
    print(f"all: {sum(r['instructions'] for r in rows.values())} SASS instructions, "
          f"{sum(r['exp2'] for r in rows.values())} exp2")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "target": "sm_90",
                                           "triton": triton.__version__, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
