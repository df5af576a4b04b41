"""One ablation table from several ``linearize distill`` runs (and their ``linearize eval -o X.json``).

    python scripts/ablation_table.py gdn=runs/gdn:results/gdn_eval.json window64=runs/w64 --output results/ablation.json

Each ``NAME=RUN_DIR[:EVAL_JSON]`` is one variant (``NAME=:EVAL_JSON``: an evaluation alone, e.g. of a model as
converted, before any training). From the run directory (``output.dir``):

- ``metrics.jsonl``: the align loss at the end of the align stage, as the mean of the last 5 logged
  align steps (one step is noisy), over layers (unweighted mean of ``layer_loss``) and per layer; the
  last evaluation of the align stage and the last one of the run (student and teacher perplexity, their
  ratio, KL(teacher ‖ student), top-1 agreement); step seconds per stage = Σ batch·seq_len / tokens_per_s
  over the logged steps (the training steps only: evaluations and checkpoints are not timed in it);
- ``recipe.yaml`` (saved by ``linearize distill``): tokens per stage = steps run × batch_size × seq_len;
- ``initial_eval.json``, where present: the student at init.

From the eval JSON, where given: the 6-task average and each task's primary metric, per-domain perplexity
and passkey accuracy, beside the teacher's from the same file — or, for evaluations run with
``--teacher none`` (several models measured at once), from ``--teacher-eval``: the teacher alone on the
same rows (``linearize eval -m TEACHER`` with the same options). Writes ``--output`` (JSON, with
``command``) and the markdown tables beside it (``.md``), and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

LAST_K = 5  # logged align steps averaged for the end-of-align loss


def read_records(run: Path) -> list[dict]:
    recs = []
    for line in (run / "metrics.jsonl").read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a torn last line
            continue
        if isinstance(rec, dict) and "step" in rec:
            recs.append(rec)
    return recs


def segments(recs: list[dict]) -> list[list[dict]]:
    """The records split into the recipe's stages, in order (a new stage: another name, or stage_step resets)."""
    segs: list[list[dict]] = []
    for r in recs:
        if not segs or r["stage"] != segs[-1][-1]["stage"] or r["stage_step"] <= segs[-1][-1]["stage_step"]:
            segs.append([])
        segs[-1].append(r)
    return segs


def eval_point(rec: dict | None, prefix: str = "eval_") -> dict | None:
    if rec is None:
        return None
    s, t = rec[prefix + "ppl_student"], rec[prefix + "ppl_teacher"]
    point = {"step": rec.get("step", 0), "ppl_student": s, "ppl_teacher": t, "ppl_ratio": s / t,
             "kl": rec[prefix + "kl"], "top1_agreement": rec[prefix + "top1_agreement"]}
    if prefix + "ppl_student_far" in rec:  # the predictions with 512+ tokens of their document before them
        point["ppl_ratio_far"] = rec[prefix + "ppl_student_far"] / rec[prefix + "ppl_teacher_far"]
        point["kl_far"] = rec[prefix + "kl_far"]
    return point


def load_recipe(run: Path):
    from omegaconf import OmegaConf

    from linearize.config import RecipeConfig

    p = run / "recipe.yaml"
    if not p.is_file():
        return None
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RecipeConfig), OmegaConf.load(p)))


