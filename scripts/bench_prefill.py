"""Prefill speed of a converted model against its teacher: the prompt read into the decoding cache.

    python scripts/bench_prefill.py --contexts 8192 32768 65536 --batches 1 16 --profile 32768x1 \\
        --output results/bench_prefill.json
    python scripts/bench_prefill.py --sparse-cache 1024 --contexts 32768 --batches 1 16 --profile 32768x16
    python scripts/bench_prefill.py --pytorch-front --contexts 32768 --batches 16 --profile 32768x16

Per (context, batch), on the same random prompt, the call a decoder makes before its first token:
``model(ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)`` — for the teacher its
SDPA attention filling a KV cache, for the converted model the chunkwise GDN kernels (and the exact
window part) writing the final state. Times are medians of ``--repeats`` calls after one untimed warm-up;
also peak memory, the GPU time inside the attention modules (``attention_seconds``, CUDA events around every
``self_attn`` in one more call: what the rest of the model costs either way shows as the difference), and the
converted model's time as a ratio of the teacher's (``speedup``: > 1 is faster).
A converted model's RMSNorms and SiLU-gated MLPs run one Triton pass each on CUDA without gradients
(:mod:`linearize.modules.norm`, :mod:`linearize.modules.swiglu`; the teacher's as transformers computes them);
``--fused-modules`` also times the teacher with those kernels and the converted model without them, so each
model's share of them shows (``speedup_vs_teacher_fused_modules``: like against like).
``--profile CxB`` adds, for that shape, each model's CUDA kernels by total time (torch's profiler, one
call), so the slow part of a prefill shows by name. A converted model's window blocks read a prompt through the
fused Triton front by default on CUDA (``GDNOptions.fused_front``); ``--pytorch-front`` also times the same
weights with ``fused_front=False`` (the PyTorch front, the path training takes), as ``converted_pytorch_front``,
in the same run. (Runs before that default took the PyTorch front as ``converted`` and timed the fused one
with ``--fused-front``.) Without ``--model``: SmolLM2-135M's architecture
with random weights (speed does not depend on the weights).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_decode import build_teacher, timed  # noqa: E402

import linearize  # noqa: E402
from linearize.compat import cache_kwargs  # noqa: E402
from linearize.layers.options import GDNOptions  # noqa: E402


def prefill(model, ids):
    from transformers import DynamicCache

    with torch.no_grad():
        model(ids, **cache_kwargs(DynamicCache(config=model.config)), use_cache=True, logits_to_keep=1)


def measure(model, ids, repeats: int) -> dict:
    prefill(model, ids)  # warm-up: kernels compiled, autotuned
    torch.cuda.reset_peak_memory_stats()
    times = [timed(lambda: prefill(model, ids))[0] for _ in range(repeats)]
    s = statistics.median(times)
    return {"seconds": s, "tokens_per_s": ids.numel() / s, "peak_bytes": torch.cuda.max_memory_allocated(),
            "attention_seconds": attention_seconds(model, ids)}


def attention_seconds(model, ids) -> float:
    """GPU seconds inside the attention modules (every ``self_attn``: projections, RoPE, the attention or
    the converted block) in one more prefill, between CUDA events recorded around each call (no host sync
    inside): what a faster attention can save; the rest (MLP, norms, residuals, the head) both models run."""
    spans = []

    def timed_forward(forward):
        def run(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = forward(*args, **kwargs)
            end.record()
            spans.append((start, end))
            return out
        return run

    modules = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    own = [m.__dict__.get("forward") for m in modules]  # a forward set on the instance, kept
    for m in modules:
        m.forward = timed_forward(m.forward)
    try:
        prefill(model, ids)
        torch.cuda.synchronize()
    finally:
        for m, forward in zip(modules, own):
            if forward is None:
                del m.forward  # the class's forward again
            else:
                m.forward = forward
    return sum(a.elapsed_time(b) for a, b in spans) / 1e3


def kernels(model, ids, top: int) -> list[dict]:
    """One prefill's CUDA kernels, summed by name, the largest ``top`` first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill(model, ids)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in rows)
    return [{"kernel": e.key[:120], "calls": e.count, "ms": e.device_time_total / 1e3,
             "share": e.device_time_total / total} for e in rows[:top]]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a real checkpoint (default: SmolLM2-135M architecture, random weights)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--window", type=int, default=64, help="the converted block's window (0: the pure block)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--sparse-cache", type=int, default=0,
                   help="the converted block's sparse cache (slots per KV head; the corpus recipe's is 1024)")
    p.add_argument("--backend", default="auto", choices=("auto", "triton"),
                   help="the converted block's backend: triton also runs the window part through its Triton forward")
    p.add_argument("--pytorch-front", action="store_true",
                   help="also the converted model with fused_front=False (its prefill through the PyTorch front)")
    p.add_argument("--fused-modules", action="store_true",
                   help="also the teacher with the converted model's fused RMSNorm and gated-MLP kernels "
                        "(teacher_fused_modules) and the converted model without them (converted_unfused_modules)")
    p.add_argument("--profile", default=None, metavar="CxB", help="also list the kernels of this context x batch")
    p.add_argument("--top", type=int, default=25, help="kernels listed per model with --profile")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.exit(2, "error: no CUDA device here; the prefill benchmark runs on a GPU machine\n")
    profile_at = None
    if args.profile:
        try:
            profile_at = tuple(int(x) for x in args.profile.lower().split("x"))
            assert len(profile_at) == 2
        except (ValueError, AssertionError):
            p.exit(2, f"error: --profile {args.profile!r} must be CONTEXTxBATCH, e.g. 32768x1\n")

    teacher = build_teacher(args.model, torch.bfloat16).cuda()
    vocab = teacher.config.vocab_size
    calib = torch.randint(0, vocab, (1, 512), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    options = GDNOptions(window=args.window, sinks=args.sinks, sparse_cache=args.sparse_cache, backend=args.backend)
    converted = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib, options=options).eval()
    models = {"teacher": teacher, "converted": converted}
    if args.pytorch_front:  # the same weights, the old stream through the PyTorch front
        models["converted_pytorch_front"] = other = copy.deepcopy(converted)
        for module in other.modules():
            if isinstance(getattr(module, "options", None), GDNOptions):
                module.options = dataclasses.replace(module.options, fused_front=False)
    if args.fused_modules:  # the norms' and MLPs' kernels alone, on each model (a converted model has them)
        from linearize.conversion import fuse_inference_kernels, unfuse_inference_kernels

        models["teacher_fused_modules"] = copy.deepcopy(teacher)
        fuse_inference_kernels(models["teacher_fused_modules"])
        models["converted_unfused_modules"] = other = copy.deepcopy(converted)
        unfuse_inference_kernels(other)
    out = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "model": args.model or "SmolLM2-135M architecture, random weights", "dtype": "bfloat16",
           "block": options.to_dict(), "repeats": args.repeats, "rows": []}
    shapes = [(c, b) for c in args.contexts for b in args.batches]
    if profile_at and profile_at not in shapes:
        shapes.append(profile_at)
    for context, batch in shapes:
        ids = torch.randint(1, vocab, (batch, context), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
        row = {"context": context, "batch": batch}
        for name, model in models.items():
            gc.collect()
            torch.cuda.empty_cache()
            try:
                row[name] = measure(model, ids, args.repeats)
                if (context, batch) == profile_at:
                    row[name]["kernels"] = kernels(model, ids, args.top)
            except torch.OutOfMemoryError:
                row[name] = {"error": "out of memory"}
        for name in list(models)[1:]:  # "speedup" for the converted model, "speedup_<name>" for another
            if "seconds" in row["teacher"] and "seconds" in row[name]:
                key = "speedup" if name == "converted" else f"speedup_{name}"
                row[key] = row["teacher"]["seconds"] / row[name]["seconds"]
        both = row.get("teacher_fused_modules", {}), row.get("converted", {})
        if all("seconds" in r for r in both):  # like against like: both models with the fused modules
            row["speedup_vs_teacher_fused_modules"] = both[0]["seconds"] / both[1]["seconds"]
        out["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items()}, default=str)[:2000], flush=True)
        if args.output:  # after every row: a run stopped by a time limit keeps what it measured
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(out, indent=1))
    if args.output:
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
