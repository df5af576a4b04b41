"""Every passkey figure under results/ counted again without the key placed right before the question.

    python scripts/passkey_recount.py --output results/passkey_far_depths_recount.json

Runs measured before ``linearize eval`` dropped depth 1.0 (``linearize/quality/passkey.py``) placed one key of five
at the end of the filler: its sentence ends 35 tokens before the prompt does, inside every converted block's exact
window, so that cell tests no long-range retrieval; and SmolLM2-135M-Instruct answers " the pass key." there at
every length, with or without YaRN, so the teacher scores 0 on it where students score it at random. This reads the
per-trial records every stored run kept (``"records"``: length, depth, key, correct) and gives, per run, model and
length, the accuracy as it was reported (every depth) beside the accuracy over the depths before 1.0 — the depths
``linearize eval`` asks now, though a run of it now draws other keys (per cell) — and the depth-1.0 cell alone.
Files that kept accuracies per depth but no trials (``passkey_gemma3_global_layers_at_conversion.json``) are not
read. Writes JSON and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def passkey_runs(doc, path=()):
    """``(path, records)`` for every dict holding passkey trial records, anywhere in a results document."""
    if isinstance(doc, dict):
        recs = doc.get("records")
        if isinstance(recs, list) and recs and isinstance(recs[0], dict) and {"depth", "correct", "length"} <= set(recs[0]):
            yield path, recs
            return
        for k, v in doc.items():
            yield from passkey_runs(v, path + (str(k),))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from passkey_runs(v, path + (str(i),))


def pct(rows) -> float | None:
    return round(100 * sum(r["correct"] for r in rows) / len(rows), 1) if rows else None


def recount(records: list[dict]) -> dict:
    out = {}
    for n in sorted({r["length"] for r in records}):
        rows = [r for r in records if r["length"] == n]
        far = [r for r in rows if r["depth"] < 1.0]
        last = [r for r in rows if r["depth"] >= 1.0]
        out[str(n)] = {"reported": pct(rows), "before_the_end": pct(far), "trials": len(far),
                       "depth_1": f"{sum(r['correct'] for r in last)}/{len(last)}" if last else None}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "results")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    rows = []
    for f in sorted(args.results.rglob("*.json")):
        try:
            doc = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        for path, records in passkey_runs(doc):
            who = "/".join(x for x in path if x not in ("results", "passkey", "runs"))
            rows.append({"file": str(f.relative_to(args.results)), "model": who or "model", "lengths": recount(records)})
    lines = ["| file | model | length | as reported, % | depths before the end, % (trials) | depth 1.0 correct |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for n, c in r["lengths"].items():
            lines.append(f"| {r['file']} | {r['model']} | {n} | {c['reported']} | {c['before_the_end']} ({c['trials']}) "
                         f"| {c['depth_1'] or '–'} |")
    table = "\n".join(lines)
    if args.output:
        meta = {"command": " ".join(["python", *sys.argv]), "runs": rows}
        args.output.write_text(json.dumps(meta, indent=1) + "\n")
        args.output.with_suffix(".md").write_text(
            "# Passkey accuracy without the key placed right before the question\n\n"
            f"`{meta['command']}`\n\n" + (__doc__.split("\n\n", 2)[2].strip()) + "\n\n" + table + "\n")
    print(table)


if __name__ == "__main__":
    main()
