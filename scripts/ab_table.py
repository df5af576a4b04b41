"""The table of an A/B of kernel timings: each variant's median over its rounds beside the baseline's.

    python scripts/ab_table.py results/ab_linear_output_group_h100 --base group_1
    python scripts/ab_table.py OUT/ab_linear --output results/ab_linear.json --markdown results/ab_linear.md

Reads the ``bench_kernels.py`` JSONs of one folder: ``<variant>.bench_kernels.json`` as ``scripts/ab.sh run``
writes them (``<variant>.r<k>.bench_kernels.json`` with ``AB_ROUNDS``), or ``<variant>.json`` as the kernels
step's ``AB_FLAGS`` writes them. Per operator and shape, each variant's forward and forward+backward: the median
of its rounds, their range (min–max), and the baseline's median over the variant's (> 1: the variant is faster).
One process can differ from the next by 10-20% on the same code (the GPU's clocks); a variant is faster only
where its range lies below the baseline's, which takes several rounds to tell.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

NAME = re.compile(r"^(?P<variant>.+?)(?:\.r(?P<round>\d+))?(?:\.bench_kernels)?\.json$")
TIMES = (("fwd", "ours_fwd_ms"), ("fwdbwd", "ours_fwdbwd_ms"))


def load(folder: Path) -> dict:
    """``{variant: {(op, shape, B, T, q heads, kv heads): {"fwd": [ms per round], "fwdbwd": [...]}}}``."""
    runs: dict = {}
    for path in sorted(folder.glob("*.json")):
        m = NAME.match(path.name)
        data = json.loads(path.read_text())
        if not m or not isinstance(data, dict) or "rows" not in data:
            continue
        shapes = runs.setdefault(m["variant"], {})
        for r in data["rows"]:
            key = (r.get("op", "gdn"), r["shape"], r["B"], r["T"], r["q_heads"], r["kv_heads"])
            for name, field in TIMES:
                if isinstance(r.get(field), (int, float)):
                    shapes.setdefault(key, {}).setdefault(name, []).append(r[field])
    return runs


def table(runs: dict, base: str) -> list[dict]:
    """One row per (variant, shape) the baseline also has: medians, ranges, rounds and speedups vs the base."""
    rows = []
    for variant, shapes in runs.items():
        for key, times in shapes.items():
            ref = runs[base].get(key)
            if ref is None:
                continue
            op, shape, B, T, HQ, H = key
            row = {"variant": variant, "op": op, "shape": shape, "B": B, "T": T, "q_heads": HQ, "kv_heads": H}
            for name, ms in times.items():
                row[f"{name}_ms"] = statistics.median(ms)
                row[f"{name}_min_ms"], row[f"{name}_max_ms"], row[f"{name}_rounds"] = min(ms), max(ms), len(ms)
                if name in ref:
                    row[f"{name}_speedup_vs_base"] = statistics.median(ref[name]) / row[f"{name}_ms"]
            rows.append(row)
    return sorted(rows, key=lambda r: (r["op"], r["shape"], r["B"], r["T"], r["q_heads"], r["variant"] != base,
                                       r["variant"]))


def markdown(rows: list[dict], base: str) -> str:
    def cell(r, name):
        if f"{name}_ms" not in r:
            return "–"
        spread = f" ({r[f'{name}_min_ms']:.3f}–{r[f'{name}_max_ms']:.3f})" if r[f"{name}_rounds"] > 1 else ""
        return f"{r[f'{name}_ms']:.3f}{spread}"

    def ratio(r, name):
        x = r.get(f"{name}_speedup_vs_base")
        return f"{x:.2f}×" if x is not None else "–"

    lines = [f"| op | shape | B×T | heads q/kv | variant | rounds | fwd ms (range) | f+b ms (range) | fwd {base}/variant "
             f"| f+b {base}/variant |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['op']} | {r['shape']} | {r['B']}×{r['T']} | {r['q_heads']}/{r['kv_heads']} | {r['variant']} | "
                     f"{r.get('fwd_rounds', r.get('fwdbwd_rounds'))} | {cell(r, 'fwd')} | {cell(r, 'fwdbwd')} | "
                     f"{ratio(r, 'fwd')} | {ratio(r, 'fwdbwd')} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a folder of bench_kernels.py JSONs, one or more per variant")
    p.add_argument("--base", default=None, help="the baseline variant (default: 'main' or 'default' where present, "
                   "else the first by name)")
    p.add_argument("--output", type=Path, default=None, help="the rows as JSON")
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder: give the folder of an A/B's JSONs", file=sys.stderr)
        return 2
    runs = load(args.folder)
    if not runs:
        print(f"error: no bench_kernels.py JSON in {args.folder}: run the A/B first (scripts/ab.sh run)", file=sys.stderr)
        return 2
    base = args.base or next((b for b in ("main", "default") if b in runs), sorted(runs)[0])
    if base not in runs:
        print(f"error: no variant '{base}' in {args.folder} (there: {', '.join(sorted(runs))})", file=sys.stderr)
        return 2
    rows = table(runs, base)
    text = markdown(rows, base)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.output:
        args.output.write_text(json.dumps({"folder": str(args.folder), "base": base, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
