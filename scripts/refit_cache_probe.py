"""Refit the sparse-cache probes of a trained model on its own hidden states and q/k, and save it anew.

    python scripts/refit_cache_probe.py runs/smollm2-135m-gdn-corpus/model runs/refit/model
    python scripts/refit_cache_probe.py runs/L_d1600/model runs/grafted/model --add 1024

A converted block's probe (``GDNOptions.sparse_cache``) is fitted at conversion on the teacher; distillation then
trains the blocks' q/k and (with ``trainable: all``) the MLPs under it. This refits every probe as conversion
does (:func:`linearize.conversion.refit_cache_probes`), on the trained model, and writes the model to OUT, to be
measured beside the original (``linearize eval --passkey``). With ``--add C`` the window blocks of a model trained
without a sparse cache get one of C slots per KV head first, its probe fitted the same way: the cache grafted on
after training, which the model never trained with.
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
    p.add_argument("--add", type=int, default=0, metavar="C",
                   help="first give the window blocks without a sparse cache one of C slots per KV head")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from linearize.conversion import graft_sparse_cache, refit_cache_probes
    from linearize.saving import check_output_dir, load, save

    check_output_dir(args.out, args.force)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = load(args.model, dtype=torch.bfloat16 if dev == "cuda" else torch.float32).to(dev)
    tok = AutoTokenizer.from_pretrained(args.model)
    t0 = time.time()
    if args.add:
        n = graft_sparse_cache(model, args.add, tok)
        if not n:
            raise SystemExit(f"error: {args.model} has no window block without a sparse cache to give one")
        print(f"grafted a sparse cache of {args.add} slots onto {n} blocks, probes fitted in {time.time() - t0:.1f} s")
    else:
        n = refit_cache_probes(model, tok)
        if not n:
            raise SystemExit(f"error: {args.model} has no sparse cache to refit")
        print(f"refitted {n} probes in {time.time() - t0:.1f} s")
    save(model, tok, args.out, force=args.force)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
