"""Peak memory of a converted model's chunked prefill against the prompt's length.

    python scripts/prefill_memory.py --contexts 8192 16384 32768 65536 --chunk 4096 \\
        --output results/prefill_memory_cpu.json

A model of GDN layers fed its prompt ``--chunk`` tokens at a time (``Decoder(prefill_chunk=…)``) keeps one
chunk's activations and a fixed-size state, so its prefill's peak memory should not grow with the prompt.
Each context runs in a fresh process: on the CPU the peak is the process's resident set (``ru_maxrss``,
which never goes down, hence one process each) less what it held before the prefill; on CUDA the allocator's
peak less what was allocated before. One row of the batch is left-padded (``--pad`` tokens), as a batch
of real prompts is, so the model builds 4-D masks. Without ``--model``: SmolLM2-135M's architecture with
random weights, converted with the default block (window 64 + 4 sinks + GDN).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one(args) -> dict:
    """The prefill of one context, in this process: its peak memory above what the process held before."""
    from bench_decode import build_teacher

    import linearize
    from linearize.decoding import Decoder
    from linearize.layers import GDNOptions

    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    torch.set_grad_enabled(False)
    teacher = build_teacher(args.model, torch.bfloat16 if cuda else torch.float32).to(dev)
    vocab = teacher.config.vocab_size
    calib = torch.randint(0, vocab, (1, 512), generator=torch.Generator().manual_seed(1)).to(dev)
    model = linearize.convert(teacher, calibration_ids=calib, options=GDNOptions(window=64, sinks=4)).eval()
    ids = torch.randint(1, vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(0)).to(dev)
    mask = torch.ones_like(ids)
    mask[0, :args.pad] = 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    t0 = time.perf_counter()
    Decoder(model, graph=False, prefill_chunk=args.chunk).generate(ids, attention_mask=mask, max_new_tokens=1)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"context": args.context, "batch": args.batch, "chunk": args.chunk, "before_bytes": before,
            "prefill_peak_bytes": peak - before, "prefill_s": time.perf_counter() - t0}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a real checkpoint (default: SmolLM2-135M architecture, random weights)")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk", type=int, default=4096, help="prompt tokens a prefill call takes")
    p.add_argument("--pad", type=int, default=5, help="left padding of the batch's first row")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--context", type=int, default=None, help=argparse.SUPPRESS)  # one context, in a child
    args = p.parse_args()
    if args.context is not None:
        print(json.dumps(one(args)))
        return
    rows = []
    for context in args.contexts:
        cmd = [sys.executable, __file__, "--context", str(context), "--batch", str(args.batch), "--chunk",
               str(args.chunk), "--pad", str(args.pad), "--device", args.device]
        cmd += ["--model", args.model] if args.model else []
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"error: the prefill at {context} tokens failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            sys.exit(1)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{context:6d} × {args.batch}: prefill peak {r['prefill_peak_bytes'] / 1e9:.2f} GB above "
              f"{r['before_bytes'] / 1e9:.2f} GB, {r['prefill_s']:.0f} s", flush=True)
    if args.output:
        meta = {"command": " ".join(["python", *sys.argv]), "device": args.device if args.device == "cpu" else
                torch.cuda.get_device_name(), "torch": torch.__version__,
                "model": args.model or "SmolLM2-135M architecture, random weights"}
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
