"""Where a converted block loses a passkey: on the tokens that answer, per retrieval layer and head, the
teacher's attention split into the block's two parts, and what the block makes of each.

    python scripts/retrieval_capacity.py --length 2048 --layers 17 18 20 21 22 23 24 26 --fit-steps 100 \\
        --output results/retrieval_capacity_smollm2.json

On passkey prompts (``linearize.quality.passkey``) with the answer appended (teacher forcing), the queries
are the tokens whose next token is a digit of the key. A converted block (``--window``, ``--sinks``) computes
``o = w·o_E + (1 − w)·o_O``: exact softmax over the window and sinks (``o_E``, the teacher's own), the
Taylor-GDN over the older tokens (``o_O``), mixed by ``w`` from the first-order normalizer
(:func:`linearize.ops.window.mix_by_mass`). The teacher's output splits the same way, exactly:
``o* = (1 − s*)·o_E + s*·o*_O``, ``s*`` its mass on the older tokens and ``o*_O`` its softmax over them.
Per layer and query head, over the held-out prompts' answer queries:

- ``key_mass``: the teacher's mass on the key sentence (the retrieval heads are where it is large);
- ``share_true`` / ``share_block``: ``s*`` and the block's ``1 − w``;
- ``err_old``: ``‖o_O − o*_O‖ / ‖o*_O‖``, what the state reads against what the teacher reads from afar;
- ``err``: the block's output against the teacher's; ``err_true_share``: the same with the block's ``o_O``
  but the teacher's share; ``err_true_old``: the block's share with the teacher's ``o*_O`` — which of the two
  a fix must reach.

With ``--fit-steps`` the block's own parameters (ρ, the β and decay corrections, the mix's bias, …;
:data:`linearize.calibration.NEW_PARAMETERS`) are fitted by Adam to the teacher's output on the answer
queries of calibration prompts (other keys, other depths) and the table is measured again: what the block can
represent of retrieval at the teacher's q/k/v, not a training result. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

READ_ORDERS = (1, 2, 3, 4)  # the Taylor reads of the older tokens measured beside the block (teacher_split)


def prompts(tok, length: int, depths, seed: int, per_depth: int) -> tuple[torch.Tensor, list[int], list[int]]:
    """``(ids (B, T), key_at, query positions)``: passkey prompts of one length with their answers appended."""
    from linearize.quality.passkey import keys, make_prompt

    rows, at = [], []
    for d_i, depth in enumerate(depths):
        for key in keys(seed + d_i, per_depth):
            p = make_prompt(tok, length, depth, key)
            rows.append(p.ids + tok(" " + key, add_special_tokens=False).input_ids)
            at.append(p.key_at)
    n = {len(r) for r in rows}
    if len(n) != 1:
        raise SystemExit(f"error: prompts of lengths {sorted(n)}: the keys tokenize to different lengths")
    answer = len(tok(" " + keys(seed, 1)[0], add_special_tokens=False).input_ids)
    T = n.pop()
    return torch.tensor(rows), at, list(range(T - answer - 1, T - 1))


class MixCapture:
    """Wraps :func:`mix_by_mass` where the block calls it, keeping its inputs (the parts and the share)."""

    def __init__(self):
        import linearize.layers.gdn_attention as ga

        self.module, self.inner, self.got = ga, ga.mix_by_mass, {}

    def __enter__(self):
        def mix(o_exact, lse, o_old, q, k_mean, n_old, bias=None, square_sum=None, backend="auto", out_dtype=None):
            out = self.inner(o_exact, lse, o_old, q, k_mean, n_old, bias, square_sum, backend, out_dtype)
            one = torch.ones_like(o_old[..., :1], dtype=torch.float64)
            f64 = lambda x: None if x is None else x.double()  # noqa: E731
            w = self.inner(one, lse.double(), 0 * one, q.double(), k_mean.double(), n_old, f64(bias),
                           f64(square_sum))  # the share, by the same code, in float64
            self.got = {"o_exact": o_exact, "o_old": o_old, "w": w[..., 0]}
            return out

        self.module.mix_by_mass = mix
        return self

    def __exit__(self, *exc):
        self.module.mix_by_mass = self.inner


def teacher_split(module, cap, t: torch.Tensor, window: int, sinks: int, key_at, needle: int) -> dict:
    """The teacher's attention at queries ``t`` split into the exact part (window, sinks) and the older tokens."""
    from linearize.models.adapters import project_qkv
    from linearize.retrieval import attention_rows

    p = attention_rows(module, cap, t)  # (B, H, G, Q, T)
    q, k, v = project_qkv(module, cap.hidden_states, cap.position_embeddings)
    B, H, G, Q, T = p.shape
    s = torch.arange(T)[None]
    old = ((t[:, None] - s) >= window) & (s >= sinks)  # (Q, T): not in the window, not a sink
    seen = s <= t[:, None]
    logits = torch.einsum("bqhgd,bshd->bhgqs", q[:, t].double().view(B, Q, H, G, -1), k.double()) * float(module.scaling)
    n = old.sum(-1).double()  # (Q,)
    lo = logits.masked_fill(~old, 0)
    mean = lo.sum(-1) / n
    var = (lo - mean[..., None]).masked_fill(~old, 0).pow(2).sum(-1) / n
    lse_exact = logits.masked_fill(~(seen & ~old), float("-inf")).logsumexp(-1)
    log_odds = {  # log(exact share / old share): the teacher's, and the first- and second-order normalizers'
        "true": lse_exact - logits.masked_fill(~old, float("-inf")).logsumexp(-1),
        "first_order": lse_exact - (n.log() + mean),
        "second_order": lse_exact - (n.log() + mean + var / 2),
    }
    share = (p * old).sum(-1)  # (B, H, G, Q)
    o_old = torch.einsum("bhgqs,bshd->bhgqd", p * old, v.double()) / share.clamp_min(1e-300)[..., None]
    # what a state read with the r-th order Taylor polynomial of exp as its kernel would give over the older
    # tokens, r = 1 … READ_ORDERS[-1] (r = 1 is the Taylor-GDN's read; order r needs a state of K^r × V): the
    # polynomial of the logit centred on its mean over those tokens (q·k̄, which the running sums give)
    x = (logits - mean[..., None]).masked_fill(~old, 0)
    reads = {}
    for r in READ_ORDERS:
        w = sum(x.pow(j) / math.factorial(j) for j in range(r + 1)).masked_fill(~old, 0)
        reads[f"read_order{r}"] = torch.einsum("bhgqs,bshd->bhgqd", w, v.double()) / w.sum(-1)[..., None]
    key = torch.zeros(B, T, dtype=torch.bool)
    for b, a in enumerate(key_at):
        key[b, a:a + needle] = True
    key_mass = (p * key[:, None, None, None]).sum(-1)
    flat = lambda x: x.reshape(B, H * G, Q, *x.shape[4:]).transpose(1, 2)  # noqa: E731  (B, Q, Hq, ...)
    return {"share": flat(share), "o_old": flat(o_old), "key_mass": flat(key_mass),
            **{f"log_odds_{k}": flat(x) for k, x in log_odds.items()}, **{k: flat(x) for k, x in reads.items()}}


