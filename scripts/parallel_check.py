"""The distill trainer on several processes against one, on the same global batch, and a kill of one rank
continued with ``--resume``: the check of data parallel (``parallel: ddp``) and FSDP2 (``parallel: fsdp``).

    NCCL_NVLS_ENABLE=0 python scripts/parallel_check.py recipes/smollm2-135m-gdn-gpu.yaml --nproc 2 \\
        --work /root/pc --output results/distill_parallel_2gpu_vs_1gpu.json stages.0.steps=40 ...

Runs one after the other, each ``linearize distill RECIPE`` with the overrides given (every run the same):
one process; ``--nproc`` processes under torchrun with ``parallel=ddp``; the same with ``parallel=fsdp``;
and ``parallel=ddp`` again, its rank 1 killed (SIGKILL) once the run has logged ``--kill-after`` steps,
then continued with ``--resume``. Written per run: the steps logged, the median tokens/s of each stage
(``tokens_per_s``, which times each step alone) and the peak memory (rank 0's ``peak_mem_mib``, on a GPU);
per parallel run: each logged step's loss against one process's (relative difference, median and max) and
each stage's tokens/s against one process's; for the killed run: its records after the resume against
the uninterrupted ddp run's, every value but the timings (largest relative difference, and whether they
are identical). With ``device=cpu`` the same runs on gloo processes: the smoke run.
Bad input (no recipe, fewer than 2 processes, a kill before the first checkpoint): one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from linearize.config import RecipeError, load_recipe
from linearize.distill.metrics import read_metrics

TIMINGS = ("tokens_per_s", "peak_mem_mib")


def distill_cmd(nproc: int, recipe: Path, args: list[str], port: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "linearize", "distill", str(recipe), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(port),
            "-m", "linearize", "distill", str(recipe), *args]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(cmd: list[str], log: Path) -> float:
    """Run to the end (output into ``log``); its seconds. A failed run stops the check with its log's end."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"{' '.join(cmd)} failed (exit {code}); the end of {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - t0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += kids
        todo += kids
    return found


def rank_process(pid: int, rank: int) -> int | None:
    """The worker of torchrun ``pid`` whose environment says ``RANK=rank``."""
    for p in descendants(pid):
        try:
            env = Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            return p
    return None


def run_and_kill(cmd: list[str], out: Path, after: int, log: Path, timeout_s: float) -> int:
    """Start ``cmd`` (torchrun); once ``out/metrics.jsonl`` holds a step ≥ ``after``, SIGKILL its rank 1 and
    wait for torchrun to end. The last step logged before the kill."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None and time.monotonic() < deadline:
            recs = read_metrics(out)  # rank 0 may be mid-line: a torn last line is skipped
            if recs and recs[-1]["step"] >= after:
                victim = rank_process(proc.pid, 1)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    break
            time.sleep(0.02)
        else:
            proc.kill()
            sys.exit(f"the run to be killed ended or stalled before logging step {after} (see {log}); "
                     "give it more steps or a smaller --kill-after")
        code = proc.wait(timeout=timeout_s)
    if code == 0:
        sys.exit(f"torchrun exited 0 after its rank 1 was killed (see {log}); the kill came too late")
    return max(r["step"] for r in read_metrics(out))


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def stage_medians(recs: list[dict]) -> dict:
    stages = dict.fromkeys(r["stage"] for r in recs)
    return {s: statistics.median(r["tokens_per_s"] for r in recs if r["stage"] == s) for s in stages}


def summary(recs: list[dict], seconds: float) -> dict:
    peaks = [r["peak_mem_mib"] for r in recs if "peak_mem_mib" in r]
    return {"steps_logged": len(recs), "seconds": seconds, "median_tokens_per_s": stage_medians(recs),
            "peak_mem_mib": max(peaks) if peaks else None}


def against_one(recs: list[dict], one: list[dict], one_tps: dict) -> dict:
    base = {r["step"]: r["loss"] for r in one}
    diffs = [rel(r["loss"], base[r["step"]]) for r in recs if r["step"] in base]
    tps = stage_medians(recs)
    return {"common_steps": len(diffs), "loss_rel_diff_median": statistics.median(diffs),
            "loss_rel_diff_max": max(diffs), "scaling": {s: tps[s] / one_tps[s] for s in tps if s in one_tps}}


def values(rec: dict) -> dict:
    """A record's numbers but the timings, per-layer losses flattened."""
    flat = {}
    for k, v in rec.items():
        if k in TIMINGS or isinstance(v, str):
            continue
        flat.update({f"{k}[{i}]": x for i, x in v.items()} if isinstance(v, dict) else {k: v})
    return flat


def resume_check(resumed: list[dict], straight: list[dict]) -> dict:
    a = {r["step"]: values(r) for r in resumed}
    b = {r["step"]: values(r) for r in straight}
    worst, identical = 0.0, a == b
    for step in a.keys() & b.keys():
        for k in a[step].keys() & b[step].keys():
            if math.isfinite(b[step][k]):
                worst = max(worst, rel(a[step][k], b[step][k]))
    return {"same_steps": sorted(a) == sorted(b), "identical": identical, "max_rel_diff": worst}