def training(run: Path) -> dict:
    recs, cfg = read_records(run), load_recipe(run)
    if not recs:
        raise SystemExit(f"error: {run / 'metrics.jsonl'} holds no records")
    segs = segments(recs)
    if cfg is None:
        print(f"warning: {run}/recipe.yaml not found: no tokens per stage", file=sys.stderr)
    elif len(segs) > len(cfg.stages) or any(s[0]["stage"] != c.name for s, c in zip(segs, cfg.stages)):
        raise SystemExit(f"error: {run}: metrics.jsonl's stages {[s[0]['stage'] for s in segs]} do not match "
                         f"recipe.yaml's {[c.name for c in cfg.stages]}")
    out = {"stages": [], "curve": []}  # curve: every held-out evaluation against the training tokens before it
    seen = 0
    for i, seg in enumerate(segs):
        st = cfg.stages[i] if cfg is not None else None
        done = seg[-1]["stage_step"]
        row = {"name": seg[0]["stage"], "steps": done, "logged_steps": len(seg)}
        if st is not None:
            from linearize.config import stage_seq_len

            seq_len = stage_seq_len(cfg, st)
            per_step = st.batch_size * seq_len
            row.update(planned_steps=st.steps, batch_size=st.batch_size, seq_len=seq_len,
                       tokens=done * per_step,
                       step_seconds=sum(per_step / r["tokens_per_s"] for r in seg if r.get("tokens_per_s")))
            out["curve"] += [{"tokens": seen + r["stage_step"] * per_step, **eval_point(r)} for r in seg if "eval_kl" in r]
            seen += done * per_step
        out["stages"].append(row)
    aligns = [s for s in segs if s[0]["stage"] == "align"]
    if aligns:
        last = [r for r in aligns[-1] if "layer_loss" in r][-LAST_K:] or aligns[-1][-LAST_K:]
        layers = sorted({k for r in last for k in r.get("layer_loss", {})}, key=int)
        per_layer = {k: sum(r["layer_loss"][k] for r in last) / len(last) for k in layers}
        out["align"] = {"steps_averaged": [r["stage_step"] for r in last],
                        "loss_mean_over_layers": (sum(per_layer.values()) / len(per_layer) if per_layer
                                                  else sum(r["loss"] for r in last) / len(last)),
                        "layers": len(per_layer),
                        "logged_loss": sum(r["loss"] for r in last) / len(last),  # layer_weights-weighted
                        "layer_loss": per_layer}
        out["eval_after_align"] = eval_point(next((r for r in reversed(aligns[-1]) if "eval_kl" in r), None))
    out["eval_final"] = eval_point(next((r for r in reversed(recs) if "eval_kl" in r), None))
    init = run / "initial_eval.json"
    out["eval_init"] = eval_point(json.loads(init.read_text()), "") if init.is_file() else None
    if out["eval_init"] is not None and cfg is not None:
        out["curve"].insert(0, {"tokens": 0, **out["eval_init"]})
    return out


def plot(variants: dict, path: Path) -> None:
    """Held-out perplexity against training tokens, one line per variant, the teacher dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    teacher = None
    for name, v in variants.items():
        c = v["training"]["curve"]
        if c:
            ax.plot([p["tokens"] / 1e6 for p in c], [p["ppl_student"] for p in c], "o-", ms=3, label=name)
            teacher = c[-1]["ppl_teacher"]
    if teacher is not None:
        ax.axhline(teacher, ls="--", c="k", lw=1, label=f"teacher ({teacher:.2f})")
    ax.set(xlabel="training tokens (M), align then distill", ylabel="held-out perplexity", yscale="log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quality(path: Path) -> dict:
    """The eval JSON's scores per side (model, teacher): task → primary metric, average, perplexity, passkey."""
    d = json.loads(path.read_text())
    primary = d.get("harness", {}).get("primary", {})
    sides = {}
    for side, r in d["results"].items():
        h = r.get("harness", {})
        sides[side] = {"tasks": {t: h[t][m] for t, m in primary.items() if t in h}, "average": h.get("average"),
                       "perplexity": {dom: v["ppl"] for dom, v in r.get("perplexity", {}).items()},
                       "by_context": {f"{dom}, context {span}": c["ppl"] for dom, v in r.get("perplexity", {}).items()
                                      for span, c in v.get("by_context", {}).items()},
                       "nll_by_length": {dom: v["nll_by_context_length"] for dom, v in r.get("perplexity", {}).items()
                                         if "nll_by_context_length" in v},
                       "passkey": {n: v["acc"] for n, v in r.get("passkey", {}).get("lengths", {}).items()}}
    return {"file": str(path), "command": d.get("command"), "models": d.get("models"), "primary": primary,
            "limit": d.get("plan", {}).get("limit"), "split": d.get("plan", {}).get("corpus_split", "heldout"), **sides}


def span_of(side: dict, span: str) -> float | None:
    """A side's perplexity over ``span`` ("prose, context 1093-2047"): as measured, or, for a file measured
    alone at other spans (a teacher), from its perplexity at every context length where the file has it."""
    if span in side.get("by_context", {}):
        return side["by_context"][span]
    dom, _, lengths = span.partition(", context ")
    by_length = side.get("nll_by_length", {}).get(dom)
    first, _, last = lengths.partition("-")
    if by_length is None or not (first.isdigit() and last.isdigit()) or int(last) > len(by_length):
        return None
    from linearize.quality.perplexity import span_perplexity

    return span_perplexity(by_length, int(first), int(last))