def measure(block, cap, t, split) -> dict:
    """Per query head (means over prompts and answer queries) the quantities of the module docstring."""
    with torch.no_grad(), MixCapture() as mc:
        o = block.attention_output(cap.hidden_states, cap.position_embeddings)
    B, T = o.shape[:2]
    Hq = split["share"].shape[2]
    o = o.view(B, T, Hq, -1)[:, t].double()
    ref = cap.output.view(B, T, Hq, -1)[:, t].double()
    o_ex = mc.got["o_exact"][:, t].double()
    o_old = mc.got["o_old"][:, t].double()
    s_blk = 1 - mc.got["w"][:, t].double()  # (B, Q, Hq)
    s_true, old_true = split["share"], split["o_old"]

    def rel(a, b):  # (B, Q, Hq, D) -> (Hq,): ||a - b|| / ||b|| over prompts and queries
        return ((a - b).pow(2).sum((0, 1, 3)) / b.pow(2).sum((0, 1, 3)).clamp_min(1e-300)).sqrt()

    recon = (1 - s_true)[..., None] * o_ex + s_true[..., None] * old_true
    w = mc.got["w"][:, t]
    return {
        **{f"err_{k}": rel(split[k], old_true).tolist() for k in split if k.startswith("read_order")},
        "key_mass": split["key_mass"].mean((0, 1)).tolist(),
        **{k: split[k].mean((0, 1)).tolist() for k in split if k.startswith("log_odds")},
        "log_odds_block": (w.log() - (1 - w).log()).clamp(max=40).mean((0, 1)).tolist(),
        "mix_gradient": (w * (1 - w)).mean((0, 1)).tolist(),  # d(share)/d(bias): what a fit can move
        "share_true": s_true.mean((0, 1)).tolist(),
        "share_block": s_blk.mean((0, 1)).tolist(),
        "err_old": rel(o_old, old_true).tolist(),
        "err": rel(o, ref).tolist(),
        "err_true_share": rel((1 - s_true)[..., None] * o_ex + s_true[..., None] * o_old, ref).tolist(),
        "err_true_old": rel((1 - s_blk)[..., None] * o_ex + s_blk[..., None] * old_true, ref).tolist(),
        "split_check": rel(recon, ref).max().item(),  # the teacher's split recomposes its output
    }


