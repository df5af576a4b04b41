"""What each block option can represent of its teacher, at no training tokens: per layer, the held-out error
of the converted block against the teacher's attention output, as converted and after fitting the block's
own parameters to the teacher on calibration text (:func:`linearize.fidelity.target_fidelity`).

    python scripts/block_capacity.py --model smollm2-135m --fit-steps 200 \\
        --variant base=window=64,sinks=4 --variant pure=window=0 --variant gate=window=64,sinks=4,output_gate=true \\
        --targets gdn kda --output results/block_capacity_smollm2.json

Each ``--variant NAME=key=value,...`` is a set of :class:`~linearize.layers.options.GDNOptions`; each is built
for every ``--targets`` (``linear`` drops the window, as ``convert`` does). The teacher is loaded once; the
JSON is rewritten after every variant, so a stopped run keeps what it measured; ``--markdown`` writes the
summary table (median over layers, as converted → fitted) beside it.

This is a capacity probe, not a training result: the fit moves only the block's new parameters (ρ, the β and
decay corrections, the mix's bias, kda's per-channel decay, the gate, the convolution, the write strength),
layer by layer on the teacher's own inputs, never q/k/v/o. Training moves those too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_variant(text: str) -> tuple[str, dict]:
    from linearize.layers.options import GDNOptions

    name, _, spec = text.partition("=")
    if not name or not spec:
        raise SystemExit(f"error: --variant {text!r}: write NAME=key=value,... (e.g. base=window=64,sinks=4)")
    types = {f.name: f.type for f in fields(GDNOptions)}
    opts = {}
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key not in types:
            raise SystemExit(f"error: --variant {name}: unknown option {key!r}; options: {', '.join(types)}")
        opts[key] = value.lower() == "true" if value.lower() in ("true", "false") else int(value) if value.lstrip("-").isdigit() else value
    GDNOptions(**opts)  # a bad value stops here, before the teacher loads
    return name, opts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variant", action="append", required=True, help="NAME=key=value,... (GDNOptions)")
    p.add_argument("--targets", nargs="+", default=["gdn"])
    p.add_argument("--fit-steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--tokens", type=int, default=512, help="tokens a row, calibration and held-out alike")
    p.add_argument("--rows", type=int, default=1, help="rows of calibration text and of held-out text")
    p.add_argument("--layers", type=int, nargs="+", default=None, help="only these layers (default every one)")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant]

    import torch

    from linearize.eval import text_ids
    from linearize.fidelity import target_fidelity
    from linearize.layers.options import GDNOptions
    from linearize.models import load_teacher

    torch.manual_seed(0)
    teacher, tok = load_teacher(args.model)
    cal = text_ids(tok, args.tokens, split="train", batch=args.rows)
    held = text_ids(tok, args.tokens, split="heldout", batch=args.rows)
    result = {"command": " ".join(["python", *sys.argv]), "model": args.model, "fit_steps": args.fit_steps,
              "layers": args.layers,
              "lr": args.lr, "rows": args.rows, "tokens": args.tokens, "torch": torch.__version__,
              "note": "relative error ||o - o_teacher|| / ||o_teacher|| of each layer's attention output on held-out "
                      "built-in text; '_fit': after fitting the block's own parameters on calibration rows of the "
                      "train text; medians over layers",
              "variants": {}}
    for name, opts in variants:
        for target in args.targets:
            key = f"{name}/{target}"
            t0 = time.perf_counter()
            report = target_fidelity(teacher, cal, held, [target], GDNOptions(**opts), args.fit_steps, args.lr,
                                     progress=lambda m, key=key: print(f"{key} {m}", file=sys.stderr, flush=True),
                                     layers=args.layers)
            result["variants"][key] = {"options": opts, "target": target, "seconds": time.perf_counter() - t0, **report}
            med = report["median"]
            print(f"{key}: median held-out error {med[target]:.4f} as converted"
                  + (f", {med[target + '_fit']:.4f} fitted" if args.fit_steps else ""), flush=True)
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(result))
    print(f"wrote {args.output}" + (f" and {args.markdown}" if args.markdown else ""))


def markdown(result: dict) -> str:
    lines = [f"`{result['command']}`", "",
             "| variant / target | as converted | fitted | layers better fitted | worst layer fitted |",
             "| --- | --- | --- | --- | --- |"]
    for key, v in result["variants"].items():
        t = v["target"]
        rows = v["layers"]
        fit = f"{v['median'][t + '_fit']:.3f}" if t + "_fit" in v["median"] else ""
        better = sum(r[t + "_fit"] < r[t] for r in rows) if fit else ""
        worst = max(rows, key=lambda r: r.get(t + "_fit", r[t]))
        lines.append(f"| {key} | {v['median'][t]:.3f} | {fit} | {better} of {len(rows)} | "
                     f"{worst['layer']}: {worst.get(t + '_fit', worst[t]):.3f} |")
    lines.append("")
    lines.append("Median over layers of the relative error of the attention output on held-out text.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
