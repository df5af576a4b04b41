"""Would a small exact cache of chosen old tokens find the passkey where the state does not?

    python scripts/sparse_cache_capacity.py --length 2048 --layers 17 18 20 21 22 23 \\
        --output results/sparse_cache_capacity_smollm2.json --markdown results/sparse_cache_capacity_smollm2.md

The converted block reads the tokens older than its window (``--window``, ``--sinks``) through its state,
which cannot be sharp (``scripts/retrieval_capacity.py``: even an order-4 polynomial read misses the
teacher's read of a passkey). The sparse-caching idea (LoLA, McDermott et al. 2025) keeps, per KV head, a
fixed number ``C`` of old tokens exactly — keys and values, a constant cost like the window — chosen as they
leave the window by a score, evicting the lowest-scored when full; the exact softmax then covers sinks,
window and cache, and the state the rest. With scores fixed once a token leaves the window, the cache at
query ``t`` is the top ``C`` of the older tokens by score.

On passkey prompts (``linearize.quality.passkey``, the answer appended: the queries are the tokens whose next
token is a digit of the key), at the teacher's q/k/v in float64, per layer's strongest retrieval head:

- ``coverage``: the teacher's attention mass on the cached tokens over its mass on all older tokens;
- ``needle``: the fraction of the key sentence's tokens in the cache;
- ``err``: the output of ``exact softmax over sinks + window + cache`` mixed with a first-order Taylor read of
  the rest (normalizer ``log n + mean logit``, as :func:`linearize.ops.window.mix_by_mass`), against the
  teacher's output; ``C = 0`` is the block's own math at conversion, with the Taylor read in place of the
  GDN state; ``err_state_all``: the same with the read of every older token, the cached ones too (a state
  written as today, the cache beside it: what the training kernels could compute unchanged).

Scores (each causal but the oracle):

- ``probe``, a learned score: per KV head, a ridge regression of the log of the largest attention the teacher
  pays a token from ``window`` or more tokens later on the attention's input at that token, fitted on
  ``--probe-rows`` rows of ordinary text (the built-in training text, no passkey) — what a block could learn
  in distillation and compute causally;
- ``window_mass``, the attention the token got while in the window from the exact part's softmax of every
  query head of its KV head (H2O's accumulated attention, known when it leaves);
- ``recall``, how badly a linear state of the tokens before it recalls the token (``‖v_j − v̂(k_j)‖``, ``v̂``
  the first-order Taylor read of ``k_j`` over the earlier tokens — LoLA's self-recall error), fixed when the
  token leaves the window; ``recall_now``, the same against the state of every token older than the window at
  the answer (re-scored as the state grows);
- ``novelty``, ``‖k_j − k̄‖`` over the earlier tokens; ``random``;
- ``oracle``, the teacher's mass at the answer queries (the bound, not causal).

Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from retrieval_capacity import prompts  # noqa: E402  (scripts/ on the path: run as a script)

SCORES = ("probe", "window_mass", "recall", "recall_now", "novelty", "random", "oracle")


def scores(q, k, v, scaling: float, p_answer: torch.Tensor, window: int, sinks: int, probe_scores) -> dict[str, torch.Tensor]:
    """``(B, H, T)`` per KV head: each token's score when it leaves the window (float64)."""
    B, T, H, D = k.shape
    kd, vd = k.double().transpose(1, 2), v.double().transpose(1, 2)  # (B, H, T, D)
    n = torch.arange(1, T + 1, dtype=torch.float64)[:, None]
    k_mean = kd.cumsum(2) / n  # mean over tokens ≤ j
    prev = lambda x: torch.cat([torch.zeros_like(x[:, :, :1]), x[:, :, :-1]], 2)  # noqa: E731  (over tokens < j)
    earlier = torch.tril(torch.ones(T, T, dtype=torch.bool), -1)  # s < j
    logits = torch.einsum("bhjd,bhsd->bhjs", kd, kd) * scaling  # k_j as the query
    cnt = earlier.sum(-1).clamp_min(1).double()
    mean = logits.masked_fill(~earlier, 0).sum(-1) / cnt
    x = (logits - mean[..., None]).masked_fill(~earlier, 0)
    v_hat = torch.einsum("bhjs,bhsd->bhjd", (1 + x).masked_fill(~earlier, 0), vd) / cnt[:, None]
    recall = (vd - v_hat).norm(dim=-1)
    recall[:, :, 0] = float("inf")  # nothing before the first token: it cannot be recalled
    # against the state of every token older than the window at the last query (the cache re-scored as the
    # state grows, as LoLA's eviction does: causal for the answer queries, which all see those tokens)
    old = torch.zeros(T, dtype=torch.bool)
    old[sinks:T - window] = True
    m_old = logits[..., old].mean(-1, keepdim=True)
    x_now = logits[..., old] - m_old
    v_now = torch.einsum("bhjs,bhsd->bhjd", 1 + x_now, vd[:, :, old]) / old.sum()
    recall_now = (vd - v_now).norm(dim=-1)
    novelty = (kd - prev(k_mean)).norm(dim=-1)
    # the attention a token gets while it is in the window, from the exact part's softmax (sinks + window) of
    # every query head of its KV head: known when it leaves the window (H2O's heavy hitters, kept causal)
    G = q.shape[2] // H
    qd = q.double().transpose(1, 2).reshape(B, H, G, T, D)
    ls = torch.einsum("bhgtd,bhsd->bhgts", qd, kd) * scaling
    lag = torch.arange(T)[:, None] - torch.arange(T)[None]  # t - s
    exact = (lag >= 0) & ((lag < window) | (torch.arange(T)[None] < sinks))
    window_mass = ls.masked_fill(~exact, float("-inf")).softmax(-1).masked_fill(lag >= window, 0).sum((2, 3))
    del ls
    g = torch.Generator().manual_seed(0)
    return {"probe": probe_scores, "window_mass": window_mass, "recall": recall, "recall_now": recall_now, "novelty": novelty, "random": torch.rand(B, H, T, generator=g, dtype=torch.float64),
            "oracle": p_answer}