def markdown(result: dict) -> str:
    runs = result["runs"]
    stages = list(runs["one"]["median_tokens_per_s"])
    head = ["run", "loss rel. diff median / max"] + [f"{s} tokens/s (×one)" for s in stages] + ["peak MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in runs.items():
        cmp = result["against_one"].get(name)
        cells = [name, f"{cmp['loss_rel_diff_median']:.1e} / {cmp['loss_rel_diff_max']:.1e}" if cmp else "–"]
        for s in stages:
            tps = r["median_tokens_per_s"].get(s)
            cells.append(f"{tps:,.0f}" + (f" ({cmp['scaling'][s]:.2f}×)" if cmp and s in cmp["scaling"] else ""))
        cells.append(f"{r['peak_mem_mib']:,.0f}" if r["peak_mem_mib"] is not None else "–")
        lines.append("| " + " | ".join(cells) + " |")
    k = result["kill"]
    lines.append(f"\nddp with rank 1 killed after step {k['killed_after_step']}, resumed from step "
                 f"{k['resumed_from_step']}: records {'identical to' if k['identical'] else 'against'} the "
                 f"uninterrupted ddp run's (largest relative difference {k['max_rel_diff']:.1e})")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipe", type=Path)
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value), the same for every run")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--work", type=Path, required=True, help="a fresh folder for the runs' output.dirs and logs")
    p.add_argument("--kill-after", type=int, default=None,
                   help="kill rank 1 once this step is logged (default: one step past the first checkpoint)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the killed run may take to get there")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()
    if not args.recipe.is_file():
        p.exit(2, f"error: no recipe {args.recipe}; give a recipe file\n")
    if args.nproc < 2:
        p.exit(2, "error: --nproc must be at least 2 (it is compared with one process)\n")
    if args.work.exists() and any(args.work.iterdir()):
        p.exit(2, f"error: --work {args.work} is not empty; give a fresh folder\n")
    if any(o.split("=", 1)[0] in ("output.dir", "parallel") for o in args.overrides):
        p.exit(2, "error: output.dir and parallel are the check's own; leave them out of the overrides\n")
    try:
        cfg = load_recipe(args.recipe, args.overrides)
    except RecipeError as e:
        p.exit(2, f"error: {e}\n")
    every = cfg.output.checkpoint_every
    after = args.kill_after if args.kill_after is not None else every + 1
    total = sum(st.steps for st in cfg.stages)
    if not every < after < total:
        p.exit(2, f"error: --kill-after {after} must lie past the first checkpoint (step {every}) and before the "
                  f"last step ({total}); set it or output.checkpoint_every\n")
    args.work.mkdir(parents=True, exist_ok=True)
    dirs = {name: args.work / name for name in ("one", "ddp", "fsdp", "ddp_killed")}
    cmds = {name: distill_cmd(1 if name == "one" else args.nproc, args.recipe,
                              [*args.overrides, f"output.dir={d}"] + ([] if name == "one" else
                              [f"parallel={'fsdp' if name == 'fsdp' else 'ddp'}"]), free_port())
            for name, d in dirs.items()}
    seconds = {name: run(cmds[name], args.work / f"{name}.log") for name in ("one", "ddp", "fsdp")}
    t0 = time.perf_counter()
    killed_at = run_and_kill(cmds["ddp_killed"], dirs["ddp_killed"], after, args.work / "ddp_killed.log", args.timeout)
    ckpts = sorted(int(c.stem.split("_")[1]) for c in (dirs["ddp_killed"] / "checkpoints").glob("step_*.pt"))
    resume_cmd = distill_cmd(args.nproc, args.recipe, [*args.overrides, f"output.dir={dirs['ddp_killed']}",
                                                       "parallel=ddp", "--resume"], free_port())
    run(resume_cmd, args.work / "ddp_resumed.log")
    seconds["ddp_killed"] = time.perf_counter() - t0
    recs = {name: read_metrics(d) for name, d in dirs.items()}
    result = {
        "recipe": str(args.recipe), "overrides": args.overrides, "nproc": args.nproc,
        "commands": {**{k: " ".join(v) for k, v in cmds.items()}, "resume": " ".join(resume_cmd)},
        "device": device_line(cfg.device, args.nproc),
        "runs": {name: summary(recs[name], seconds[name]) for name in dirs},
    }
    one_tps = result["runs"]["one"]["median_tokens_per_s"]
    result["against_one"] = {name: against_one(recs[name], recs["one"], one_tps) for name in ("ddp", "fsdp")}
    result["kill"] = {"killed_after_step": killed_at, "resumed_from_step": ckpts[-1] if ckpts else None,
                      **resume_check(recs["ddp_killed"], recs["ddp"])}
    md = markdown(result)
    print(md)
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(md + "\n")


def device_line(device: str, nproc: int) -> str:
    if device in ("auto", "cuda") and torch.cuda.is_available():
        names = {torch.cuda.get_device_name(i) for i in range(min(nproc, torch.cuda.device_count()))}
        return f"{nproc} × {', '.join(sorted(names))} (NCCL), one after the other in one call"
    return f"{nproc} gloo processes on the CPU"


if __name__ == "__main__":
    main()
