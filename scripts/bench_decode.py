"""Decode speed and memory of a converted model against its teacher, each the way users run it.

    python scripts/bench_decode.py --model smollm2.gguf --contexts 2048 8192 32768 65536 --batches 1 16 64 \\
        --output results/bench_decode.json --plot results/bench_decode.png

Per (context, batch), on the same random prompts:

- ``teacher``: ``teacher.generate()`` with transformers' default cache (what users run);
- ``teacher_static``: ``generate(cache_implementation="static")``, which transformers compiles with
  ``torch.compile`` (its fastest path; compiled on a first, untimed call);
- ``converted``: :class:`linearize.decoding.Decoder` (the step of the whole model as one CUDA graph);
- ``converted_eager``: the same decoder stepping eagerly (``graph=False``), and ``converted_generate``:
  ``model.generate()`` on the converted model, with ``--eager``;
- ``converted_unfused_modules``: the graph decoder on the same weights with transformers' own norms and MLPs
  instead of the converted model's fused kernels (:mod:`linearize.modules.norm`, ``.swiglu``), with
  ``--fused-modules``.

Each path generates ``--steps`` tokens and, separately, one token. The decode cost per token is clocked
inside the decode loop: for ``generate()`` a stopping criterion that synchronizes and reads the clock after
every new token (``generate`` synchronizes there anyway, to check for the end), for the decoder its own
``timing`` (decode loop less the graph's capture), both over the ``steps − 1`` steps after the first token; so
the prefill's run-to-run noise stays out of it. ``ms_per_token_diff`` is the older estimate,
``(t_steps − t_1) / (steps − 1)`` of the wall times, as a cross-check. The time to first token is ``t_1``
(prefill included). Also reported: the decoding cache's bytes and peak memory. Every run forces ``--steps``
new tokens (no end of text).
``--check-prompts N`` also checks that the graph path's greedy continuations equal the eager path's on
N prompts, token for token. Without ``--model``: SmolLM2-135M's architecture with random weights (speed
does not depend on the weights). ``--device cpu``: float32, the teacher's default path against the
converted model's (no graph, no peak memory; ``--compile`` adds its steps compiled, :mod:`linearize.compiling`).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import linearize  # noqa: E402
from linearize.decoding import Decoder  # noqa: E402
from linearize.layers.options import GDNOptions  # noqa: E402

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


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> tuple[float, float | None]:
    """Wall seconds of ``fn()`` and what it returns (its decode seconds a token, or None)."""
    sync()
    t0 = time.perf_counter()
    per = fn()
    sync()
    return time.perf_counter() - t0, per


class StepClock:
    """A ``generate()`` stopping criterion that never stops: the clock after every new token, synchronized."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        sync()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def per_token(self) -> float | None:
        t = self.times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def cache_bytes(model, ids, chunk: int | None = None) -> int:
    """Bytes of the decoding cache after a prefill of ``ids`` (KV cache or GDN states), fed ``chunk`` tokens at
    a time as the decoder feeds them (None: at once)."""
    from transformers import DynamicCache

    from linearize.compat import cache_kwargs

    cache = DynamicCache(config=model.config)
    step = chunk or ids.shape[1]
    with torch.no_grad():
        for i in range(0, ids.shape[1], step):
            model(ids[:, i:i + step], **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
    total = 0
    for layer in cache.layers:
        if hasattr(layer, "nbytes"):
            total += layer.nbytes()
        elif getattr(layer, "keys", None) is not None:
            total += layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
    del cache
    return total


def measure(run, steps: int, repeats: int) -> dict:
    """``run(n)`` generates n tokens and returns its decode seconds a token (clocked inside the loop). Times
    ``run(1)`` and ``run(steps)`` ``repeats`` times each after one untimed warm-up of each: medians of the
    clocked cost and of the wall times. ``peak_bytes``: the allocator's peak over the timed runs;
    ``prefill_peak_bytes``: over one more ``run(1)`` alone (the prompt's prefill and one token)."""
    cuda = torch.cuda.is_available()
    run(1), run(steps)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    pairs = [(timed(lambda: run(1)), timed(lambda: run(steps))) for _ in range(repeats)]
    t1, tn = statistics.median(a[0] for a, _ in pairs), statistics.median(b[0] for _, b in pairs)
    clocked = [b[1] for _, b in pairs if b[1] is not None]
    diff = (tn - t1) / (steps - 1)
    per = statistics.median(clocked) if clocked else diff
    peak = prefill_peak = None
    if cuda:
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run(1)
        prefill_peak = torch.cuda.max_memory_allocated()
    return {"ttft_s": t1, "ms_per_token": per * 1e3, "ms_per_token_diff": diff * 1e3, "total_s": tn,
            "peak_bytes": peak, "prefill_peak_bytes": prefill_peak}


def paths(teacher, converted, ids, eager: bool, cpu: bool = False, compiled: bool = False, chunk: int | None = None,
          unfused=None):
    from transformers import StoppingCriteriaList

    no_eos = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def hf(model, **kw):
        def run(n):
            clock = StepClock()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           stopping_criteria=StoppingCriteriaList([clock]), **no_eos, **kw)
            return clock.per_token()
        return run

    def dec(graph, compile=False, model=converted):
        d = Decoder(model, graph=graph, compile=compile, prefill_chunk=chunk)

        def run(n):
            d.generate(ids, max_new_tokens=n, eos_token_id=[])
            t = d.timing
            return (t.decode_s - t.capture_s) / t.steps if t.steps else None
        return run

    if cpu:  # what runs on a CPU: the teacher's default path and the converted model's (eager) decoder
        return {"teacher": hf(teacher), "converted": dec(False), **({"converted_compiled": dec(False, True)} if compiled else {})}
    out = {"teacher": hf(teacher), "teacher_static": hf(teacher, cache_implementation="static"), "converted": dec(True)}
    if compiled:
        out["converted_compiled"] = dec(True, compile=True)
    if eager:
        out.update(converted_eager=dec(False), converted_generate=hf(converted))
    if unfused is not None:  # the same weights with transformers' norms and MLPs (no fused modules)
        out["converted_unfused_modules"] = dec(True, model=unfused)
    return out


