"""What the sparse cache costs in training: forward + backward of converted models with and without it, beside
the softmax teacher, on the SmolLM2-135M architecture (random weights: the cost does not depend on them).

    python scripts/bench_sparse_cache.py --output results/bench_sparse_cache_training.json

Each model — the teacher (SDPA), the window block (64 + 4 sinks), the window block with a cache of C tokens
per KV head for each ``--sizes`` C — runs ``--steps`` timed steps of forward + backward on ``--batch`` rows of
``--seq`` tokens after two warm-up steps (FlexAttention compiles there), the rows packing documents of about
``--doc-len`` tokens as training's do (positions restarting; 0: one document a row). Reports ms per step and
tokens/s, each as a ratio to the teacher measured in the same run, and a profile of one step of the window
block and of the largest cache: the CUDA kernels by total time, so what dominates is seen, not guessed. Needs
CUDA. Writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch


def smollm2_architecture(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      rope_theta=100000.0, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def packed_positions(batch: int, seq: int, doc_len: int) -> torch.Tensor | None:
    """Position ids of rows cut into documents of uniformly random length in [1, 2 doc_len]."""
    if not doc_len:
        return None
    g = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(batch):
        lens = []
        while sum(lens) < seq:
            lens.append(int(torch.randint(1, 2 * doc_len + 1, (1,), generator=g)))
        rows.append(torch.cat([torch.arange(n) for n in lens])[:seq])
    return torch.stack(rows)


def step_ms(model, ids, pos, steps: int) -> float:
    def once():
        model(ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()

    for _ in range(2):
        once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        once()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--doc-len", type=int, default=512)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--output", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench_sparse_cache.py measures on a CUDA GPU; none here")

    import linearize
    from linearize.layers import GDNOptions

    teacher = smollm2_architecture(args.layers)
    calib = torch.randint(0, 49152, (1, 512), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 49152, (args.batch, args.seq), generator=torch.Generator().manual_seed(2)).cuda()
    pos = packed_positions(args.batch, args.seq, args.doc_len)
    pos = None if pos is None else pos.cuda()
    models = {"teacher": teacher}
    models["window"] = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib, options=GDNOptions(window=64, sinks=4))
    for c in args.sizes:
        models[f"cache{c}"] = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib,
                                                options=GDNOptions(window=64, sinks=4, sparse_cache=c))
    result = {"command": " ".join(["python", *sys.argv]), "batch": args.batch, "seq": args.seq,
              "doc_len": args.doc_len, "layers": args.layers,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "models": {}}
    tokens = args.batch * args.seq
    for name, m in models.items():
        m = m.cuda().to(torch.bfloat16).train()
        ms = step_ms(m, ids, pos, args.steps)
        result["models"][name] = {"ms_per_step": ms, "tokens_per_s": tokens / ms * 1e3,
                                  "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        torch.cuda.reset_peak_memory_stats()
        print(f"{name}: {ms:.1f} ms/step, {tokens / ms * 1e3:,.0f} tokens/s", flush=True)
        m.cpu()
    anchor = result["models"]["teacher"]["ms_per_step"]
    for r in result["models"].values():
        r["time_vs_teacher"] = r["ms_per_step"] / anchor
    from torch.profiler import ProfilerActivity, profile

    for name in ("window", f"cache{max(args.sizes)}"):  # where the converted blocks' time goes
        m = models[name].cuda()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m(ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
            torch.cuda.synchronize()
        m.cpu()
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:15]
        result[f"profile_{name}"] = [{"kernel": e.key[:120], "ms": e.device_time_total / 1e3, "calls": e.count}
                                     for e in events]
        print(f"== {name}: the CUDA kernels of one step by time")
        for e in result[f"profile_{name}"]:
            print(f"{e['ms']:9.1f} ms {e['calls']:5d}x {e['kernel']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