def fit(block, cap, t, steps: int, lr: float, every: bool = False) -> float:
    """Adam on the block's new parameters (``every``: on all of them, the teacher's q/k/v too) against the
    teacher's output at the answer queries; the best point seen is kept. Returns the squared relative error
    there after the fit."""
    from linearize.calibration import NEW_PARAMETERS

    params = [p for n, p in block.named_parameters() if every or n.endswith(NEW_PARAMETERS)]
    frozen = [p for n, p in block.named_parameters() if not (every or n.endswith(NEW_PARAMETERS))]
    for p in frozen:
        p.requires_grad_(False)
    ref = cap.output[:, t].double()
    denom = ref.pow(2).sum()
    opt = torch.optim.Adam(params, lr=lr)
    best, kept = float("inf"), None
    with torch.enable_grad():
        for i in range(steps + 1):
            loss = (block.attention_output(cap.hidden_states, cap.position_embeddings)[:, t].double() - ref).pow(2).sum() / denom
            if loss.item() < best:
                best, kept = loss.item(), [p.detach().clone() for p in params]
            if i == steps:
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        for p, k in zip(params, kept):
            p.copy_(k)
    for p in frozen:
        p.requires_grad_(True)
    return best


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=2048, help="prompt tokens (the answer comes after)")
    p.add_argument("--layers", type=int, nargs="+", required=True)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--target", default="gdn")
    p.add_argument("--mix-orders", type=int, nargs="+", default=[1],
                   help="the block's normalizer of the older tokens, each measured (GDNOptions.mix_order)")
    p.add_argument("--per-depth", type=int, default=2, help="prompts per depth, held-out and calibration alike")
    p.add_argument("--fit-steps", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--fit-every", action="store_true", help="fit every parameter of the block, q/k/v included")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--markdown", type=Path, default=None, help="also the table of each layer's best retrieval head")
    args = p.parse_args()

    from linearize.conversion import linearize_layer
    from linearize.eval import attention_modules, capture_attention
    from linearize.layers.options import GDNOptions
    from linearize.models import load_teacher
    from linearize.quality.passkey import NEEDLE

    torch.manual_seed(0)
    teacher, tok = load_teacher(args.model)
    held_ids, held_at, t = prompts(tok, args.length, (0.25, 0.5), seed=100, per_depth=args.per_depth)
    cal_ids, _, t_cal = prompts(tok, args.length, (0.1, 0.4, 0.7), seed=200, per_depth=args.per_depth)
    t, t_cal = torch.tensor(t), torch.tensor(t_cal)
    needle = len(tok(NEEDLE.format(key="12345"), add_special_tokens=False).input_ids)
    mods = attention_modules(teacher)
    held = capture_attention(teacher, held_ids, args.layers)
    cal = capture_attention(teacher, cal_ids, args.layers)
    options = {m: GDNOptions(window=args.window, sinks=args.sinks, target=args.target, mix_order=m) for m in args.mix_orders}
    result = {"command": " ".join(["python", *sys.argv]), "model": args.model, "tokens": int(held_ids.shape[1]),
              "held_out_prompts": int(held_ids.shape[0]), "calibration_prompts": int(cal_ids.shape[0]),
              "answer_queries": len(t), "options": {str(m): o.to_dict() for m, o in options.items()},
              "fit_steps": args.fit_steps, "fit_every": args.fit_every, "lr": args.lr, "torch": torch.__version__, "layers": {}}
    for i in args.layers:
        t0 = time.perf_counter()
        split = teacher_split(mods[i], held[i], t, args.window, args.sinks, held_at, needle)
        row = {}
        for m, opts in options.items():
            teacher_attn = copy.deepcopy(mods[i]) if args.fit_every else mods[i]  # the block shares its q/k/v
            block = linearize_layer(teacher_attn, opts, cal[i].hidden_states, cal[i].position_embeddings)
            block.eval()
            row[f"mix{m}"] = measure(block, held[i], t, split)
            if args.fit_steps:
                fit(block, cal[i], t_cal, args.fit_steps, args.lr, args.fit_every)
                row[f"mix{m}_fitted"] = measure(block, held[i], t, split)
        row["seconds"] = time.perf_counter() - t0
        result["layers"][str(i)] = row
        report(i, row)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(result))
    print(f"wrote {args.output}" + (f" and {args.markdown}" if args.markdown else ""))


