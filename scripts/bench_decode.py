"""Decode speed and memory: converted GDN model (constant-size state) vs the teacher (KV cache).

    python scripts/bench_decode.py --contexts 2048 8192 32768 --batches 1 16 --output results/bench_decode.json

Same harness for both models: prefill ``context`` tokens (logits of the last position only), then
time ``--steps`` single-token decode steps with CUDA events (median over steps after a warm-up).
Reported per (context, batch): decode tokens/s, the decoding cache's size, and peak memory during
decoding (weights + cache + work), for teacher and converted, and the converted/teacher ratios.

The default model is SmolLM2-135M's architecture (config as shipped in the GGUF) with random
weights — decode speed and memory do not depend on the weight values; ``--model`` loads a real
checkpoint instead. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import linearize  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=65536, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True)


def build_teacher(model: str | None, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if model:
        from linearize.models import load_teacher

        return load_teacher(model, dtype=dtype)[0]
    torch.manual_seed(0)
    cfg = LlamaConfig(**SMOLLM2)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).to(dtype).eval()


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None:
            total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    return total


@torch.no_grad()
def decode(model, batch: int, context: int, steps: int, vocab: int) -> dict:
    from transformers import DynamicCache

    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, vocab, (batch, context), device=dev, generator=gen)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    nxt = torch.randint(0, vocab, (batch, 1), device=dev, generator=gen)
    times = []
    for i in range(steps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(input_ids=nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        end.record()
        end.synchronize()
        if i >= 3:  # warm-up steps
            times.append(start.elapsed_time(end) / 1e3)
    med = statistics.median(times)
    return {"step_ms": med * 1e3, "tokens_per_s": batch / med, "cache_bytes": cache_bytes(cache),
            "peak_bytes": torch.cuda.max_memory_allocated()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a real checkpoint (default: SmolLM2-135M architecture, random weights)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.exit(2, "error: bench_decode.py needs a CUDA device; run it on a GPU machine\n")

    dtype = torch.bfloat16
    teacher = build_teacher(args.model, dtype).cuda()
    vocab = teacher.config.vocab_size
    calib = torch.randint(0, vocab, (1, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    converted = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib).eval()

    rows = []
    for context in args.contexts:
        for batch in args.batches:
            row = {"context": context, "batch": batch}
            for name, model in (("teacher", teacher), ("converted", converted)):
                gc.collect()
                torch.cuda.empty_cache()
                try:
                    row[name] = decode(model, batch, context, args.steps, vocab)
                except torch.OutOfMemoryError:
                    row[name] = {"error": "out of memory"}
            t, c = row["teacher"], row["converted"]
            if "error" not in t and "error" not in c:
                row["speed_ratio"] = c["tokens_per_s"] / t["tokens_per_s"]
                row["peak_memory_ratio"] = t["peak_bytes"] / c["peak_bytes"]
                row["cache_ratio"] = t["cache_bytes"] / max(c["cache_bytes"], 1)
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\n{'ctx':>6} {'B':>3} | {'teacher tok/s':>13} {'GDN tok/s':>10} {'speed x':>8} | "
          f"{'teacher peak':>12} {'GDN peak':>9} {'mem x':>6} | {'KV cache':>9} {'GDN state':>9}")
    for r in rows:
        t, c = r["teacher"], r["converted"]
        if "speed_ratio" not in r:
            print(f"{r['context']:>6} {r['batch']:>3} | teacher {t} converted {c}")
            continue
        print(f"{r['context']:>6} {r['batch']:>3} | {t['tokens_per_s']:>13.0f} {c['tokens_per_s']:>10.0f} "
              f"{r['speed_ratio']:>8.2f} | {t['peak_bytes'] / 2**30:>10.2f}GB {c['peak_bytes'] / 2**30:>7.2f}GB "
              f"{r['peak_memory_ratio']:>6.2f} | {t['cache_bytes'] / 2**20:>7.0f}MB {c['cache_bytes'] / 2**20:>7.2f}MB")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        meta = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "dtype": "bfloat16 weights, fp32 GDN state",
                "model": args.model or "SmolLM2-135M architecture, random weights", "steps": args.steps}
        args.output.write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
