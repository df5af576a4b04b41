"""Convert-time calibration (``convert(calibration_steps=N)``) against none, on one teacher, on the CPU.

    python scripts/calibration_sweep.py --steps 0 100 300 --output results/calibration_steps_smollm2.json

For each N: convert the teacher with the default block (window 64 + 4 sinks) and N Adam steps per
layer on the 512 calibration tokens, then the held-out perplexity (one row of ``--tokens`` built-in
held-out tokens, teacher beside it) and the median over layers of the relative error of each block's
output against the teacher's attention on the first 512 of those tokens.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import linearize  # noqa: E402
from linearize.eval import capture_attention, perplexity, relative_error, text_ids  # noqa: E402
from linearize.layers.options import GDNOptions  # noqa: E402
from linearize.models import load_teacher  # noqa: E402
from linearize.models.adapters import decoder_layers  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, nargs="+", default=[0, 100, 300])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args()
    teacher, tok = load_teacher(args.model)
    held = text_ids(tok, args.tokens, split="heldout")
    caps = capture_attention(teacher, held[:, :512])
    out = {"command": " ".join(["python", *sys.argv]), "model": args.model, "block": "window 64 + 4 sinks",
           "teacher_ppl": perplexity(teacher, held), "runs": {}}
    for n in args.steps:
        t0 = time.perf_counter()
        m = linearize.convert(copy.deepcopy(teacher), tokenizer=tok, options=GDNOptions(window=64, sinks=4),
                              calibration_steps=n)
        seconds = time.perf_counter() - t0
        errs = [relative_error(decoder_layers(m)[i].self_attn.attention_output(c.hidden_states, c.position_embeddings),
                               c.output) for i, c in caps.items()]
        out["runs"][str(n)] = {"ppl": perplexity(m, held), "median_layer_error": statistics.median(errs),
                               "convert_seconds": seconds}
        print(n, out["runs"][str(n)], f"teacher {out['teacher_ppl']:.3f}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
