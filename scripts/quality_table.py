"""The quality table of a finished ``linearize distill`` run: held-out perplexity of the teacher, of the
converted model at init, after each stage, with tokens used and wall time.

    python scripts/quality_table.py runs/smollm2-135m-gdn-gpu --wall-s 312 --output results/quality_gpu.json

(``scripts/gpu_report.sh --only quality OUT TEACHER DATA.jsonl`` runs the GPU recipe and then this.)

Reads the run directory's ``initial_eval.json``, ``metrics.jsonl`` (the evaluation at the end of each
stage) and ``recipe.yaml``; tokens = steps × batch × seq_len per stage (the global batch).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import OmegaConf


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("--wall-s", type=float, default=None, help="wall time of the whole command, measured outside")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    for name in ("recipe.yaml", "initial_eval.json", "metrics.jsonl"):
        if not (args.run / name).is_file():
            p.exit(2, f"error: {args.run / name} not found: RUN must be the output.dir of a finished linearize distill run\n")
    recipe = OmegaConf.load(args.run / "recipe.yaml")
    initial = json.loads((args.run / "initial_eval.json").read_text())
    records = [json.loads(line) for line in (args.run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [{"point": "teacher", "ppl": initial["ppl_teacher"], "tokens": 0},
            {"point": "converted at init", "ppl": initial["ppl_student"], "kl": initial["kl"],
             "top1_agreement": initial["top1_agreement"], "tokens": 0}]
    tokens = 0
    for st in recipe.stages:
        tokens += st.steps * st.batch_size * recipe.data.seq_len
        end = [r for r in records if r.get("stage") == st.name and r.get("stage_step") == st.steps and "eval_kl" in r]
        if not end:
            raise SystemExit(f"error: no end-of-stage evaluation for stage {st.name!r} in {args.run}/metrics.jsonl")
        r = end[-1]
        speeds = sorted(x["tokens_per_s"] for x in records if x.get("stage") == st.name)
        rows.append({"point": f"after {st.name}", "ppl": r["eval_ppl_student"], "kl": r["eval_kl"],
                     "top1_agreement": r["eval_top1_agreement"], "tokens": tokens,
                     "median_tokens_per_s": speeds[len(speeds) // 2] if speeds else None})
    out = {"run": str(args.run), "teacher": recipe.teacher.model, "data": recipe.data.source,
           "eval_tokens": recipe.data.eval_tokens, "wall_s": args.wall_s, "rows": rows}
    print("| point | held-out ppl | KL | top-1 | tokens used |")
    print("|---|---|---|---|---|")
    for r in rows:
        kl = f"{r['kl']:.3f}" if "kl" in r else "–"
        top1 = f"{r['top1_agreement']:.3f}" if "top1_agreement" in r else "–"
        print(f"| {r['point']} | {r['ppl']:.2f} | {kl} | {top1} | {r['tokens']:,} |")
    if args.wall_s is not None:
        print(f"wall time {args.wall_s:.0f} s")
    if args.output:
        args.output.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
