"""Where the GDN kernels' time goes on a CUDA GPU: a per-kernel breakdown and a launch-config sweep.

    python scripts/profile_kernels.py --output results/profile_kernels.json
    python scripts/profile_kernels.py --op kda --shapes 8x2048,2x8192 --output results/profile_kernels_kda.json

1. Breakdown: ``torch.profiler`` over forward and forward+backward of ours and (when importable)
   flash-linear-attention, at a few shapes; GPU time per call of every kernel, summed per kernel name, and
   the GPU's idle time between kernels with the host operations that ran while it waited (``idle_gaps``).
   ``--op kda``: the per-key-channel decay (``ops/triton/kda_*.py``) against fla's ``chunk_kda``; ``--op linear``
   and ``--op deltanet`` likewise against ``chunk_simple_gla`` and ``chunk_delta_rule``.
2. Sweep (``--sweep state_fwd,state_bwd``): each of our kernels alone, timed with ``triton.testing.do_bench`` under every
   (V block, warps, stages) it accepts, so launch settings are chosen from measurements.
Prints tables and writes JSON. Timings are medians on the device the script runs on; compare them only
with each other.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.ops.triton import chunk_bwd as cb  # noqa: E402
from linearize.ops.triton import chunk_fwd as cf  # noqa: E402
from linearize.ops.triton.layout import Layout  # noqa: E402
from linearize.ops.triton.prepare import recompute_w_u  # noqa: E402
from linearize.ops.triton.solve import solve_tril  # noqa: E402
from linearize.ops.triton.state_fwd import chunk_fwd_h  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import fwd_bwd, inputs, load_fla, operators, repeat_kv  # noqa: E402

SHAPES = {"8x2048": (8, 2048, 16, 16, 128, 128), "2x8192": (2, 8192, 16, 16, 128, 128),
          "1x16384": (1, 16384, 16, 16, 128, 128),
          "smollm2-16x2048": (16, 2048, 9, 3, 64, 64), "llama3-8b-2x4096": (2, 4096, 32, 8, 128, 128)}


def idle_gaps(prof, iters: int, top: int = 6, min_us: float = 10.0) -> dict:
    """Where the GPU waited between kernels in a profiled run: the idle microseconds per call (gaps of more
    than ``min_us`` between one kernel's end and the next one's start, on the profiler's common clock) and
    the ``top`` largest gaps, each with the kernels around it and the host operations that started while the
    GPU waited (by their time then), so a synchronization or slow host code shows by name."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    host = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    gaps = [(b.time_range.start - a.time_range.end, a, b) for a, b in zip(kernels, kernels[1:])
            if b.time_range.start - a.time_range.end > min_us]
    largest = []
    for us, a, b in sorted(gaps, key=lambda g: -g[0])[:top]:
        start, end = a.time_range.end, b.time_range.start
        during = defaultdict(float)
        for e in host:
            if start <= e.time_range.start < end:
                during[e.name[:60]] += min(e.time_range.end, end) - e.time_range.start
        largest.append({"us": us, "after": a.name[:60], "before": b.name[:60],
                        "host_ops_us": dict(sorted(during.items(), key=lambda kv: -kv[1])[:8])})
    return {"idle_us_per_call": sum(g[0] for g in gaps) / iters, "largest": largest}


def profile_calls(fn, iters=5, name_len=60, ops: dict | None = None, gaps: dict | None = None):
    """``(GPU microseconds per call of fn per kernel name, most first; wall seconds per call)``, after one
    warm-up call, under ``torch.profiler``. ``ops``: also filled, from the same run, with ``{operator:
    (GPU µs per call of the kernels it launched itself, calls per call)}`` (``self_device_time_total``);
    ``gaps``: with :func:`idle_gaps` of the run."""
    fn()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters
    out = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            dt = getattr(e, "device_time", None)
            out[e.name[:name_len]] += (dt if dt is not None else e.cuda_time) / iters
    if gaps is not None:
        gaps.update(idle_gaps(prof, iters))
    if ops is not None:
        for e in prof.key_averages():
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
            if us > 0 and e.device_type == torch.autograd.DeviceType.CPU:
                ops[e.key] = (us / iters, e.count / iters)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])), wall


def breakdown(shapes, fla, op="gdn", save=lambda res: None):
    """Per shape, implementation and mode: the kernels' GPU time and the idle gaps; ``save`` is called with the
    rows so far after each one (a run stopped by a time limit keeps what it measured)."""
    res = {}
    for name in shapes:
        _breakdown_shape(name, fla, op, res, save)
    return res


