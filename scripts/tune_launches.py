"""Every Triton kernel an operator's forward and backward launch, timed again under other launch settings.

    python scripts/tune_launches.py --op kda --shape 2x8192 --output results/tune_launches_kda_2x8192.json
    python scripts/tune_launches.py --op deltanet --shape smollm2-16x2048 --warps 2 4 8 --stages 1 2 3 --maxnreg 128

One forward+backward of the operator (``bench_kernels.py``'s inputs and call, bf16) runs with
``JITFunction.run`` wrapped: every launch is recorded (kernel, arguments, grid, settings) and runs as
usual. Then each distinct launch is replayed on the same tensors, timed (``triton.testing.do_bench``,
median) at the launcher's own ``num_warps``/``num_stages`` and at every other pair of ``--warps`` ×
``--stages`` (and, with ``--maxnreg``, at its own pair with registers capped); a setting that does not
compile (shared memory, registers) is recorded as such. The replays
overwrite the kernels' outputs, which only the timing reads. What it says: how much each kernel would
gain from its best launch settings alone, the first thing to try before rewriting a kernel, and where
the operator's time goes kernel by kernel. Needs a CUDA GPU (the interpreter has no launch settings).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_kernels import add_operator_options, apply_operator_options, fwd_bwd, inputs, operators  # noqa: E402
from profile_kernels import SHAPES  # noqa: E402  (the named shapes of the per-kernel breakdown and ncu)


def shape_of(name: str) -> tuple:
    """``(B, T, HQ, H, K, V)`` of a named shape of ``profile_kernels.SHAPES``, or of ``BxT`` at 16 heads of 128."""
    if name in SHAPES:
        return SHAPES[name]
    B, T = (int(x) for x in name.split("x"))
    return B, T, 16, 16, 128, 128  # SPEC §7's standard heads


def record(run) -> list[tuple]:
    """``(kernel, args, grid, kwargs)`` of every launch ``run()`` makes, each launched as usual too."""
    launches, original = [], JITFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, grid, kwargs))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = recording
    try:
        run()
        torch.cuda.synchronize()
    finally:
        JITFunction.run = original
    return launches


def time_launch(fn, args, grid, kwargs) -> float | str:
    """Median ms of one launch, or why it does not run."""
    call = lambda: JITFunction.run(fn, *args, grid=grid, warmup=False, **kwargs)  # noqa: E731
    try:
        call()
        torch.cuda.synchronize()
        return triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
    except Exception as e:  # OutOfResources and its kin: this setting does not fit the kernel
        return f"{type(e).__name__}: {str(e)[:120]}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("gdn", "linear", "kda", "deltanet"), default="kda")
    p.add_argument("--shape", default="2x8192", help=f"BxT (16 heads of 128) or one of {', '.join(SHAPES)}")
    p.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--maxnreg", type=int, nargs="*", default=[],
                   help="also each kernel at its own warps and stages with registers capped (e.g. 128: two "
                        "8-warp programs an SM)")
    p.add_argument("--forward-only", action="store_true")
    add_operator_options(p)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    apply_operator_options(args)
    if not torch.cuda.is_available():
        print("error: tune_launches.py times launches on a CUDA GPU; run it on a machine with one", file=sys.stderr)
        sys.exit(2)
    B, T, HQ, H, K, V = shape_of(args.shape)
    ours, _ = operators(args.op, K)
    x = inputs(B, T, HQ, H, K, V, per_channel=args.op == "kda", decay=args.op != "deltanet", decays=args.decays)
    run = (lambda: ours(*x)) if args.forward_only else fwd_bwd(lambda: ours(*x), x)
    run()  # compiled and warm before recording
    launches = record(run)
    rows, seen = [], set()
    for fn, fargs, grid, kwargs in launches:
        consts = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
        key = (fn.__name__, json.dumps(consts, sort_keys=True, default=str), str(grid))
        if key in seen:  # the backward launches the forward's prepare and state kernels again, alike
            continue
        seen.add(key)
        now = (kwargs.get("num_warps", 4), kwargs.get("num_stages", 3))  # Triton's CUDA defaults where unset
        timed = {}
        for w in sorted(set(args.warps) | {now[0]}):
            for s in sorted(set(args.stages) | {now[1]}):
                timed[(w, s)] = time_launch(fn, fargs, grid, {**kwargs, "num_warps": w, "num_stages": s})
        capped = {n: time_launch(fn, fargs, grid, {**kwargs, "num_warps": now[0], "num_stages": now[1], "maxnreg": n})
                  for n in args.maxnreg}
        ok = {ws: ms for ws, ms in timed.items() if isinstance(ms, float)}
        best = min(ok, key=ok.get) if ok else None
        row = {"kernel": f"{fn.fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}", "grid": str(grid),
               "now": {"warps": now[0], "stages": now[1], "ms": timed[now]},
               "best": {"warps": best[0], "stages": best[1], "ms": ok[best]} if best else None,
               "settings": [{"warps": w, "stages": s, "ms": ms} for (w, s), ms in timed.items()],
               "maxnreg": [{"maxnreg": n, "ms": ms} for n, ms in capped.items()]}
        rows.append(row)
        gain = (f"{row['now']['ms'] / row['best']['ms']:.2f}×" if best and isinstance(row["now"]["ms"], float)
                else "-")
        now_ms = row["now"]["ms"] if isinstance(row["now"]["ms"], float) else float("nan")
        print(f"{row['kernel']:36s} now w{now[0]} s{now[1]} {now_ms:8.3f} ms   best "
              f"w{best[0] if best else '-'} s{best[1] if best else '-'} {ok.get(best, float('nan')):8.3f} ms  {gain}"
              + "".join(f"  maxnreg {n}: {ms:.3f} ms" if isinstance(ms, float) else f"  maxnreg {n}: {ms}"
                        for n, ms in capped.items()), flush=True)
    total_now = sum(r["now"]["ms"] for r in rows if isinstance(r["now"]["ms"], float))
    total_best = sum(r["best"]["ms"] for r in rows if r["best"])
    op_ms = triton.testing.do_bench(run, warmup=10, rep=50, return_mode="median")
    print(f"{args.op} {args.shape} {'forward' if args.forward_only else 'forward+backward'}: {op_ms:.3f} ms a call; "
          f"its distinct launches {total_now:.3f} ms as set, {total_best:.3f} ms at each one's best")
    if args.output:
        meta = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "triton": triton.__version__, "op": args.op, "shape": args.shape,
                "op_ms": op_ms, "launches_ms_now": total_now, "launches_ms_best": total_best}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
