"""Peak of the tensors alive during each chunk of a converted model's chunked prefill, on any device.

    TRITON_INTERPRET=1 python scripts/chunk_peaks.py --front fused --output results/chunk_peaks_cpu_fused.json
    python scripts/chunk_peaks.py --front composed --output results/chunk_peaks_cpu_composed.json

A model of GDN layers fed its prompt ``--chunk`` tokens at a time should hold one chunk's activations
whatever the chunk's place in the prompt. This script says whether it does, where the allocator's peak
cannot (a CPU): a dispatch mode sees every tensor an operator returns and counts its storage's bytes until
the storage is freed; the loaded weights are not counted. Per chunk: the peak of live bytes, and the
operators that held the most at that peak. ``--front fused`` asks for the fused Triton front
(``GDNOptions(fused_front=True)``; on a CPU under ``TRITON_INTERPRET=1``), which takes the first chunk only
(it starts fresh sequences); ``composed`` keeps every chunk on the PyTorch front. The model: SmolLM2-135M's
shapes, ``--layers`` of them, random weights, the default block (window 64 + 4 sinks + GDN).
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages operators returned that are still alive; their peak, and what held it."""

    def __init__(self, ignore=()):
        super().__init__()
        self.live = {ptr: 0 for ptr in ignore}  # storage pointer -> bytes (0: not counted)
        self.site: dict[int, str] = {}
        self.now = self.peak = 0
        self.at_peak: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (ptr := t.untyped_storage().data_ptr()) and ptr not in self.live:
                n = t.untyped_storage().nbytes()
                self.live[ptr], self.now = n, self.now + n
                ours = [f for f in traceback.extract_stack() if "/linearize/" in f.filename or "transformers" in f.filename]
                where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"
                self.site[ptr] = f"{func} {tuple(t.shape)} {t.dtype} at {where}"
                weakref.finalize(t.untyped_storage(), self._free, ptr)
        if self.now > self.peak:
            self.peak, self.at_peak = self.now, dict(self.live)
        return out

    def _free(self, ptr):
        self.now -= self.live.pop(ptr, 0)
        self.site.pop(ptr, None)

    def take(self, top: int) -> dict:
        """This chunk's peak and its largest holders; the peak starts again from what is alive now."""
        held = Counter()
        for ptr, n in self.at_peak.items():
            if n:
                held[self.site.get(ptr, "?")] += n
        row = {"peak_bytes": self.peak, "alive_after_bytes": self.now,
               "largest_at_peak": [{"bytes": n, "op": k} for k, n in held.most_common(top)]}
        self.peak, self.at_peak = self.now, {}
        return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--front", choices=("fused", "composed"), default="composed")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()

    from bench_decode import SMOLLM2
    from transformers import LlamaConfig, LlamaForCausalLM

    import linearize
    from linearize.decoding import Decoder
    from linearize.layers import GDNOptions

    torch.manual_seed(0)
    # SmolLM2-135M's shapes, fewer layers and a small vocabulary (the LM head reads one position a chunk)
    cfg = LlamaConfig(**{**SMOLLM2, "num_hidden_layers": args.layers, "vocab_size": 1000})
    teacher = LlamaForCausalLM(cfg).eval().to(args.device)
    calib = torch.randint(0, cfg.vocab_size, (1, 256), generator=torch.Generator().manual_seed(1)).to(args.device)
    options = GDNOptions(window=64, sinks=4, fused_front=args.front == "fused")
    model = linearize.convert(teacher, calibration_ids=calib, options=options).eval()
    torch.set_grad_enabled(False)
    ids = torch.randint(1, cfg.vocab_size, (args.batch, args.chunk * args.chunks),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    weights = [t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())]
    mode, rows = LiveBytes(weights), []
    forward = model.forward

    def counted(*a, **k):  # the decoder calls the model once a chunk
        out = forward(*a, **k)
        rows.append({"chunk": len(rows), **mode.take(args.top)})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "largest_at_peak"}), flush=True)
        return out

    model.forward = counted
    with mode:
        Decoder(model, graph=False, prefill_chunk=args.chunk).generate(ids, attention_mask=None, max_new_tokens=1)
    meta = {"command": " ".join(["python", *sys.argv]), "device": args.device, "torch": torch.__version__,
            "front": args.front, "layers": args.layers, "batch": args.batch, "chunk": args.chunk,
            "rows": rows[:args.chunks]}
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(meta, indent=1))
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