def _breakdown_shape(name, fla, op, res, save):
    B, T, HQ, H, K, V = SHAPES[name]
    q, k, v, g, beta = inputs(B, T, HQ, H, K, V, per_channel=op == "kda", decay=op != "deltanet")
    ts = (q, k, v, g, beta)
    G = HQ // H
    rep = repeat_kv(G)  # the copy only where fla needs it (G > 1)
    ours, fla_call = operators(op, K)
    runs = {"ours": lambda: ours(q, k, v, g, beta)}
    if fla is not None:
        runs["fla"] = lambda: fla_call(fla, q, rep(k), rep(v), rep(g), rep(beta))
    for impl, run in runs.items():
        for mode, fn in (("fwd", run), ("fwdbwd", fwd_bwd(run, ts))):
            gaps = {}
            with torch.set_grad_enabled(mode == "fwdbwd"):
                t, wall = profile_calls(fn, gaps=gaps)
            # wall time per call under the profiler: above the kernels' sum when launches leave the GPU idle
            # (host-side work); the profiler adds some of its own. The idle gaps say where and during what.
            res[f"{name}/{impl}/{mode}"] = {"kernels_us": t, "kernels_total_us": sum(t.values()), "wall_us": wall * 1e6,
                                            "idle_gaps": gaps}
            print(f"\n{name} {impl} {mode}: total {sum(t.values()):.1f} us of kernels, {wall * 1e6:.1f} us wall, "
                  f"GPU idle {gaps['idle_us_per_call']:.1f} us a call")
            for kname, us in t.items():
                print(f"  {us:9.1f} us  {kname}")
            for gap in gaps["largest"][:3]:
                print(f"  idle {gap['us']:.1f} us after {gap['after']}: {list(gap['host_ops_us'])[:4]}")
            save(res)


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3  # us


def candidates(kname, K, V):
    """(constexpr overrides, warps, stages) to time for one kernel."""
    vmax = max(16, triton.next_power_of_2(V))
    kmax = max(16, triton.next_power_of_2(K))
    if kname.startswith("state"):
        grid = [({"BV": bv, "KB": 64}, nw, ns) for bv in (16, 32, 64) for nw in (2, 4) for ns in (3, 4)]
    elif kname == "solve":
        return [({"BKB": bkb}, nw, ns) for bkb in (32, 64, 128) if bkb <= kmax for nw in (1, 2, 4) for ns in (1, 2)]
    elif kname == "wy_bwd":  # BV 32 left out here and for prepare: see prepare_settings
        grid = [({"BV": 64, "BKB": 64}, nw, ns) for nw in (4, 8) for ns in (1, 2)]
    elif kname == "output":  # E: chunks per program (one state read per E chunks)
        grid = [({"BV": bv, "E": e}, nw, ns) for e in (1, 4, 8) for bv in (64, 128) for nw in (4, 8) for ns in (2, 3)]
    elif kname == "prepare":
        grid = [({"BV": 64}, nw, ns) for nw in (4, 8) for ns in (1, 2, 3)]
    else:
        grid = [({"BV": bv}, nw, ns) for bv in (32, 64, 128) for nw in (4, 8) for ns in (1, 2)
                if bv <= 64 or kname in ("output", "dv_local")]
    return [c for c in grid if c[0]["BV"] <= vmax and c[0].get("KB", 0) <= kmax and c[0].get("BKB", 0) <= kmax]


def sweep(shapes, only):
    """Each kernel alone under every launch setting; the inputs are the real intermediates of a forward."""
    res = {}
    for name in shapes:
        res.update(_sweep_shape(name, only))
    return res