COLUMNS = ("share_true", "share_block", "log_odds_true", "log_odds_block", "mix_gradient", "err_old", "err",
           "err_true_share", "err_true_old")


def best_head(row: dict) -> int:
    km = next(v for k, v in row.items() if k != "seconds")["key_mass"]
    return max(range(len(km)), key=lambda j: km[j])


def report(layer: int, row: dict) -> None:
    """Per measured block, the layer's best retrieval head (largest key mass) and the median over its heads."""
    h = best_head(row)
    for name, m in row.items():
        if name == "seconds":
            continue
        best = " ".join(f"{k} {m[k][h]:.3f}" for k in COLUMNS)
        med = " ".join(f"{k} {statistics.median(m[k]):.3f}" for k in COLUMNS)
        print(f"layer {layer} {name}: head {h} (key mass {m['key_mass'][h]:.2f}): {best} | median over heads: {med}",
              flush=True)
    m = next(v for k, v in row.items() if k != "seconds")
    print(f"layer {layer} head {h}: err_old of the Taylor reads, order "
          + ", ".join(f"{r}: {m[f'err_read_order{r}'][h]:.3f}" for r in READ_ORDERS), flush=True)


def markdown(result: dict) -> str:
    names = [k for k in next(iter(result["layers"].values())) if k != "seconds"]
    lines = [f"`{result['command']}`", "",
             "Each layer's best retrieval head (the largest mass on the key sentence), means over the answer queries "
             "of the held-out prompts. Log-odds are log(exact share / old share): the teacher's, and the first- and "
             "second-order normalizers' (what a `mix_order` 1 or 2 block computes at conversion). Per block: its old "
             "share, the mix's gradient w(1 − w), `err_old` (the state's read against the teacher's softmax over the "
             "old tokens), its output error `err` and `err_true_old`, the error it would have with the teacher's "
             "old-token output in place of the state's (what its mix alone allows).", "",
             "| layer.head | key mass | old share, teacher | log-odds teacher / 1st / 2nd order | "
             + " | ".join(f"{n}: old share, gradient, err_old, err, err_true_old" for n in names) + " |",
             "|---" * (4 + len(names)) + "|"]
    for layer, row in result["layers"].items():
        h = best_head(row)
        first = row[names[0]]
        cells = [f"{layer}.{h}", f"{first['key_mass'][h]:.2f}", f"{first['share_true'][h]:.3f}",
                 f"{first['log_odds_true'][h]:.1f} / {first['log_odds_first_order'][h]:.1f} / "
                 f"{first['log_odds_second_order'][h]:.1f}"]
        for n in names:
            m = row[n]
            cells.append(f"{m['share_block'][h]:.3f}, {m['mix_gradient'][h]:.3f}, {m['err_old'][h]:.2f}, "
                         f"{m['err'][h]:.2f}, {m['err_true_old'][h]:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "The same heads, the teacher's q/k/v: the error against the teacher's softmax over the older tokens of a "
              "read whose kernel is the Taylor polynomial of exp of order r in the logit centred on its mean over those "
              "tokens (r = 1 is the Taylor-GDN's read; a state for order r holds K^r × V numbers a head).", "",
              "| layer.head | " + " | ".join(f"order {r}" for r in READ_ORDERS) + " |", "|---" * (1 + len(READ_ORDERS)) + "|"]
    for layer, row in result["layers"].items():
        h = best_head(row)
        m = row[names[0]]
        lines.append(f"| {layer}.{h} | " + " | ".join(f"{m[f'err_read_order{r}'][h]:.3f}" for r in READ_ORDERS) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
