"""Why each forward kernel takes the time it does: Nsight Compute on one forward, summarized as JSON.

    python scripts/profile_ncu.py --output results/ncu_forward_2x8192.json
    python scripts/profile_ncu.py --op kda --sass _scores_kernel --output results/ncu_kda_2x8192.json

For every kernel of the forward (solve, prepare, state, output) this runs ``ncu --set full`` on the third
of three forwards at one shape (the first two compile and warm up); ``--op kda``: every kernel of KDA's
forward and backward (``ops/triton/kda_fwd.py``, ``kda_bwd.py``), on the third call of each of three
forward+backward passes (prepare and state run in both: their forward's second pass). Then it reads the raw metrics back
(``ncu --page raw --csv``) and keeps the ones that say where the time goes: duration, registers, shared
memory, warps per SM, issue activity, DRAM and tensor-pipe use, register spills, and the warp stall
reasons (stalled warps per issued instruction: with one warp per scheduler their sum is the cycles between
two issues). Shapes are ``profile_kernels.py``'s. For one
kernel (``--sass``, default the state kernel) it also keeps the SASS instructions that collect the most
stall samples. ``--raw-dir DIR``: summarize ``raw<kernel>.csv`` / ``sass.csv`` files collected earlier
with the same ncu options instead of running ncu.

Needs ``ncu`` on PATH and a GPU whose counters it may read (the H200 machine's kind allows it; see the
device tool's KINDS.md). Clocks are left unlocked (``--clock-control none``): durations read here are
the GPU's own, and are compared with each other only.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_kernels import SHAPES  # noqa: E402  (the same named shapes as the per-kernel breakdown)

KERNELS = {"gdn": ("_solve_kernel", "_prepare_kernel", "_state_kernel", "_output_kernel"),
           "kda": ("_scores_kernel", "_solve_kernel", "_prepare_kernel", "_state_kernel", "_output_kernel",
                   "_state_bwd_kernel", "_dv_local_kernel", "_dqk_kernel", "_wy_bwd_kernel", "_intra_bwd_kernel")}
NCU = ["ncu", "--clock-control", "none", "--set", "full", "--import-source", "no", "-s", "2", "-c", "1"]
METRICS = {  # raw metric → name in the JSON (its unit, as ncu printed it, under "units")
    "gpu__time_duration.sum": "duration",
    "launch__registers_per_thread": "registers_per_thread",
    "launch__shared_mem_per_block_dynamic": "dynamic_shared_memory",
    "launch__grid_size": "programs",
    "launch__block_size": "threads_per_program",
    "sm__warps_active.avg.per_cycle_active": "warps_per_sm",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "smsp__inst_executed.sum": "instructions",
    "dram__bytes.sum.per_second": "dram_bandwidth",
    "dram__cycles_active.avg.pct_of_peak_sustained_elapsed": "dram_active_pct",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active": "wgmma_pipe_pct",
    "smsp__warps_eligible.avg.per_cycle_active": "eligible_warps_per_scheduler",
    # registers spilled to local memory: 32-byte sectors the kernel loaded / stored there
    "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum": "spill_load_sectors",
    "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum": "spill_store_sectors",
}
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")

# one forward, run three times (the script profiles the third); kda: forward+backward, g per key channel
FORWARD = """
import sys, torch
sys.path.insert(0, {scripts!r})
from bench_kernels import inputs
from linearize.ops import gated_delta_rule
q, k, v, g, beta = inputs(*{shape!r}, per_channel={kda!r})
for _ in range(3):
    with torch.set_grad_enabled({kda!r}):
        o, _ = gated_delta_rule(q, k, v, g, beta, scale={scale!r}, backend="triton")
    if {kda!r}:
        o.float().square().mean().backward()
