"""Passkey retrieval of the model as converted, with and without a sparse exact cache in every block.

    python scripts/sparse_cache_passkey.py --lengths 2048 4096 --sizes 64 256 \\
        --output results/sparse_cache_passkey_smollm2.json

``scripts/sparse_cache_capacity.py`` measures one head at the teacher's q/k/v; this measures the whole model
(every layer converted: window 64 + 4 sinks + Taylor-GDN, no training). In every block a cache of ``C``
older tokens per KV head joins the exact softmax (sinks + window + cache, one normalizer); the state still
takes every older token, as it does today, so the mix by mass is unchanged (``sparse_cache_capacity``'s
``err_state_all`` says that costs nothing). Which tokens: at query ``t``, the ``C`` tokens older than the
window scored highest by a probe — per layer and KV head, a ridge regression on the attention's input of the
log of the largest attention the teacher pays the token from ``window`` or more tokens later, fitted on rows
of the built-in training text (no passkey) — i.e. a cache that keeps the best-scored tokens as they leave the
window, whose size stays ``C``.

A prompt is right when greedy decoding would answer the key: the prompt and the answer ``" KEY"`` go through
one forward and every answer token is the argmax after the token before it (teacher forcing; the same test for
the teacher and every variant). A prototype measured on the CPU: the cache is computed densely, by patching
``sink_window_softmax`` where the block calls it; decoding is not covered. The converted block has it built in
since (``GDNOptions.sparse_cache``, ``linearize convert --sparse-cache C``; ``results/sparse_cache_untrained_smollm2.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparse_cache_capacity import far_attention, fit_probe  # noqa: E402  (scripts/ on the path)


class SparseCache:
    """Patches the exact part of every window block: its softmax also covers the ``size`` best-scored older
    tokens per KV head (scores from ``probes[layer]`` on the block's input, set by a pre-hook)."""

    def __init__(self, blocks: dict[int, torch.nn.Module], probes: dict[int, torch.Tensor], window: int, sinks: int):
        import linearize.layers.gdn_attention as ga

        self.ga, self.inner, self.blocks, self.probes = ga, ga.sink_window_softmax, blocks, probes
        self.window, self.sinks, self.size, self.scores, self.hooks = window, sinks, 0, None, []

    def __enter__(self):
        for i, block in self.blocks.items():
            def pre(module, args, kwargs, i=i):
                h = kwargs.get("hidden_states", args[0] if args else None).double()
                self.scores = (torch.cat([h, torch.ones_like(h[..., :1])], -1) @ self.probes[i]).transpose(1, 2)
            self.hooks.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        self.ga.sink_window_softmax = self.exact
        return self

    def __exit__(self, *exc):
        self.ga.sink_window_softmax = self.inner
        for h in self.hooks:
            h.remove()

    def exact(self, q, k, v, key_doc, query_doc, window, *sinks):
        o, lse = self.inner(q, k, v, key_doc, query_doc, window, *sinks)
        if not self.size:
            return o, lse
        B, T, Hq, D = q.shape
        H = k.shape[2]
        G = Hq // H
        kt, vt = k[:, window:].to(o.dtype), v[:, window:].to(o.dtype)  # a fresh sequence: one key per query
        t, s = torch.arange(T)[:, None], torch.arange(T)[None]
        old = ((t - s) >= self.window) & (s >= self.sinks)  # (T, T)
        ranked = self.scores[:, :, None, :].expand(B, H, T, T).masked_fill(~old, float("-inf"))
        thr = ranked.topk(min(self.size, T), dim=-1).values[..., -1:]  # the C-th best older token's score
        cache = old & (ranked >= thr) & torch.isfinite(ranked)  # (B, H, T, T)
        logits = torch.einsum("bthgd,bshd->bhgts", q.to(o.dtype).view(B, T, H, G, D), kt)
        logits = logits.masked_fill(~cache[:, :, None], float("-inf"))
        lse_c = logits.logsumexp(-1)  # (B, H, G, T)
        p = (logits - torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))[..., None]).exp()
        o_c = torch.einsum("bhgts,bshd->bthgd", p, vt).reshape(B, T, Hq, D)
        lse_c = lse_c.permute(0, 3, 1, 2).reshape(B, T, Hq)
        both = torch.logaddexp(lse, lse_c)
        wa = torch.where(torch.isfinite(both), (lse - both).exp(), torch.zeros_like(both))[..., None]
        wc = torch.where(torch.isfinite(both), (lse_c - both).exp(), torch.zeros_like(both))[..., None]
        return wa * o + wc * o_c, both


def correct(model, tok, prompt, key: str) -> bool:
    answer = tok(" " + key, add_special_tokens=False).input_ids
    ids = torch.tensor([prompt.ids + answer])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    n = len(prompt.ids)
    return bool((logits[n - 1:n - 1 + len(answer)].argmax(-1) == torch.tensor(answer)).all())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256], help="cache sizes C per KV head")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--trials", type=int, default=2, help="keys per depth")
    p.add_argument("--probe-rows", type=int, default=4, help="rows of 2,048 built-in training tokens for the probes")
    p.add_argument("--no-teacher", action="store_true", help="skip the teacher's run (measured before)")
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args()

    import linearize
    from linearize.eval import attention_modules, capture_attention, text_ids
    from linearize.layers.options import GDNOptions
    from linearize.models import load_teacher
    from linearize.quality.passkey import DEPTHS, keys, make_prompt

    torch.manual_seed(0)
    teacher, tok = load_teacher(args.model)
    t0 = time.perf_counter()
    cal = text_ids(tok, 2048, "train", batch=args.probe_rows)
    mods = attention_modules(teacher)
    layers = list(range(len(mods)))
    probes = {}
    for i in layers:  # one layer's capture at a time: the captures of all 30 would not fit
        cap = capture_attention(teacher, cal, [i], stop_early=True)[i]
        with torch.no_grad():
            probes[i] = fit_probe(*far_attention(mods[i], cap, args.window))
    probe_seconds = time.perf_counter() - t0
    prompts = [(n, d, key, make_prompt(tok, n, d, key)) for n in args.lengths for j, d in enumerate(DEPTHS)
               for key in keys(1000 + 10 * n + j, args.trials)]

    def score(model, name):
        t1 = time.perf_counter()
        rows = [{"length": n, "depth": d, "key": key, "correct": correct(model, tok, pr, key)} for n, d, key, pr in prompts]
        acc = {str(n): sum(r["correct"] for r in rows if r["length"] == n) / sum(r["length"] == n for r in rows)
               for n in args.lengths}
        print(f"{name}: " + ", ".join(f"{n}: {a:.0%}" for n, a in acc.items()) + f" ({time.perf_counter() - t1:.0f} s)",
              flush=True)
        return {"accuracy": acc, "records": rows}

    result = {"command": " ".join(["python", *sys.argv]), "model": args.model, "window": args.window,
              "sinks": args.sinks, "trials_per_depth": args.trials, "depths": list(DEPTHS),
              "probe_rows": args.probe_rows, "probe_seconds": probe_seconds, "torch": torch.__version__, "runs": {}}
    if not args.no_teacher:
        result["runs"]["teacher"] = score(teacher, "teacher")
    model = linearize.convert(teacher, options=GDNOptions(window=args.window, sinks=args.sinks), tokenizer=tok)
    model.eval()
    blocks = {i: m for i, m in enumerate(attention_modules(model))}
    with SparseCache(blocks, probes, args.window, args.sinks) as sc:
        for c in [0, *args.sizes]:
            sc.size = c
            result["runs"][f"converted_cache{c}"] = score(model, f"converted, cache {c}")
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
