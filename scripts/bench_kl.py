"""A/B benchmark of the fused distillation loss against the textbook PyTorch one, on one chunk of logits.

    python scripts/bench_kl.py --output results/bench_kl.json                   # GPU, distill defaults
    python scripts/bench_kl.py --ce-weight 0.5 --output results/bench_kl_ce.json
    python scripts/bench_kl.py --device cpu --rows 256 --vocab 8192 --dtype float32   # smoke check

It measures one ``kl_loss`` call as ``linearize/distill/losses.py::chunked_kl`` makes it: ``kl_chunk`` rows
of student and teacher logits (defaults: the distill stage of recipes/smollm2-135m-gdn-corpus.yaml, 4096
rows x 49152 vocabulary, bf16 on CUDA, temperature 1.0, no CE), ``kl_weight = 1/rows`` and ``ce_weight``
divided by the number of real labels (1% of the labels are -100). Variants:
- ours:    ``linearize.modules.kl.kl_loss`` (Triton on CUDA, its PyTorch path elsewhere);
- library: ``F.kl_div(log_softmax(s/T), log_softmax(t/T), log_target=True, reduction="sum")`` (+ ``F.cross_entropy``)
  in float32 from the logits, through autograd.
For each: the loss and the student-logit gradient against float64 autograd of the same expression (chunks of
``--ref-chunk`` rows; the gradient's error is max|g - g_ref| / max|g_ref|), forward+backward time (median of
``--iters`` after ``--warmup``; CUDA events, or time.perf_counter on the CPU) and, on CUDA only, peak memory
above the inputs (max_memory_allocated after reset_peak_memory_stats; includes the bf16 .grad). Ratios are
ours / library.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton  # linearize.modules.kl needs it too

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.modules.kl import kl_loss  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def library_loss(s, t, y, T, kl_w, ce_w, acc=torch.float32):
    """The textbook loss: casts to ``acc``, both log-softmaxes and the CE, all kept by autograd."""
    s32, t32 = s.to(acc), t.to(acc)
    loss = F.kl_div(F.log_softmax(s32 / T, -1), F.log_softmax(t32 / T, -1), log_target=True,
                    reduction="sum") * (kl_w * T * T)
    if ce_w is not None:
        loss = loss + F.cross_entropy(s32, y, reduction="sum", ignore_index=-100) * ce_w
    return loss


def ours_loss(s, t, y, T, kl_w, ce_w):
    return kl_loss(s, t, y, T, kl_weight=kl_w, ce_weight=ce_w)


VARIANTS = {"ours": ours_loss, "library": library_loss}  # library: the anchor of the ratios


def step(fn, s, t, y, T, kl_w, ce_w):
    s.grad = None
    loss = fn(s, t, y, T, kl_w, ce_w)
    loss.backward()
    return loss


def check(s, t, y, T, kl_w, ce_w, chunk):
    """Loss and gradient errors of each variant against float64 autograd, chunk by chunk of rows."""
    out = {}
    for name, fn in VARIANTS.items():
        loss = step(fn, s, t, y, T, kl_w, ce_w).item()
        out[name] = {"loss": loss, "grad": s.grad.detach().clone(), "gerr": 0.0}
    ref_loss, gmax = 0.0, 0.0
    for a in range(0, s.shape[0], chunk):
        s64 = s.detach()[a:a + chunk].double().requires_grad_()
        l64 = library_loss(s64, t[a:a + chunk], y[a:a + chunk], T, kl_w,
                           None if ce_w is None else ce_w.double(), acc=torch.float64)
        l64.backward()
        ref_loss += l64.item()
        gmax = max(gmax, s64.grad.abs().max().item())
        for r in out.values():
            r["gerr"] = max(r["gerr"], (r["grad"][a:a + chunk].double() - s64.grad).abs().max().item())
    for r in out.values():
        r.update(ref_loss=ref_loss, loss_abs_err=abs(r["loss"] - ref_loss),
                 loss_rel_err=abs(r["loss"] - ref_loss) / max(abs(ref_loss), 1e-30),
                 grad_max_abs_err=r["gerr"], grad_max_rel_err=r.pop("gerr") / max(gmax, 1e-30))
        del r["grad"]
    s.grad = None
    return out


def time_ms(fn, args, iters, warmup, cuda):
    for _ in range(warmup):
        step(fn, *args)
    times = []
    for _ in range(iters):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step(fn, *args)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
        else:
            t0 = time.perf_counter()
            step(fn, *args)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mb(fn, args, dev):
    """Peak CUDA memory of one forward+backward above what was allocated before it (the inputs)."""
    args[0].grad = None
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    step(fn, *args)
    torch.cuda.synchronize(dev)
    args[0].grad = None
    return (torch.cuda.max_memory_allocated(dev) - base) / 2**20


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="rows per call (the recipe's kl_chunk)")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--ce-weight", type=float, default=0.0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--ref-chunk", type=int, default=512, help="rows per chunk of the float64 reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path)
    a = p.parse_args()

    dev, dt, T = torch.device(a.device), DTYPES[a.dtype], a.temperature
    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(a.seed)
    s = 3 * torch.randn(a.rows, a.vocab, device=dev, generator=g)  # teacher = student + noise
    t = (s + torch.randn(a.rows, a.vocab, device=dev, generator=g)).to(dt)
    s = s.to(dt).requires_grad_()
    y = torch.randint(0, a.vocab, (a.rows,), device=dev, generator=g)
    y[torch.rand(a.rows, device=dev, generator=g) < 0.01] = -100
    kl_w = 1.0 / a.rows
    ce_w = None
    if a.ce_weight:  # as chunked_kl: a device scalar, the weight over the count of real labels
        ce_w = a.ce_weight / (y != -100).sum().clamp_min(1).float()
    args = (s, t, y, T, kl_w, ce_w)

    res = check(*args, chunk=a.ref_chunk)
    for name, fn in VARIANTS.items():
        res[name]["ms_median"] = time_ms(fn, args, a.iters, a.warmup, cuda)
        res[name]["peak_mb"] = peak_mb(fn, args, dev) if cuda else None
    o, lib = res["ours"], res["library"]
    report = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(dev) if cuda else (platform.processor() or platform.machine()),
        "torch": torch.__version__, "triton": triton.__version__, "git_commit": git_commit(),
        "shape": {"rows": a.rows, "vocab": a.vocab, "dtype": a.dtype, "device": str(dev), "temperature": T,
                  "ce_weight": a.ce_weight, "iters": a.iters, "warmup": a.warmup},
        "ours_path": "triton" if cuda else "torch",
        "variants": res,
        "ratio_ours_over_library": {
            "time": o["ms_median"] / lib["ms_median"],
            "memory": o["peak_mb"] / lib["peak_mb"] if cuda and lib["peak_mb"] else None},
    }
    if not cuda:
        report["note"] = "peak memory: CUDA only (the CPU's ru_maxrss is a process-wide high-water mark)"

    print(f"{a.rows} x {a.vocab} {a.dtype} on {report['device']}, T={T}, ce_weight={a.ce_weight}, "
          f"ours: {report['ours_path']}")
    print(f"{'variant':8} {'ms_median':>10} {'peak_mb':>9} {'loss':>14} {'loss_rel_err':>12} {'grad_rel_err':>12}")
    for name, r in res.items():
        pk = f"{r['peak_mb']:9.1f}" if r["peak_mb"] is not None else f"{'-':>9}"
        print(f"{name:8} {r['ms_median']:10.3f} {pk} {r['loss']:14.6f} {r['loss_rel_err']:12.2e} "
              f"{r['grad_max_rel_err']:12.2e}")
    rt = report["ratio_ours_over_library"]
    print(f"ours/library: time {rt['time']:.3f}" + (f", memory {rt['memory']:.3f}" if rt["memory"] else ""))
    if not cuda:
        print("note: " + report["note"])
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