def far_attention(module, cap, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(features (B, T, F), target (B, H, T))``: the attention input of every token and the log of the largest
    attention any query head of its KV head pays it from ``window`` or more tokens later (the teacher's)."""
    from linearize.retrieval import attention_rows

    T = cap.hidden_states.shape[1]
    lag = torch.arange(T)[:, None] - torch.arange(T)[None]
    p = attention_rows(module, cap, torch.arange(T)).masked_fill(lag < window, 0)  # (B, H, G, T, T)
    return cap.hidden_states.double(), p.amax((2, 3)).clamp_min(1e-6).log()


def fit_probe(features: torch.Tensor, target: torch.Tensor, ridge: float = 1e-2) -> torch.Tensor:
    """``(F + 1, H)``: per KV head, ridge regression of ``target`` on the features and a bias."""
    x = torch.cat([features.reshape(-1, features.shape[-1]), torch.ones(features.shape[0] * features.shape[1], 1,
                                                                          dtype=features.dtype)], 1)
    y = target.transpose(1, 2).reshape(-1, target.shape[1])
    a = x.T @ x + ridge * x.shape[0] * torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(a, x.T @ y)


def composite(logits, v, t, window: int, sinks: int, cache: torch.Tensor | None, state_all: bool = False) -> torch.Tensor:
    """``(B, H, G, Q, D)``: exact softmax over sinks + window (+ ``cache``: (B, H, Q, T) bool) mixed with the
    first-order Taylor read of the other older tokens by the first-order normalizer; ``state_all``: the read
    and its normalizer over every older token, the cached ones too (a state that never leaves a token out)."""
    B, H, G, Q, T = logits.shape
    s = torch.arange(T)[None]
    seen = s <= t[:, None]
    old = ((t[:, None] - s) >= window) & (s >= sinks)  # (Q, T)
    exact = (seen & ~old)[None, None].expand(B, H, Q, T)
    rest = old[None, None].expand(B, H, Q, T)
    if cache is not None:
        exact, rest = exact | cache, (rest if state_all else rest & ~cache)
    exact, rest = exact[:, :, None], rest[:, :, None]  # over the G query heads of a KV head
    vd = v.double().transpose(1, 2)[:, :, None]  # (B, H, 1, T, D)
    lse = logits.masked_fill(~exact, float("-inf")).logsumexp(-1)
    o_exact = torch.einsum("bhgqs,bhgsd->bhgqd", (logits - lse[..., None]).exp().masked_fill(~exact, 0), vd)
    n = rest.sum(-1).double()
    mean = logits.masked_fill(~rest, 0).sum(-1) / n.clamp_min(1)
    x = (logits - mean[..., None]).masked_fill(~rest, 0)
    o_rest = torch.einsum("bhgqs,bhgsd->bhgqd", (1 + x).masked_fill(~rest, 0), vd) / n.clamp_min(1)[..., None]
    log_z_rest = torch.where(n > 0, n.clamp_min(1).log() + mean, torch.full_like(n, float("-inf")))
    w = torch.sigmoid(lse - log_z_rest)[..., None]
    return w * o_exact + (1 - w) * o_rest


def measure(module, cap, t, window, sinks, key_at, needle, sizes, probe) -> dict:
    from linearize.models.adapters import project_qkv

    q, k, v = project_qkv(module, cap.hidden_states, cap.position_embeddings)
    B, T, Hq, D = q.shape
    H = k.shape[2]
    G, Q = Hq // H, len(t)
    scaling = float(module.scaling)
    logits = torch.einsum("bqhgd,bshd->bhgqs", q[:, t].double().view(B, Q, H, G, D), k.double()) * scaling
    s = torch.arange(T)[None]
    logits = logits.masked_fill(s > t[:, None], float("-inf"))
    p = logits.softmax(-1)  # (B, H, G, Q, T)
    o_true = torch.einsum("bhgqs,bshd->bhgqd", p, v.double())
    old = ((t[:, None] - s) >= window) & (s >= sinks)
    key = torch.zeros(B, T, dtype=torch.bool)
    for b, a in enumerate(key_at):
        key[b, a:a + needle] = True
    key_mass = (p * key[:, None, None, None]).sum(-1).mean((0, 3))  # (H, G)
    h, g = divmod(int(key_mass.argmax()), G)  # the strongest retrieval head
    f = cap.hidden_states.double()
    probe_scores = (torch.cat([f, torch.ones_like(f[..., :1])], -1) @ probe).transpose(1, 2)  # (B, H, T)
    score = scores(q, k, v, scaling, p.sum((2, 3)), window, sinks, probe_scores)

    def rel(a, b):  # (B, H, G, Q, D) at the chosen head -> float
        a, b = a[:, h, g], b[:, h, g]
        return float(((a - b).pow(2).sum() / b.pow(2).sum()).sqrt())

    row = {"head": h * G + g, "key_mass": float(key_mass[h, g]),
           "err_no_cache": rel(composite(logits, v, t, window, sinks, None), o_true)}
    mass_old = (p * old).sum(-1)[:, h, g]  # (B, Q)
    for name, sc in score.items():
        for c in sizes:
            ranked = sc[:, :, None].expand(B, H, Q, T).masked_fill(~old[None, None], float("-inf"))
            top = ranked.topk(min(c, T), dim=-1).indices
            cache = torch.zeros(B, H, Q, T, dtype=torch.bool).scatter_(-1, top, True) & old[None, None]
            cov = ((p[:, h, g] * cache[:, h]).sum(-1) / mass_old).mean()
            hit = (cache[:, h] & key[:, None]).sum(-1).double().mean() / needle
            row[f"{name}_{c}"] = {"coverage": float(cov), "needle": float(hit),
                                  "err": rel(composite(logits, v, t, window, sinks, cache), o_true),
                                  "err_state_all": rel(composite(logits, v, t, window, sinks, cache, True), o_true)}
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens (the answer comes after)")
    p.add_argument("--layers", type=int, nargs="+", required=True)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="cache sizes C per KV head")
    p.add_argument("--per-depth", type=int, default=2, help="prompts per depth (depths 0.25 and 0.5)")
    p.add_argument("--probe-rows", type=int, default=2, help="rows of built-in training text the probe is fitted on")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--markdown", type=Path, default=None)
    args = p.parse_args()

    from linearize.eval import attention_modules, capture_attention, text_ids
    from linearize.models import load_teacher
    from linearize.quality.passkey import NEEDLE

    torch.manual_seed(0)
    teacher, tok = load_teacher(args.model)
    ids, key_at, t = prompts(tok, args.length, (0.25, 0.5), seed=100, per_depth=args.per_depth)
    t = torch.tensor(t)
    needle = len(tok(NEEDLE.format(key="12345"), add_special_tokens=False).input_ids)
    mods = attention_modules(teacher)
    caps = capture_attention(teacher, ids, args.layers)
    cal = capture_attention(teacher, text_ids(tok, args.length, "train", batch=args.probe_rows), args.layers)
    result = {"command": " ".join(["python", *sys.argv]), "model": args.model, "tokens": int(ids.shape[1]),
              "prompts": int(ids.shape[0]), "answer_queries": len(t), "window": args.window, "sinks": args.sinks,
              "sizes": args.sizes, "torch": torch.__version__, "layers": {}}
    for i in args.layers:
        t0 = time.perf_counter()
        with torch.no_grad():
            probe = fit_probe(*far_attention(mods[i], cal[i], args.window))
            row = measure(mods[i], caps[i], t, args.window, args.sinks, key_at, needle, args.sizes, probe)
        row["seconds"] = time.perf_counter() - t0
        result["layers"][str(i)] = row
        print(f"layer {i} head {row['head']} (key mass {row['key_mass']:.2f}): no cache err {row['err_no_cache']:.3f}; "
              + "; ".join(f"{n} C={c}: cov {row[f'{n}_{c}']['coverage']:.2f} needle {row[f'{n}_{c}']['needle']:.2f} "
                          f"err {row[f'{n}_{c}']['err']:.3f}" for n in SCORES for c in args.sizes), flush=True)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(result))
    print(f"wrote {args.output}" + (f" and {args.markdown}" if args.markdown else ""))


def markdown(result: dict) -> str:
    sizes = result["sizes"]
    lines = [f"`{result['command']}`", "",
             f"{result['prompts']} passkey prompts of {result['tokens']} tokens, {result['answer_queries']} answer queries "
             f"each; window {result['window']} + {result['sinks']} sinks; each layer's strongest retrieval head. A cell: "
             "coverage (the teacher's old-token mass on the cache) / needle tokens cached / output error of sinks + "
             "window + cache exact, the rest by a first-order Taylor read / the same with the read over every older "
             "token, the cached ones too.", "",
             "| layer.head | key mass | err, no cache | " + " | ".join(f"{n}, C = {c}" for n in SCORES for c in sizes) + " |",
             "|---" * (3 + len(SCORES) * len(sizes)) + "|"]
    for layer, row in result["layers"].items():
        cells = [f"{layer}.{row['head']}", f"{row['key_mass']:.2f}", f"{row['err_no_cache']:.3f}"]
        cells += [" / ".join(f"{row[f'{n}_{c}'][m]:.{3 if m.startswith('err') else 2}f}"
                             for m in ("coverage", "needle", "err", "err_state_all")) for n in SCORES for c in sizes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
