"""Which layers retrieve: the teacher's attention mass on a passkey from the question that asks for it, per
layer and head, and what keeping those layers softmax does to a hybrid's passkey retrieval.

    python scripts/retrieval_layers.py --output results/retrieval_layers_smollm2.json
    python scripts/retrieval_layers.py --passkey-lengths 2048 4096 --keep 8 --output results/retrieval_layers_smollm2.json

On passkey prompts (``linearize.quality.passkey``: the key sentence at depths 0.25/0.5/0.75 of ``--length``
tokens of filler), the teacher's softmax attention is recomputed per layer from its own q and k (after RoPE)
for the question's last ``--queries`` tokens; a head's score is the mean mass those queries put on the key
sentence's tokens, a layer's the largest over its heads (one retrieval head serves the layer). The filler
repeats, so nothing but the key sentence is worth attending to from afar.

Then, with ``--passkey-lengths``, passkey retrieval (``run_passkey``: ``--trials`` keys at each of ``--depths``) of the
teacher and of the converted model as converted (no training), every layer converted and hybrids keeping
``--keep`` layers softmax chosen three ways: ``convert``'s own rule (the layers whose block is furthest from
the teacher on calibration text), the passkey-mass score above (the test's own text: an upper bound, not a
rule to ship), and ``N:induction`` (:mod:`linearize.retrieval`, task-free: random tokens repeated once). Prints both and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.eval import capture_attention  # noqa: E402
from linearize.quality.passkey import NEEDLE, keys, make_prompt, run_passkey  # noqa: E402
from linearize.retrieval import attention_rows, induction_scores  # noqa: E402


@torch.no_grad()
def retrieval_scores(model, tokenizer, length: int, depths, prompts_per_depth: int, queries: int) -> torch.Tensor:
    """``(layers, q_heads)``: mean attention mass of the question's last ``queries`` tokens on the key sentence."""
    from linearize.eval import attention_modules

    mods = attention_modules(model)
    total, count = None, 0
    for d_i, depth in enumerate(depths):
        for key in keys(1000 + d_i, prompts_per_depth):
            p = make_prompt(tokenizer, length, depth, key)
            needle = len(tokenizer(NEEDLE.format(key=key), add_special_tokens=False).input_ids)
            ids = torch.tensor([p.ids])
            caps = capture_attention(model, ids)
            t = torch.arange(ids.shape[1] - queries, ids.shape[1])
            s = torch.stack([attention_rows(m, caps[i], t)[0, ..., p.key_at:p.key_at + needle].sum(-1).mean(-1).flatten()
                             for i, m in enumerate(mods)])  # (layers, q_heads)
            total = s if total is None else total + s
            count += 1
    return total / count


def passkey_of(model, tokenizer, lengths, depths, trials) -> dict:
    r = run_passkey(model, tokenizer, lengths, depths=depths, trials=trials)
    return {"acc": r["acc"], "lengths": {n: v["acc"] for n, v in r["lengths"].items()},
            "depths": {n: v["depths"] for n, v in r["lengths"].items()}}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=1024, help="passkey prompt length for the scores")
    p.add_argument("--prompts", type=int, default=2, help="prompts per depth for the scores")
    p.add_argument("--queries", type=int, default=8, help="the question's last tokens whose attention is read")
    p.add_argument("--keep", type=int, default=8, help="layers the hybrids keep softmax")
    p.add_argument("--passkey-lengths", type=int, nargs="*", default=[], help="passkey retrieval at these lengths")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=5, help="passkey keys per length and depth")
    p.add_argument("--only", nargs="*", default=None, help="only the variants whose names contain one of these")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()

    from linearize.conversion import convert
    from linearize.layers.options import GDNOptions
    from linearize.models.loading import load_teacher

    torch.manual_seed(0)
    model, tok = load_teacher(args.model)
    t0 = time.time()
    scores = retrieval_scores(model, tok, args.length, (0.25, 0.5, 0.75), args.prompts, args.queries)
    induction = induction_scores(model)
    layer_induction = induction.max(-1).values
    layer_score = scores.max(-1).values
    ranked = sorted(range(len(layer_score)), key=lambda i: -float(layer_score[i]))
    by_retrieval = sorted(ranked[:args.keep])
    print(f"retrieval score per layer (max over heads; {time.time() - t0:.0f} s):")
    for i in range(len(layer_score)):
        h = int(scores[i].argmax())
        print(f"  layer {i:2d}  {float(layer_score[i]):.3f}  (head {h})" + ("  *" if i in by_retrieval else "")
              + f"   induction {float(layer_induction[i]):.3f} (head {int(induction[i].argmax())})")
    by_induction = sorted(sorted(range(len(layer_induction)), key=lambda i: -float(layer_induction[i]))[:args.keep])
    print(f"top {args.keep} by passkey mass: {by_retrieval}; by induction score: {by_induction}")
    out = {"command": " ".join(["python", *sys.argv]), "model": args.model, "length": args.length,
           "queries": args.queries, "head_scores": scores.tolist(), "layer_scores": layer_score.tolist(),
           "keep_by_retrieval": by_retrieval,
           "induction_head_scores": induction.tolist(), "induction_layer_scores": layer_induction.tolist(),
           "keep_by_induction": by_induction}

    if args.passkey_lengths:
        opts = GDNOptions(window=args.window, sinks=args.sinks)
        out["passkey"] = {}
        if not args.only or "teacher" in args.only:
            out["passkey"]["teacher"] = passkey_of(model, tok, args.passkey_lengths, args.depths, args.trials)
            print("teacher", out["passkey"]["teacher"]["lengths"], flush=True)
        variants = {"every layer": None, f"hybrid {args.keep}, convert's rule": args.keep,
                    f"hybrid {args.keep}, by passkey mass": by_retrieval,
                    f"hybrid {args.keep}, {args.keep}:induction": f"{args.keep}:induction"}
        for name, keep in variants.items():
            if args.only and not any(o in name for o in args.only):
                continue
            m, _ = load_teacher(args.model)
            m = convert(m, keep_softmax=keep, tokenizer=tok, options=opts)
            kept = m.config.linearize["softmax_layers"]
            res = passkey_of(m, tok, args.passkey_lengths, args.depths, args.trials)
            out["passkey"][name] = {"softmax_layers": kept, **res}
            print(name, kept, res["lengths"], flush=True)
            del m
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