def for_json(variants: dict) -> dict:
    """``variants`` as the JSON keeps them: the teacher's spans completed at its model's where its file allows
    (:func:`span_of`), the NLL at every context length they came from left out (thousands of numbers a file,
    in the eval JSONs already)."""
    out = {}
    for name, v in variants.items():
        q = v.get("quality")
        if q:
            spans = list(q["model"].get("by_context", {}))
            sides = {}
            for side in ("model", "teacher"):
                if q.get(side):
                    found = {sp: span_of(q[side], sp) for sp in spans}
                    sides[side] = {**{k: x for k, x in q[side].items() if k != "nll_by_length"},
                                   "by_context": {**q[side]["by_context"], **{k: x for k, x in found.items() if x}}}
            q = {**q, **sides}
        out[name] = {**v, "quality": q}
    return out


# --- markdown ------------------------------------------------------------------------------------

def f(v, kind="g"):
    if v is None:
        return "–"
    return {"pct": f"{100 * v:.1f}", "ppl": f"{v:.2f}", "loss": f"{v:.4f}", "tok": f"{v / 1e6:.2f}M",
            "s": f"{v:.0f}", "g": f"{v:.3g}"}[kind]


def table(title: str, cols: list[str], rows: list[list[str]]) -> list[str]:
    return [f"**{title}**", "", "| " + " | ".join(cols) + " |", "|" + "|".join(" --- " for _ in cols) + "|",
            *["| " + " | ".join(r) + " |" for r in rows], ""]


def markdown(variants: dict, command: str) -> str:
    names = list(variants)
    tr = {n: v["training"] for n, v in variants.items()}
    lines = [f"`{command}`", ""]
    rows = []
    for key, label in (("eval_init", "at init"), ("eval_after_align", "after align"), ("eval_final", "final")):
        if not any(tr[n].get(key) for n in names):
            continue
        for m, kind, what in (("ppl_student", "ppl", "student ppl"), ("ppl_teacher", "ppl", "teacher ppl"),
                              ("ppl_ratio", "ppl", "ppl ratio (student / teacher)"), ("kl", "loss", "KL(teacher ‖ student)"),
                              ("top1_agreement", "pct", "top-1 agreement, %"),
                              ("ppl_ratio_far", "ppl", "ppl ratio past 512 tokens of a document"),
                              ("kl_far", "loss", "KL past 512 tokens of a document")):
            if m.endswith("_far") and not any((tr[n].get(key) or {}).get(m) for n in names):
                continue  # records from before the far split
            rows.append([label, what, *[f((tr[n].get(key) or {}).get(m), kind) for n in names]])
    rows.append(["align", f"loss, mean over layers (last {LAST_K} logged steps)",
                 *[f(tr[n].get("align", {}).get("loss_mean_over_layers"), "loss") for n in names]])
    rows.append(["align", "layers in that mean (converted)", *[str(tr[n].get("align", {}).get("layers", "–")) for n in names]])
    stage_names = list(dict.fromkeys(s["name"] for n in names for s in tr[n]["stages"]))
    for sn in stage_names:
        pick = {n: [s for s in tr[n]["stages"] if s["name"] == sn] for n in names}
        rows.append([sn, "steps", *[" + ".join(str(s["steps"]) for s in pick[n]) or "–" for n in names]])
        rows.append([sn, "tokens (steps × batch × seq_len)",
                     *[" + ".join(f(s.get("tokens"), "tok") for s in pick[n]) or "–" for n in names]])
        rows.append([sn, "step seconds (training steps, logged)",
                     *[" + ".join(f(s.get("step_seconds"), "s") for s in pick[n]) or "–" for n in names]])
    lines += table("training (held-out evaluation during the run)", ["point", "metric", *names], rows)
    layers = sorted({k for n in names for k in tr[n].get("align", {}).get("layer_loss", {})}, key=int)
    if layers:
        lines += table(f"align loss per layer (mean of the last {LAST_K} logged align steps; – : layer not converted)",
                       ["layer", *names], [[k, *[f(tr[n].get("align", {}).get("layer_loss", {}).get(k), "loss") for n in names]]
                                           for k in layers])
    q = {n: v["quality"] for n, v in variants.items() if v.get("quality")}
    if q:
        qn = list(q)
        teachers = {n: q[n].get("teacher") for n in qn}
        same = all(t == teachers[qn[0]] for t in teachers.values())
        tcols = [("teacher", qn[0])] if same and teachers[qn[0]] else [(f"teacher ({n})", n) for n in qn if teachers[n]]
        cols = [*qn, *[c for c, _ in tcols]]
        sides = [q[n]["model"] for n in qn] + [teachers[n] for _, n in tcols]

        def rows_of(part, key, kind):
            return [f(s[part].get(key) if key is not None else s[part], kind) for s in sides]

        rows = []
        tasks = list(dict.fromkeys(t for n in qn for t in q[n]["primary"]))
        for t in tasks:
            metric = next(q[n]["primary"][t] for n in qn if t in q[n]["primary"])
            rows.append([f"{t} ({metric}), %", *rows_of("tasks", t, "pct")])
        if tasks:
            rows.append([f"{len(tasks)}-task average, %", *rows_of("average", None, "pct")])
        splits = {q[n].get("split", "heldout") for n in qn}  # older files name none: they read heldout
        if len(splits) > 1:
            sys.exit("error: the eval files measured perplexity on different corpus splits "
                     f"({', '.join(sorted(splits))}); measure them all on one (linearize eval --corpus-split)")
        for dom in dict.fromkeys(d for n in qn for d in q[n]["model"]["perplexity"]):
            rows.append([f"perplexity: {dom}", *rows_of("perplexity", dom, "ppl")])
        for span in dict.fromkeys(x for n in qn for x in q[n]["model"].get("by_context", {})):
            rows.append([f"perplexity: {span}", *[f(span_of(s, span), "ppl") for s in sides]])
        for ln in dict.fromkeys(x for n in qn for x in q[n]["model"]["passkey"]):
            rows.append([f"passkey {ln}, %", *rows_of("passkey", ln, "pct")])
        limits = sorted({str(q[n]["limit"]) for n in qn})
        lines += table(f"quality (linearize eval; limit {', '.join(limits)} rows per task; perplexity on the "
                       f"{splits.pop()} split)", ["metric", *cols], rows)
    return "\n".join(lines)


