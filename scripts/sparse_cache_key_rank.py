"""Where the sparse cache's probe ranks a passkey among the older tokens, as the context grows.

    python scripts/sparse_cache_key_rank.py --output results/sparse_cache_key_rank_smollm2.json

The converted block's cache (``GDNOptions.sparse_cache = C``) keeps, per KV head, the ``C`` best-scored tokens
older than the window; a query finds the passkey exactly only if the key's tokens are among them. Here the
probes are fitted as ``linearize convert`` fits them (8,192 built-in tokens, the teacher's attention; or
``--probe-rows`` rows of ``--probe-tokens``) on the
layers with the strongest retrieval heads, and on passkey prompts (``linearize.quality.passkey``) of each length
and depth the rank of the key's first token among the older tokens at the prompt's end is printed per layer and
KV head (0 = the best scored; the key is in a cache of C when its rank is below C), and in the JSON the worst
rank over every token of both of the needle's copies of the key (``worst_key_token_rank``: the whole key is
held when it is below C). At the teacher's own hidden
states: a lower bound on what the converted model sees. With ``--converted DIR`` (a converted or trained model
with a sparse cache) the ranks are that model's own: its probes (``cache_probe``) on its own hidden states — what
its cache holds at the prompt's end. Beside each rank, how many distinct token ids the tokens ranked above the
key are (a filler repeated hundreds of times fills a cache with copies of a few tokens). Writes JSON.

    python scripts/sparse_cache_key_rank.py --converted runs/…/model --lengths 4096 8192 --output …
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--layers", type=int, nargs="+", default=[17, 18, 20, 21, 22, 23])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--depths", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--probe-rows", type=int, default=None, help="rows of probe text (default: convert's)")
    p.add_argument("--probe-tokens", type=int, default=None, help="tokens per row (default: convert's)")
    p.add_argument("--converted", type=Path, default=None, help="a converted model directory with a sparse cache: "
                   "its own probes and hidden states (default: the teacher's, probes fitted here)")
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args()

    from linearize.conversion import probe_shape
    from linearize.eval import attention_modules, capture_attention, text_ids
    from linearize.models import load_teacher, project_qkv
    from linearize.ops.sparse_cache import far_attention, fit_probe, probe_scores, selection_keys
    from linearize.quality.passkey import keys, make_prompt

    if args.converted is not None:  # the model's own probes, on its own hidden states below
        from transformers import AutoTokenizer

        from linearize.saving import load

        teacher = load(args.converted).to("cuda" if torch.cuda.is_available() else "cpu")
        tok = AutoTokenizer.from_pretrained(args.converted)
        mods = attention_modules(teacher)
        if not all(getattr(getattr(mods[i], "options", None), "sparse_cache", 0) for i in args.layers):
            raise SystemExit(f"error: {args.converted} has no sparse cache on layers {args.layers}")
        probes = {i: mods[i].cache_probe.double() for i in args.layers}
        args.window, args.sinks = mods[args.layers[0]].options.window, mods[args.layers[0]].options.sinks
        rows_ = tokens_ = None
    else:
        teacher, tok = load_teacher(args.model)
        mods = attention_modules(teacher)
        rows_, tokens_ = probe_shape(teacher.config)
        rows_, tokens_ = args.probe_rows or rows_, args.probe_tokens or tokens_
        caps = capture_attention(teacher, text_ids(tok, tokens_, "train", batch=rows_), args.layers, stop_early=True)
        probes = {}
        with torch.no_grad():
            for i in args.layers:
                q, k, _ = project_qkv(mods[i], caps[i].hidden_states, caps[i].position_embeddings)
                probes[i] = fit_probe(caps[i].hidden_states, far_attention(q.double() * mods[i].scaling, k, args.window))
        del caps
    dev = next(teacher.parameters()).device
    rows = []
    key = keys(11, 1)[0]
    digits = tok(key, add_special_tokens=False).input_ids
    for n in args.lengths:
        for depth in args.depths:
            ids = make_prompt(tok, n, depth, key).ids
            copies = [j for j in range(len(ids) - len(digits)) if ids[j:j + len(digits)] == digits]
            at, every = copies[0], torch.tensor([j + d for j in copies for d in range(len(digits))])
            cap = capture_attention(teacher, torch.tensor([ids], device=dev), args.layers, stop_early=True)
            ranks, distinct, worst = {}, {}, {}
            old_ids = torch.tensor(ids[args.sinks:len(ids) - args.window])
            for i in args.layers:
                s = selection_keys(probe_scores(cap[i].hidden_states, probes[i].float()),
                                   torch.arange(1, len(ids) + 1, device=dev)[None])[0].cpu()
                older = s[args.sinks:len(ids) - args.window]  # (older tokens, KV heads)
                above = older > s[at]
                ranks[str(i)] = above.sum(0).tolist()
                worst[str(i)] = (older[None] > s[every][:, None]).sum(1).amax(0).tolist()
                distinct[str(i)] = [old_ids[above[:, h]].unique().numel() for h in range(above.shape[1])]
            rows.append({"length": n, "depth": depth, "key_position": at, "older_tokens": len(ids) - args.window - args.sinks,
                         "rank_per_layer_and_kv_head": ranks, "distinct_ids_above_key": distinct,
                         "key_tokens": len(every), "worst_key_token_rank": worst})
            print(n, depth, ranks, distinct, "worst", worst, flush=True)
    out = {"command": " ".join(["python", *sys.argv]), "model": str(args.converted or args.model), "key": key,
           "probes": "the model's own" if args.converted else "fitted here on the teacher", "probe_rows": rows_,
           "probe_tokens": tokens_, "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