torch.cuda.synchronize()
"""


def _number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def _table(path: Path, key: str) -> tuple[list[str], list[list[str]]]:
    """The header (the row whose first cells include ``key``) and the data rows of an ncu CSV."""
    rows = list(csv.reader(path.open()))
    at = next(i for i, r in enumerate(rows) if key in r)
    return rows[at], [r for r in rows[at + 1:] if len(r) == len(rows[at])]


def summarize_raw(path: Path) -> dict:
    head, rows = _table(path, "ID")
    units, values = dict(zip(head, rows[0])), dict(zip(head, rows[1]))  # the first row holds the units
    out = {name: _number(values[m]) for m, name in METRICS.items() if m in values}
    out["units"] = {name: units[m] for m, name in METRICS.items() if m in values and units[m]}
    stalls = {m[len(STALL[0]):-len(STALL[1])]: _number(v) for m, v in values.items()
              if m.startswith(STALL[0]) and m.endswith(STALL[1]) and _number(v)}
    total = sum(stalls.values())
    out["stalls_per_issue"] = dict(sorted(((k, round(v, 3)) for k, v in stalls.items() if v >= 0.01), key=lambda kv: -kv[1]))
    out["cycles_per_issue"] = round(total, 3)  # stalled warps per issue, summed (one warp per scheduler: cycles)
    return out


def summarize_sass(path: Path, top: int = 25) -> dict:
    """The ``top`` SASS instructions by stall samples (in program order), with their two main reasons."""
    head, rows = _table(path, "Source")
    samples = "Warp Stall Sampling (All Samples)"
    total = sum(_number(r[head.index(samples)]) or 0 for r in rows)
    stall_cols = [c for c in head if c.startswith("stall_") and "(Not" not in c]
    picked = sorted(range(len(rows)), key=lambda i: -(_number(rows[i][head.index(samples)]) or 0))[:top]
    lines = []
    for i in sorted(picked):
        r = dict(zip(head, rows[i]))
        reasons = sorted(((c[6:], _number(r[c]) or 0) for c in stall_cols), key=lambda kv: -kv[1])[:2]
        lines.append({"index": i, "sass": r["Source"].strip(), "pct_of_samples": round(100 * (_number(r[samples]) or 0) / total, 2),
                      "executed": _number(r["Instructions Executed"]), "main_stalls": {k: v for k, v in reasons if v}})
    by_op = {}
    for r in rows:  # stall samples summed by opcode (the mnemonic without its predicate and modifiers)
        words = [w for w in r[head.index("Source")].split() if not w.startswith("@")]
        op = words[0].split(".")[0] if words else ""
        by_op[op] = by_op.get(op, 0) + (_number(r[head.index(samples)]) or 0)
    return {"instructions": len(rows), "samples": total, "top_instructions": lines,
            "pct_of_samples_by_opcode": {k: round(100 * v / total, 1) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:15]}}


def run_ncu(shape: str, out_dir: Path, sass_kernel: str, op: str = "gdn") -> list[str]:
    """ncu once per kernel of ``op`` on the third call; raw metrics to ``raw<kernel>.csv``, SASS of
    ``sass_kernel`` to ``sass.csv``. Returns the ncu command lines."""
    B, T, HQ, H, K, V = SHAPES[shape]
    script = out_dir / "forward.py"
    scripts = str(Path(__file__).resolve().parent)
    script.write_text(FORWARD.format(scripts=scripts, shape=(B, T, HQ, H, K, V), scale=K**-0.5, kda=op == "kda"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(scripts).parent), os.environ.get("PYTHONPATH", "")])}
    commands = []
    for kern in KERNELS[op]:
        rep = out_dir / f"{kern}.ncu-rep"
        cmd = [*NCU, "-k", f"regex:{kern}", "-f", "-o", str(rep.with_suffix("")), sys.executable, str(script)]
        commands.append(" ".join(cmd))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out_dir / f"raw{kern}.csv", "w") as f:
            subprocess.run(["ncu", "-i", str(rep), "--page", "raw", "--csv"], check=True, stdout=f)
        if kern == sass_kernel:
            with open(out_dir / "sass.csv", "w") as f:
                subprocess.run(["ncu", "-i", str(rep), "--page", "source", "--csv", "--print-source", "sass"],
                               check=True, stdout=f)
    return commands


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--shape", default="2x8192", choices=list(SHAPES))
    p.add_argument("--op", choices=tuple(KERNELS), default="gdn", help="the operator: gdn (forward) or kda "
                   "(forward+backward)")
    p.add_argument("--sass", default="_state_kernel", choices=sorted({k for ks in KERNELS.values() for k in ks}),
                   help="the kernel whose SASS stalls are kept")
    p.add_argument("--raw-dir", type=Path, default=None, help="summarize CSVs collected earlier instead of running ncu")
    args = p.parse_args()
    if args.sass not in KERNELS[args.op]:
        p.error(f"--sass {args.sass} is not a kernel of {args.op}: one of {', '.join(KERNELS[args.op])}")
    out = {"command": " ".join(["python", *sys.argv]), "shape": args.shape, "op": args.op,
           "ncu_options": " ".join(NCU[1:]),
           "reading": "stalls_per_issue: stalled warps per issued instruction by reason (ncu's "
                      "smsp__average_warps_issue_stalled_*_per_issue_active); 'selected' is the issue itself"}
    with tempfile.TemporaryDirectory() as tmp:
        raw = args.raw_dir or Path(tmp)
        if args.raw_dir is None:
            import torch
            import triton

            out.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       ncu=subprocess.run(["ncu", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
            out["ncu_commands"] = run_ncu(args.shape, raw, args.sass, args.op)
        out["kernels"] = {k: summarize_raw(raw / f"raw{k}.csv") for k in KERNELS[args.op] if (raw / f"raw{k}.csv").exists()}
        if (raw / "sass.csv").exists():
            out[f"sass{args.sass}"] = summarize_sass(raw / "sass.csv")
    for k, s in out["kernels"].items():
        top = ", ".join(f"{r} {v}" for r, v in list(s["stalls_per_issue"].items())[:5])
        print(f"{k:16s} {s.get('duration', 0):7.1f} {s['units'].get('duration', '')}  regs {s.get('registers_per_thread')}  "
              f"warps/SM {s.get('warps_per_sm', 0):.1f}  issue {s.get('issue_active_pct', 0):.0f}%  "
              f"DRAM active {s.get('dram_active_pct', 0):.0f}%  wgmma {s.get('wgmma_pipe_pct', 0):.1f}%  | {top}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
