"""Refit the sparse-cache probes of a trained model on its own hidden states and q/k, and save it anew.

    python scripts/refit_cache_probe.py runs/smollm2-135m-gdn-corpus/model runs/refit/model

A converted block's probe (``GDNOptions.sparse_cache``) is fitted at conversion on the teacher; distillation then
trains the blocks' q/k and (with ``trainable: all``) the MLPs under it. This refits every probe as conversion
does (:func:`linearize.conversion.refit_cache_probes`), on the trained model, and writes the model to OUT, to be
measured beside the original (``linearize eval --passkey``).
"""

from __future__ import annotations

import argparse
import time

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a converted (trained) model directory")
    p.add_argument("out", help="the directory to write the refitted model to")
    p.add_argument("--force", action="store_true", help="replace OUT")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from linearize.conversion import refit_cache_probes
    from linearize.saving import check_output_dir, load, save

    check_output_dir(args.out, args.force)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = load(args.model, dtype=torch.bfloat16 if dev == "cuda" else torch.float32).to(dev)
    tok = AutoTokenizer.from_pretrained(args.model)
    t0 = time.time()
    n = refit_cache_probes(model, tok)
    if not n:
        raise SystemExit(f"error: {args.model} has no sparse cache to refit")
    print(f"refitted {n} probes in {time.time() - t0:.1f} s")
    save(model, tok, args.out, force=args.force)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