def _sweep_shape(name, only):
    res = {}
    B, T, HQ, H, K, V = SHAPES[name]
    q, k, v, g, beta = (x.detach() for x in inputs(B, T, HQ, H, K, V))
    L = Layout(q, v, None)
    qf, kf, vf, gf, bf = Layout.flat(q, k, v, g, beta)
    tm = solve_tril(layout=L, k=kf, g=gf, beta=bf)
    gcum, w, u = recompute_w_u(layout=L, k=kf, v=vf, g=gf, beta=bf, tm=tm)
    hs, v_new, _ = chunk_fwd_h(layout=L, k=kf, w=w, u=u, gcum=gcum, initial_state=None, output_final_state=False)
    do = torch.randn(L.tokens, HQ, V, device="cuda", dtype=q.dtype)
    tables = (L.chunk_indices, L.cu_seqlens, L.chunk_offsets)
    f32 = torch.float32
    dvl = torch.randn(L.tokens, H, V, device="cuda", dtype=q.dtype)
    ddl = dvl  # in place, as the launcher runs it
    dhs = torch.empty_like(hs)
    dql = torch.randn(*hs.shape, device="cuda", dtype=f32)  # the q term of the state gradient (GQA)
    o = torch.empty(L.tokens, HQ, V, device="cuda", dtype=q.dtype)
    dq, dkq = torch.empty_like(qf), torch.empty(L.tokens, HQ, K, device="cuda", dtype=f32)
    dgq = torch.empty(L.tokens, HQ, device="cuda", dtype=f32)
    dk, dv = torch.empty_like(kf), torch.empty_like(vf)
    dbeta, dg = torch.empty(L.tokens, H, device="cuda", dtype=f32), torch.empty(L.tokens, H, device="cuda", dtype=f32)
    S = {**cf.launch_settings(H, HQ // H, K, V, False), **cb.launch_settings(H, HQ // H, K, V, False)}
    by_every = {1: hs}

    def kept(every):  # the states the output kernel reads: one per ``every`` chunks
        if every not in by_every:
            by_every[every] = chunk_fwd_h(layout=L, k=kf, w=w, u=u, gcum=gcum, initial_state=None,
                                          output_final_state=False, every=every)[0]
        return by_every[every]

    c = lambda kname, o: {**S[kname][1], **o}  # noqa: E731  the launchers' constexprs, overridden by o
    kernels = {
        "solve": lambda ov, nw, ns: S["solve"][0][(L.NC, H)](
            kf, gf, bf, tm, *tables, **c("solve", ov), num_warps=nw, num_stages=ns),
        "prepare": lambda ov, nw, ns: S["prepare"][0][(L.NC, H)](
            kf, vf, gf, bf, gcum, w, u, tm, *tables, **c("prepare", ov), num_warps=nw, num_stages=ns),
        "state_fwd": lambda ov, nw, ns: S["state_fwd"][0][(triton.cdiv(V, ov["BV"]), L.N * H)](
            kf, w, u, gcum, hs, v_new, hs, hs, L.cu_seqlens, L.chunk_offsets, **c("state_fwd", ov), num_warps=nw, num_stages=ns),
        "output": lambda ov, nw, ns: S["output"][0][(triton.cdiv(V, ov["BV"]), L.groups(ov["E"])[1], HQ)](
            qf, kf, v_new, gcum, kept(ov["E"]), o, o, L.groups(ov["E"])[0], *tables[1:], K**-0.5, **c("output", ov),
            num_warps=nw, num_stages=ns),
        "dv_local": lambda ov, nw, ns: S["dv_local"][0][(triton.cdiv(V, ov["BV"]), L.NC, H)](
            qf, kf, gcum, do, dvl, dql, *tables, K**-0.5, **c("dv_local", ov), num_warps=nw, num_stages=ns),
        "state_bwd": lambda ov, nw, ns: S["state_bwd"][0][(triton.cdiv(V, ov["BV"]), L.N * H)](
            qf, kf, w, gcum, do, dvl, dql, dhs, ddl, hs, hs, L.cu_seqlens, L.chunk_offsets, K**-0.5,
            **c("state_bwd", ov), num_warps=nw, num_stages=ns),
        "dqk": lambda ov, nw, ns: S["dqk"][0][(L.NC, HQ)](
            qf, kf, v_new, gcum, hs, do, dq, dkq, dgq, *tables, K**-0.5, **c("dqk", ov), num_warps=nw, num_stages=ns),
        "wy_bwd": lambda ov, nw, ns: S["wy_bwd"][0][(L.NC, H)](
            kf, vf, bf, gcum, tm, v_new, hs, dhs, ddl, dkq, dgq, dk, dv, dbeta, dg, *tables,
            **c("wy_bwd", ov), num_warps=nw, num_stages=ns),
    }
    for kname, launch in kernels.items():
        if kname not in only:
            continue
        rows = []
        for ov, nw, ns in candidates(kname, K, V):  # (not ``o``: the output kernel's buffer has that name)
            try:
                us = bench(functools.partial(launch, ov, nw, ns))
            except Exception as e:  # out of shared memory / registers for this setting
                rows.append({**ov, "warps": nw, "stages": ns, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                print(f"{name} {kname} {ov} w{nw} s{ns}: {rows[-1]['error']}", flush=True)
                continue
            rows.append({**ov, "warps": nw, "stages": ns, "us": us})
        ok = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        res[f"{name}/{kname}"] = rows
        best = ", ".join(" ".join(f"{k}{r[k]}" for k in r if k != "us") + f": {r['us']:.1f}" for r in ok[:4])
        print(f"{name} {kname:10s} best: {best}", flush=True)
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--op", choices=("gdn", "kda", "linear", "deltanet"), default="gdn",
                   help="the breakdown's operator (as bench_kernels.py's --op): one decay per head (gdn), per key "
                        "channel (kda), the decayed linear attention (linear), the delta rule without decay")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--no-breakdown", action="store_true", help="the sweep only")
    p.add_argument("--no-fla", action="store_true", help="our kernels only in the breakdown")
    p.add_argument("--sweep", default="", help="comma-separated kernels to time under every launch setting: "
                   "solve, prepare, state_fwd, output, dv_local, state_bwd, dqk, wy_bwd")
    args = p.parse_args()
    shapes = args.shapes.split(",")
    if args.op != "gdn" and args.sweep:
        p.error(f"--sweep times the GDN kernels; leave it out with --op {args.op}")
    fla, guard = (None, False) if args.no_fla else load_fla(args.op)  # as load_fla returns when fla is missing
    out = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "fla_guard_disabled": guard, "op": args.op,
           "breakdown_us_per_call": {}}

    def write():
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(out, indent=1))

    def save(rows):  # after every breakdown row: a run stopped by a time limit keeps what it measured
        out["breakdown_us_per_call"] = rows
        write()

    save({} if args.no_breakdown else breakdown(shapes, fla, args.op, save))
    if args.sweep:
        out["sweep_us"] = sweep(shapes, args.sweep.split(","))
        write()


if __name__ == "__main__":
    main()
