"""Training throughput of the distill stages against the teacher's own forward+backward, same run.

    python scripts/bench_distill.py --batch 16 --seq-len 2048 --output results/bench_distill.json
    python scripts/bench_distill.py --variants --output results/bench_distill_variants.json
    python scripts/bench_distill.py --profile --output results/bench_distill_profile.json
    python scripts/bench_distill.py --doc-len 512 --window 64 --sinks 4 --as-trained --output results/bench_distill_as_trained.json

``--variants`` times, in one run, rows of one document and packed rows (documents of ``--doc-len`` or 512
tokens, positions restarting as in real data), each with the fused Triton front (the default on CUDA) and
with the PyTorch front; the teacher is timed on the same rows for each.

SmolLM2-135M architecture (random weights: throughput does not depend on their values), bf16, on
CUDA. Timed per step with CUDA events (median after warm-up):
- teacher: full-model forward + backward of next-token cross-entropy, every parameter trainable;
- align: one teacher forward (no grad) + every GDN block on the teacher's input, backward; the teacher's
  capturing forward alone is timed too (``teacher_capture_s``; ``align_gdn_blocks_s`` is the rest);
- distill: teacher forward (no grad) + student forward + chunked KL, backward into the attention blocks;
- with ``--as-trained``, also the distill step as the recipes' distill stages run it: every parameter trained
  (float32 masters), the loss read back, gradients clipped, the AdamW and schedule steps, the finite checks.
Targets: align ≥ 2×, distill ≥ 0.7× the teacher's tokens/s.

``--tiny`` runs a 2-layer model on the CPU: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import linearize  # noqa: E402
from linearize.config import OptimConfig, StageConfig  # noqa: E402
from linearize.distill.batches import batch_positions  # noqa: E402
from linearize.distill.losses import gdn_layers, objective_for  # noqa: E402
from linearize.distill.optim import make_optimizer, trainable_names  # noqa: E402
from linearize.distill.precision import float32_trainables  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True)


def timed(step, iters: int, host: list | None = None) -> tuple[float, list[float]]:
    """(median, every step's) seconds of ``iters`` steps after two warm-up steps. ``host``: gets each step's
    host seconds — until ``step()`` returns, before waiting on the GPU — a step whose host time is close to
    its total kept the GPU waiting on Python (launches, autograd), not the other way round."""
    for _ in range(2):
        step()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            step()
            b.record()
            if host is not None:
                host.append(time.perf_counter() - t0)
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:  # a smoke run of the script itself on the CPU (--tiny)
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            if host is not None:
                host.append(times[-1])
    return statistics.median(times), times


def gpu_profile(step, iters: int = 2) -> tuple[dict, dict]:
    """Where one step's GPU time goes, from one profiled run: milliseconds per step summed per kernel name
    (top 25), the total of all kernels, and the step's wall time, to tell GPU-bound from host-bound steps;
    and per PyTorch operator, the milliseconds of the kernels it launched itself (top 30), which names the
    anonymous elementwise kernels (aten::copy_, aten::add, …); Triton kernels have no operator around them."""
    from profile_kernels import profile_calls

    ops = {}
    per_us, wall = profile_calls(step, iters, name_len=80, ops=ops)
    top = {k: us / 1e3 for k, us in list(per_us.items())[:25]}
    by_op = {k: {"ms": us / 1e3, "calls": n} for k, (us, n) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:30]}
    return {"kernel_ms_total": sum(per_us.values()) / 1e3, "wall_ms_profiled": wall * 1e3, "top_kernels_ms": top}, by_op


def host_profile(step, iters: int = 3, top: int = 30) -> list[dict]:
    """Where one step's host (Python) time goes: cProfile over ``iters`` steps, the ``top`` functions by
    their own time, milliseconds per step."""
    import cProfile
    import pstats

    step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        step()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    rows = [{"function": f"{Path(f).name}:{line}:{fn}", "calls_per_step": cc / iters, "own_ms_per_step": tt * 1e3 / iters,
             "cum_ms_per_step": ct * 1e3 / iters} for (f, line, fn), (cc, nc, tt, ct, _) in st.stats.items()]
    return sorted(rows, key=lambda r: -r["own_ms_per_step"])[:top]


def sync_sites(step, top: int = 25) -> list[dict]:
    """Where one step makes the host wait for the GPU: the step run once under CUDA's sync debug mode, every
    synchronizing call's innermost frame of this project (or the script) counted — each one drains the
    launch queue, and the GPU then idles while Python launches the next kernels."""
    import collections
    import traceback
    import warnings

    step()
    torch.cuda.synchronize()
    sites = collections.Counter()
    root = str(Path(__file__).resolve().parents[1])

    def show(message, category, filename, lineno, file=None, line=None):
        ours = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root)]
        f = ours[-1] if ours else traceback.extract_stack()[-2]
        sites[f"{Path(f.filename).relative_to(root) if f.filename.startswith(root) else f.filename}:{f.lineno}: "
              f"{(f.line or '').strip()[:100]}"] += 1

    shown = warnings.showwarning
    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = shown
    return [{"site": k, "calls_per_step": n} for k, n in sites.most_common(top)]


def profiled(rows: dict, name: str, step, profile: bool, host: bool, syncs: bool = False) -> None:
    """Into ``rows`` under ``name``, and printed: with ``host`` the step's cProfile (and with ``syncs`` the
    call sites that wait for the GPU, :func:`sync_sites`), with ``profile`` its GPU time per kernel and per
    operator (:func:`gpu_profile`)."""
    if host:
        rows[f"{name}_host_profile"] = hp = host_profile(step)
        print(f"{name}: host time per step by function (own ms, calls)")
        for r in hp[:20]:
            print(f"  {r['own_ms_per_step']:8.2f} ms {r['calls_per_step']:7.0f}  {r['function']}")
        if syncs:
            rows[f"{name}_syncs"] = sites = sync_sites(step)
            print(f"{name}: calls that wait for the GPU, per step")
            for r in sites:
                print(f"  {r['calls_per_step']:5d}  {r['site']}")
    if profile:
        prof, ops = gpu_profile(step)
        rows[f"{name}_profile"], rows[f"{name}_ops"] = prof, ops
        print(f"{name}: kernels {prof['kernel_ms_total']:.1f} ms per step, wall {prof['wall_ms_profiled']:.1f} ms")
        for kname, ms in prof["top_kernels_ms"].items():
            print(f"  {ms:8.2f} ms  {kname}")
        print(f"{name}: GPU ms per step by operator (self time)")
        for op, r in ops.items():
            print(f"  {r['ms']:8.2f} ms {r['calls']:6.0f}  {op}")


def student_of(teacher, fused_front: bool, block: dict | None):
    """The teacher converted (a copy), calibrated on random ids as the benchmark's rows are."""
    from linearize.layers import GDNOptions

    calib = torch.randint(0, teacher.config.vocab_size, (1, 512), device=next(teacher.parameters()).device)
    return linearize.convert(copy.deepcopy(teacher), calibration_ids=calib,
                             options=GDNOptions(fused_front=fused_front, **(block or {})))