def check_prompts(converted, n: int, vocab: int, new: int = 32) -> dict:
    """Greedy continuations of the graph path against the eager path, one batch of n random prompts."""
    g = torch.Generator(device="cuda").manual_seed(2)
    lengths = torch.randint(16, 256, (n,), generator=g, device="cuda")
    T = int(lengths.max())
    ids = torch.randint(1, vocab, (n, T), generator=g, device="cuda")
    mask = (torch.arange(T, device="cuda")[None] >= T - lengths[:, None]).long()
    ids = ids * mask
    eager = Decoder(converted, graph=False).generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[])
    graph = Decoder(converted, graph=True).generate(ids, attention_mask=mask, max_new_tokens=new, eos_token_id=[])
    same = (graph[:, T:] == eager[:, T:]).all(1)
    return {"prompts": n, "new_tokens": new, "equal_rows": int(same.sum())}


def plot(rows: list[dict], batch: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in ("teacher", "teacher_static", "converted", "converted_compiled"):
        pts = [(r["context"], r[name]["tokens_per_s"]) for r in rows if r["batch"] == batch and "tokens_per_s" in r.get(name, {})]
        if pts:
            ax.plot(*zip(*pts), "o-", label=name)
    ax.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="decode tokens/s", title=f"batch {batch}")
    contexts = sorted({r["context"] for r in rows if r["batch"] == batch})
    ax.set_xticks(contexts, [f"{c // 1024}K" if c >= 1024 else str(c) for c in contexts])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a real checkpoint (default: SmolLM2-135M architecture, random weights)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed pairs of runs per path (their medians)")
    p.add_argument("--window", type=int, default=64, help="the converted block's window (0: the pure block)")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--sparse-cache", type=int, default=0, help="older tokens per KV head the block keeps exactly")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the converted model's prompt fed this many tokens at a time (its prefill's peak memory)")
    p.add_argument("--keep-softmax", default=None,
                   help="a hybrid: softmax layers kept, as `linearize convert --keep-softmax` takes them (a count, "
                        "'8:induction', or indices '3,7')")
    p.add_argument("--eager", action="store_true", help="also time the converted model's eager paths")
    p.add_argument("--compile", action="store_true",
                   help="also time the graph recorded with each block's norms and MLP compiled (converted_compiled; "
                        "on a CPU: the eager steps compiled)")
    p.add_argument("--fused-modules", action="store_true",
                   help="also the graph decoder on the converted model without its fused norm and MLP kernels "
                        "(converted_unfused_modules), what they give a decode step")
    p.add_argument("--paths", nargs="+", default=None, metavar="NAME",
                   help="time only these paths (teacher, teacher_static, converted, converted_compiled, …)")
    p.add_argument("--check-prompts", type=int, default=0, help="check graph == eager greedy tokens on N prompts")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="tokens/s against context, one PNG per batch size")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        p.exit(2, "error: no CUDA device here; run on a GPU machine, or with --device cpu\n")
    dev = args.device

    teacher = build_teacher(args.model, torch.float32 if cpu else torch.bfloat16).to(dev)
    vocab = teacher.config.vocab_size
    calib = torch.randint(0, vocab, (1, 512), device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    options = GDNOptions(window=args.window, sinks=args.sinks, sparse_cache=args.sparse_cache)
    converted = linearize.convert(copy.deepcopy(teacher), calibration_ids=calib, options=options,
                                  keep_softmax=args.keep_softmax).eval()
    unfused = None
    if args.fused_modules and not cpu:  # (a CPU never takes them)
        from linearize.conversion import unfuse_inference_kernels

        unfused = copy.deepcopy(converted)
        unfuse_inference_kernels(unfused)
    meta = {"command": " ".join(["python", *sys.argv]), "device": "cpu" if cpu else torch.cuda.get_device_name(),
            "torch": torch.__version__, "dtype": ("float32" if cpu else "bfloat16 weights") + ", fp32 GDN state", "model": args.model or "SmolLM2-135M architecture, random weights",
            "block": options.to_dict(), "keep_softmax": args.keep_softmax, "prefill_chunk": args.prefill_chunk, "steps": args.steps, "repeats": args.repeats}
    if args.check_prompts and not cpu:
        meta["graph_equals_eager"] = check_prompts(converted, args.check_prompts, vocab)
        print(json.dumps(meta["graph_equals_eager"]), flush=True)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            ids = torch.randint(1, vocab, (batch, context), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
            row = {"context": context, "batch": batch}
            for name, run in paths(teacher, converted, ids, args.eager, cpu, args.compile, args.prefill_chunk,
                                   unfused).items():
                if args.paths and name not in args.paths:
                    continue
                gc.collect()
                if not cpu:
                    torch.cuda.empty_cache()
                try:
                    with torch.no_grad():
                        r = measure(run, args.steps, args.repeats)
                    r["tokens_per_s"] = batch / (r["ms_per_token"] / 1e3)
                    row[name] = r
                except torch.OutOfMemoryError:
                    row[name] = {"error": "out of memory"}
                except Exception as e:  # one path failing must not hide the others' numbers
                    row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            for name in ("teacher", "converted"):
                with torch.no_grad():
                    try:
                        row.setdefault(name, {})["cache_bytes"] = cache_bytes(teacher if name == "teacher" else converted, ids,
                                                                              args.prefill_chunk)
                    except torch.OutOfMemoryError:
                        pass
            for mine in ("converted", "converted_compiled"):
                c = row.get(mine, {}).get("tokens_per_s")
                for anchor in ("teacher", "teacher_static"):
                    t = row.get(anchor, {}).get("tokens_per_s")
                    if c and t:
                        row[f"{mine}_vs_{anchor}"] = c / t
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.output:  # after every row, so that a run stopped by a time limit keeps what it measured
                args.output.parent.mkdir(parents=True, exist_ok=True)
                args.output.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    if args.output:
        print(f"wrote {args.output}")
    if args.plot:
        for batch in args.batches:
            plot(rows, batch, args.plot.with_name(f"{args.plot.stem}_batch{batch}{args.plot.suffix}"))


if __name__ == "__main__":
    main()