def parse_variant(spec: str) -> tuple[str, Path | None, Path | None]:
    name, sep, rest = spec.partition("=")
    run, _, ev = rest.partition(":")
    if not sep or not name or not (run or ev):
        raise SystemExit(f"error: {spec!r} is not NAME=RUN_DIR[:EVAL_JSON] or NAME=:EVAL_JSON")
    run_p, ev_p = Path(run) if run else None, Path(ev) if ev else None
    if run_p is not None and not (run_p / "metrics.jsonl").is_file():
        raise SystemExit(f"error: {run_p / 'metrics.jsonl'} not found: RUN_DIR must be a linearize distill output.dir")
    if ev_p is not None and not ev_p.is_file():
        raise SystemExit(f"error: eval JSON {ev_p} not found")
    return name, run_p, ev_p


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+", metavar="NAME=RUN_DIR[:EVAL_JSON]")
    p.add_argument("--output", type=Path, required=True, help="JSON to write; the markdown goes beside it (.md)")
    p.add_argument("--teacher-eval", type=Path, help="eval JSON of the teacher alone (linearize eval -m TEACHER): the "
                   "teacher column of variants evaluated with --teacher none, on the same rows")
    p.add_argument("--plot", type=Path, help="also draw held-out perplexity against training tokens here (PNG)")
    args = p.parse_args()
    parsed = [parse_variant(s) for s in args.variants]
    if len({n for n, _, _ in parsed}) != len(parsed):
        raise SystemExit("error: variant names must differ")
    variants = {n: {"run_dir": str(run) if run else None, "eval_json": str(ev) if ev else None,
                    "training": training(run) if run else {"stages": [], "curve": []},
                    "quality": quality(ev) if ev else None} for n, run, ev in parsed}
    if args.teacher_eval is not None:
        if not args.teacher_eval.is_file():
            raise SystemExit(f"error: teacher eval JSON {args.teacher_eval} not found")
        alone = quality(args.teacher_eval)
        for v in variants.values():
            if v["quality"] and not v["quality"].get("teacher"):
                v["quality"]["teacher"] = alone["model"]
                v["quality"]["teacher_file"] = alone["file"]
    command = shlex.join(["python", *sys.argv])
    md = markdown(variants, command)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    note = (f"align loss: mean of the last {LAST_K} logged align steps (per layer, and the unweighted mean over "
            "layers); step_seconds: sum of batch*seq_len/tokens_per_s over logged steps (no eval or checkpoint time)")
    args.output.write_text(json.dumps({"command": command, "note": note, "variants": for_json(variants)}, indent=1) + "\n")
    args.output.with_suffix(".md").write_text(md + "\n")
    if args.plot is not None:
        plot(variants, args.plot)
    print(md)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as e:  # bad input: its one line on stderr, exit code 2
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            sys.exit(2)
        raise