def measure(teacher, ids, pos, fused_front: bool, iters: int, profile: bool = False, host: bool = False,
            block: dict | None = None) -> dict:
    """Seconds per step of the teacher's forward+backward and of the align and distill steps."""
    dev, dt = ids.device, next(teacher.parameters()).dtype
    teacher.requires_grad_(True)
    pos = batch_positions(pos, dev)  # as the trainer passes them: None for rows of one document each

    def teacher_step():
        loss = teacher(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss
        loss.backward()
        teacher.zero_grad(set_to_none=True)

    rows = {}
    rows["teacher_fwd_bwd_s"], rows["teacher_fwd_bwd_steps_s"] = timed(teacher_step, iters)
    if profile and dev.type == "cuda":
        rows["teacher_fwd_bwd_profile"] = gpu_profile(teacher_step)[0]
    teacher.requires_grad_(False)
    student = student_of(teacher, fused_front, block)
    float32_trainables(student, set(trainable_names(student, StageConfig(trainable="self_attn"))), dt)  # as setup does
    # the part of an align step that is the teacher's own forward (no grad, capturing every layer's
    # attention input and output): what is left of the step is the GDN blocks' forward, loss and backward
    from linearize.eval import capture_attention

    layers = list(gdn_layers(student))
    rows["teacher_capture_s"], _ = timed(
        lambda: capture_attention(teacher, ids, layers, position_ids=pos, stop_early=True), iters)  # as align_loss
    for name in ("align", "distill"):
        st = StageConfig(name=name, trainable="self_attn", loss="nmse", kl_chunk=4096)
        opt, _, _ = make_optimizer(student, st, OptimConfig(), fsdp=False)
        objective = objective_for(st, student, teacher, fsdp=False)

        def step(opt=opt, objective=objective):
            loss = objective(ids, pos)[0]
            loss.backward()
            opt.zero_grad(set_to_none=True)

        host_times = []
        rows[f"{name}_s"], rows[f"{name}_steps_s"] = timed(step, iters, host_times)
        rows[f"{name}_host_s"] = statistics.median(host_times)
        if dev.type == "cuda":
            profiled(rows, name, step, profile, host)
    tokens = ids.numel()
    for k in ("teacher_fwd_bwd", "align", "distill"):
        rows[f"{k}_tokens_per_s"] = tokens / rows[f"{k}_s"]
    rows["align_vs_teacher"] = rows["align_tokens_per_s"] / rows["teacher_fwd_bwd_tokens_per_s"]
    rows["distill_vs_teacher"] = rows["distill_tokens_per_s"] / rows["teacher_fwd_bwd_tokens_per_s"]
    rows["align_gdn_blocks_s"] = rows["align_s"] - rows["teacher_capture_s"]
    return rows


def measure_as_trained(teacher, ids, pos, fused_front: bool, iters: int, block: dict | None = None,
                       profile: bool = False, host: bool = False) -> dict:
    """Seconds of a distill step as a recipe's distill stage runs it (``trainable: all``, the default): every
    parameter a float32 master (as setup makes them), the loss read back for the finite check, gradients
    clipped at the default norm, the AdamW and schedule steps, the parameters checked finite — where the
    ``distill`` row trains the attention blocks alone and takes no optimizer step."""
    from linearize.distill.parallel import all_finite, clip_gradients

    dev, dt = ids.device, next(teacher.parameters()).dtype
    pos = batch_positions(pos, dev)
    teacher.requires_grad_(False)
    student = student_of(teacher, fused_front, block)
    st, optim = StageConfig(name="distill", trainable="all", kl_chunk=4096), OptimConfig()
    float32_trainables(student, set(trainable_names(student, st)), dt)
    opt, sched, _ = make_optimizer(student, st, optim, fsdp=False)
    objective = objective_for(st, student, teacher, fsdp=False)
    params = [p for g in opt.param_groups for p in g["params"]]
    student.train()

    def step():
        loss = objective(ids, pos)[0]
        student.zero_grad(set_to_none=True)
        loss.backward()
        loss.detach().item()  # the trainer reads the loss back to check it is finite
        clip_gradients(params, optim.grad_clip)
        opt.step()
        sched.step()
        all_finite(params, dev)

    rows = {}
    rows["distill_as_trained_s"], rows["distill_as_trained_steps_s"] = timed(step, iters)
    rows["distill_as_trained_tokens_per_s"] = ids.numel() / rows["distill_as_trained_s"]
    if dev.type == "cuda":
        profiled(rows, "distill_as_trained", step, profile, host, syncs=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--iters", type=int, default=7, help="timed steps per measurement (the median is reported; "
                   "with 3 the first variant's align varied ±20%% between runs)")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--doc-len", type=int, default=0,
                   help="pack documents of this many tokens in each row (positions restart), as real data is")
    p.add_argument("--pytorch-front", action="store_true",
                   help="GDNOptions(fused_front=False): the PyTorch Taylor front instead of the fused Triton one")
    p.add_argument("--variants", action="store_true", help="rows and packed rows, each with both fronts, in one run")
    p.add_argument("--profile", action="store_true",
                   help="also profile the align and distill steps: GPU ms per kernel name, kernel total against wall")
    p.add_argument("--host-profile", action="store_true",
                   help="also cProfile the align and distill steps: host ms per function (is the step Python-bound?); "
                        "with --as-trained also that step's, and the calls in it that wait for the GPU")
    p.add_argument("--window", type=int, default=0, help="GDNOptions.window: the sink + sliding-window block")
    p.add_argument("--sinks", type=int, default=0, help="GDNOptions.sinks (with --window)")
    p.add_argument("--output-gate", action="store_true", help="GDNOptions.output_gate")
    p.add_argument("--mix-order", type=int, default=1, help="GDNOptions.mix_order (with --window)")
    p.add_argument("--as-trained", action="store_true",
                   help="also time the distill step as a recipe's distill stage runs it: every parameter trained "
                        "(float32 masters), gradient clipping, the AdamW step, the finite checks")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: checks the script, measures nothing")
    args = p.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        p.exit(2, "error: bench_distill.py measures on a CUDA device; run it on a GPU machine (--tiny checks the script on the CPU)\n")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if args.tiny:
        dev, dt = torch.device("cpu"), torch.float32
        cfg = LlamaConfig(**{**SMOLLM2, "vocab_size": 1000, "hidden_size": 48, "intermediate_size": 96,
                             "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 16})
    else:
        dev, dt = torch.device("cuda"), torch.bfloat16
        cfg = LlamaConfig(**SMOLLM2)
    cfg._attn_implementation = "sdpa"
    teacher = LlamaForCausalLM(cfg).to(dev, dt).eval()
    B, T = args.batch, args.seq_len
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
    rows_pos = torch.arange(T).expand(B, T)  # on the host, as the trainer's data is
    doc = args.doc_len or 512
    if args.variants:
        plan = [("rows + fused front", rows_pos, True), ("rows + PyTorch front", rows_pos, False),
                (f"packed {doc} + fused front", rows_pos % doc, True), (f"packed {doc} + PyTorch front", rows_pos % doc, False)]
    else:
        plan = [("run", rows_pos % args.doc_len if args.doc_len else rows_pos, not args.pytorch_front)]
    res = {"command": " ".join(["python", *sys.argv]),
           "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (--tiny: a check of the script)",
           "B": B, "T": T, "iters": args.iters, "dtype": str(dt).split(".")[-1], "model": "SmolLM2-135M architecture, random weights"}
    block = dict(window=args.window, sinks=args.sinks, output_gate=args.output_gate, mix_order=args.mix_order)
    res["block"] = block
    variants = []
    for name, pos, fused in plan:
        row = {"variant": name, "doc_len": int(pos.max()) + 1, "fused_front": fused, **measure(teacher, ids, pos, fused, args.iters, args.profile, args.host_profile, block)}
        if args.as_trained:
            row.update(measure_as_trained(teacher, ids, pos, fused, args.iters, block, args.profile, args.host_profile))
            row["distill_as_trained_vs_teacher"] = (row["distill_as_trained_tokens_per_s"]
                                                    / row["teacher_fwd_bwd_tokens_per_s"])
        variants.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.variants:
        res["variants"] = variants
    else:
        res.update({k: v for k, v in variants[0].items() if k != "variant"})
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
