"""Our Triton GDN vs flash-linear-attention's chunk_gated_delta_rule vs torch SDPA, same run.

    python scripts/bench_kernels.py --output results/bench_kernels.json
    python scripts/bench_kernels.py --op linear --output results/bench_kernels_linear.json
    python scripts/bench_kernels.py --op kda --output results/bench_kernels_kda.json
    python scripts/bench_kernels.py --op deltanet --output results/bench_kernels_deltanet.json

``--op linear`` times the ``linear`` (VaLA) target's operator instead (``linearize.ops.linear_attention``,
decayed linear attention with a write weight, here 1) against fla's ``chunk_simple_gla``, the same
recurrence ``h_t = exp(g_t) h_{t−1} + k_t v_tᵀ`` with a scalar log-decay per head.
``--op kda`` times the gated delta rule with a log-decay per key channel (the ``kda`` target,
``gated_delta_rule`` with ``g [B, T, H, K]`` on ``ops/triton/kda_fwd.py``/``kda_bwd.py``) against fla's
``chunk_kda``, the same recurrence ``h_t = (I − β_t k_t k_tᵀ) Diag(exp(g_t)) h_{t−1} + β_t k_t v_tᵀ``.
``--op deltanet`` times the delta rule without a decay (the ``deltanet`` target: ``gated_delta_rule`` with
``g=None``, the GDN kernels compiled without their decay) against fla's ``chunk_delta_rule``.

Median ms (triton.testing.do_bench) of forward and forward+backward, and peak memory of
forward+backward, at SPEC §7's standard shapes (bf16, H=16, K=V=128) and at GQA shapes of real
teachers (ours GQA-native vs ours and fla on K/V repeated to every query head). fla's gated
backward refuses to run on Triton 3.4–3.7.0 on Hopper (fla #640); the guard is switched off here
to time it, so its backward numbers on such a setup are timings of a possibly wrong result.
Also prints the forward's memory-traffic floor (read q, k, v, write o) from a measured copy bandwidth.
Every forward also gets its host time (``*_fwd_host_ms``, Python enqueueing one call): where it reaches
the forward's time, that row measures the host, not the kernels (small GQA shapes); ``--cudagraph`` adds
the forward's time replayed from a CUDA graph, without the host.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.ops import gated_delta_rule  # noqa: E402
from linearize.ops.linear import linear_attention  # noqa: E402
from linearize.ops.triton import function, linear_bwd, linear_fwd  # noqa: E402

try:
    from linearize.ops.triton import linear_fused
except ImportError:  # a tree before the one-pass forward (scripts/ab.sh)
    linear_fused = None


def load_fla(op: str = "gdn"):
    try:
        import fla.ops.common.chunk_o as chunk_o
        if op == "linear":
            from fla.ops.simple_gla import chunk_simple_gla as fn
        elif op == "kda":
            from fla.ops.kda import chunk_kda as fn
        elif op == "deltanet":
            from fla.ops.delta_rule import chunk_delta_rule as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
    except Exception as e:  # not installed / fails to import
        print(f"flash-linear-attention not available: {e}")
        return None, False
    guard = getattr(chunk_o, "TRITON_ABOVE_3_7_1", True) is False
    chunk_o.TRITON_ABOVE_3_7_1 = True  # disable fla's Hopper/Triton<3.7.1 guard on the gated backward
    return fn, guard


def operators(op: str, K: int):
    """``(ours, fla_call)`` for the operator timed: each takes (q, k, v, g, beta) (k, v, g, beta already
    repeated to the query heads for fla); the linear operator ignores beta (a write weight of 1). For kda, g is
    per key channel ``[B, T, H, K]`` (:func:`inputs`), so the same calls take the KDA kernels."""
    if op == "linear":
        def ours(q, k, v, g, beta):
            return linear_attention(q, k, v, g, torch.ones_like(g), scale=K**-0.5, backend="triton")[0]

        def fla_call(fla, q, k, v, g, beta):
            return fla(q, k, v, g, scale=K**-0.5)[0]
        return ours, fla_call

    def ours(q, k, v, g, beta):  # deltanet: no decay (g=None), the kernels read no g and take no exp of it
        return gated_delta_rule(q, k, v, None if op == "deltanet" else g, beta, scale=K**-0.5, backend="triton")[0]

    def fla_call(fla, q, k, v, g, beta):
        if op == "deltanet":  # no decay argument: g is the zero the ours call gets
            return fla(q, k, v, beta, scale=K**-0.5)[0]
        return fla(q, k, v, g, beta, scale=K**-0.5)[0]
    return ours, fla_call


NOTES = {  # what "ours backward" is, per operator (as the library's defaults set it)
    "gdn": "ours backward = Triton kernels (linearize/ops/triton/chunk_bwd.py): T = (I+A)^-1 kept from the forward, "
           "and with gdn_keep_forward the forward's other intermediates too (else recomputed)",
    "linear": "ours backward = Triton kernels (linearize/ops/triton/linear_bwd.py): the chunk states recomputed",
    "deltanet": "ours = the GDN kernels without a decay (g=None: no g read, no exp of it, no g gradient); "
                "fla = chunk_delta_rule",
    "kda": "ours backward = Triton kernels (linearize/ops/triton/kda_bwd.py): the forward's T and in-chunk scores P "
           "kept, and with kda_bwd.KEEP_FORWARD (on) its W, K~, G_C, scale*gamma*q, gamma*k, chunk states and Delta",
}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


DECAYS = ("uniform", "logsigmoid", "taylor")


def log_decays(B, T, H, K, per_channel, decays, device):
    """The log-decays g, (B, T, H) or (B, T, H, K) float32: ``uniform`` in (−0.1, 0); ``logsigmoid`` of a standard
    normal (as flash-linear-attention's own benchmarks draw them: −0.81 a step on average, far stronger); ``taylor``
    the converted block's at initialization, log(1 − 1/t) at position t (0 at t = 1), the same in every head and
    channel."""
    shape = (B, T, H, *((K,) if per_channel else ()))
    if decays == "logsigmoid":
        return F.logsigmoid(torch.randn(shape, device=device))
    if decays == "taylor":
        t = torch.arange(1, T + 1, device=device, dtype=torch.float32)
        g = torch.where(t > 1, torch.log1p(-1 / t), 0.0)
        return g.view(1, T, *([1] * (len(shape) - 2))).expand(shape).contiguous()
    return -torch.rand(shape, device=device) * 0.1


def add_operator_options(p) -> None:
    """The inputs' log-decays, the kda operator's switches (``kda_fwd``, ``tiles``) and the linear one's
    segments (``linear_fwd``), here and in tune_launches.py: each sets its path for a whole run
    (:func:`apply_operator_options`)."""
    p.add_argument("--decays", choices=DECAYS, default="uniform",
                   help="the log-decays drawn (log_decays): uniform in (−0.1, 0), fla's logsigmoid of a normal, or the "
                        "converted block's Taylor init log(1 − 1/t)")
    p.add_argument("--kda-sub-chunk-steps", action="store_true",
                   help="kda: the pairs inside the sub-chunks row by row, not as dots through anchored offsets "
                        "(ops/triton/kda_fwd.py, SUB_CHUNK_DOTS off)")
    p.add_argument("--kda-no-chunk-dots", action="store_true",
                   help="kda: the sub-chunk dots alone, not every pair of a chunk as one dot where the chunk's span "
                        "allows (ops/triton/kda_fwd.py, CHUNK_DOTS off)")
    p.add_argument("--kda-flush-exp", action="store_true",
                   help="kda: each decay's exp as one ex2 with denormals flushed (ops/triton/tiles.py, FLUSH_EXP)")
    p.add_argument("--gdn-keep-forward", action=argparse.BooleanOptionalAction, default=None,
                   help="gdn, deltanet: the forward's W, states and Δ kept for the backward, or computed again there "
                        "(ops/triton/function.py, KEEP_FORWARD; default as set there)")
    p.add_argument("--linear-segment", type=int, default=None, metavar="E",
                   help="linear: chunks per segment where a state chain is cut (ops/triton/linear_fwd.py, SEGMENT)")
    p.add_argument("--linear-segment-from", type=int, default=None, metavar="N",
                   help="linear: cut a chain from N chunks of the longest sequence on (linear_fwd.SEGMENT_FROM)")
    p.add_argument("--linear-one-pass", action=argparse.BooleanOptionalAction, default=None,
                   help="linear: 16-bit forwards in one pass, no state stored per chunk, or in two stages "
                        "(ops/triton/linear_fused.py, ONE_PASS; default as set there)")
    p.add_argument("--linear-fused-segment", type=int, default=None, metavar="E",
                   help="linear: chunks per segment where the one pass cuts its chains (linear_fused.SEGMENT; 0: never)")
    p.add_argument("--linear-dv-in-dq", action=argparse.BooleanOptionalAction, default=None,
                   help="linear: dv made in the dq/dk pass where linear_bwd.dv_in_dqkwg's rule allows "
                        "(ops/triton/linear_bwd.py, DV_IN_DQ; default as set there)")


def apply_operator_options(args) -> None:
    """Sets the switches of :func:`add_operator_options` before the first launch (the kernels read them as they
    compile; Triton refuses a global that changed under a compiled kernel)."""
    import triton.language as tl

    from linearize.ops.triton import kda_fwd, tiles

    if args.kda_sub_chunk_steps:
        kda_fwd.SUB_CHUNK_DOTS = False
    if args.kda_no_chunk_dots:
        kda_fwd.CHUNK_DOTS = False
    if args.kda_flush_exp:
        tiles.FLUSH_EXP = tl.constexpr(True)
    if args.gdn_keep_forward is not None:
        if not hasattr(function, "KEEP_FORWARD"):  # an older tree (scripts/ab.sh): the switch is not there
            print("error: --gdn-keep-forward: this tree's linearize/ops/triton/function.py has no KEEP_FORWARD; "
                  "run it without the flag", file=sys.stderr)
            sys.exit(2)
        function.KEEP_FORWARD = args.gdn_keep_forward
    if args.linear_segment is not None:
        linear_fwd.SEGMENT = args.linear_segment
    if args.linear_segment_from is not None:
        linear_fwd.SEGMENT_FROM = args.linear_segment_from
    if args.linear_one_pass is not None or args.linear_fused_segment is not None or args.linear_dv_in_dq is not None:
        if linear_fused is None:
            print("error: --linear-one-pass, --linear-fused-segment, --linear-dv-in-dq: this tree has no "
                  "linearize/ops/triton/linear_fused.py; run it without the flags", file=sys.stderr)
            sys.exit(2)
        if args.linear_one_pass is not None:
            linear_fused.ONE_PASS = args.linear_one_pass
        if args.linear_fused_segment is not None:
            linear_fused.SEGMENT = args.linear_fused_segment
        if args.linear_dv_in_dq is not None:
            linear_bwd.DV_IN_DQ = args.linear_dv_in_dq


def inputs(B, T, HQ, H, K, V, dtype=torch.bfloat16, per_channel=False, device="cuda", decay=True, decays="uniform"):
    """Random q, k (unit), v, log-decays (:func:`log_decays`) — per head, or per key channel (``per_channel``:
    kda) — and β, all requiring gradients; without ``decay`` (deltanet) g is zero and needs no gradient."""
    q = torch.randn(B, T, HQ, K, device=device, dtype=dtype).requires_grad_()
    k = F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype).requires_grad_()
    v = torch.randn(B, T, H, V, device=device, dtype=dtype).requires_grad_()
    g = log_decays(B, T, H, K, per_channel, decays, device).requires_grad_(decay)
    if not decay:
        g = torch.zeros_like(g)
    beta = torch.rand(B, T, H, device=device, dtype=dtype).requires_grad_()
    return q, k, v, g, beta


def fwd_bwd(run, tensors):
    def f():
        o = run()
        o.backward(torch.ones_like(o))
        for t in tensors:
            t.grad = None
    return f


def host_ms(fn, n=20):
    """Host milliseconds to enqueue one call of fn (no synchronization between the n calls): where this
    reaches the call's measured time, the GPU waited on Python and the timing is the host's. A fn that
    synchronizes inside itself counts its GPU time here too."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e3


def graph_ms(fn):
    """Median ms of fn replayed from a CUDA graph (``--cudagraph``): the GPU's time without the launches'
    host cost; an error string where fn cannot be captured."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001  (a path with a host sync, for one)
        return f"{type(e).__name__}: {str(e)[:160]}"


def measure(name, run, tensors, graph=False):
    with torch.no_grad():
        fwd = bench(run)
        out = {f"{name}_fwd_ms": fwd, f"{name}_fwd_host_ms": host_ms(run)}
        if graph:
            out[f"{name}_fwd_graph_ms"] = graph_ms(run)
    fb = fwd_bwd(run, tensors)
    return {**out, f"{name}_fwdbwd_ms": bench(fb), f"{name}_peak_mib": peak(fb)}


def repeat_kv(G: int):
    """How k, v, g and β reach fla (and the ``ours_repkv`` rows): each KV head repeated to its G query heads, a
    copy made inside the timed call (fla's operators take a key head per query head: its user pays the copy
    every call); at G = 1 the tensors themselves, since ``repeat_interleave(x, 1)`` still copies x and would
    put a copy of k, v and g on fla's time."""
    if G == 1:
        return lambda x: x
    return lambda x: x.repeat_interleave(G, dim=2)


def bench_shape(kind, B, T, HQ, H, K, V, fla, bw, graph=False, op="gdn", decays="uniform"):
    G = HQ // H
    q, k, v, g, beta = inputs(B, T, HQ, H, K, V, per_channel=op == "kda", decay=op != "deltanet", decays=decays)
    ts = tuple(t for t in (q, k, v, g, beta) if t.requires_grad)
    rep = repeat_kv(G)
    ours, fla_call = operators(op, K)
    row = {"shape": kind, "op": op, "B": B, "T": T, "q_heads": HQ, "kv_heads": H, "K": K, "V": V}
    row.update(measure("ours", lambda: ours(q, k, v, g, beta), ts, graph))
    if G > 1:
        row.update(measure("ours_repkv", lambda: ours(q, rep(k), rep(v), rep(g), rep(beta)), ts, graph))
    if fla is not None:
        row.update(measure("fla", lambda: fla_call(fla, q, rep(k), rep(v), rep(g), rep(beta)), ts, graph))
    qs, ks, vs = (x.transpose(1, 2) for x in (q, k, v))
    row.update(measure("sdpa", lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=G > 1), ts,
                       graph))
    if kind == "std" and (B, T) == (2, 8192):
        floor_ms = 2 * (2 * q.numel() + k.numel() + v.numel()) / bw * 1e3  # bf16: read q, k, v; write o
        row["fwd_floor_ms"] = floor_ms
        row["ours_fwd_over_floor"] = row["ours_fwd_ms"] / floor_ms
    for key in ("fla", "sdpa", "ours_repkv"):
        if f"{key}_fwd_ms" in row:
            row[f"speedup_fwd_vs_{key}"] = row[f"{key}_fwd_ms"] / row["ours_fwd_ms"]
            row[f"speedup_fwdbwd_vs_{key}"] = row[f"{key}_fwdbwd_ms"] / row["ours_fwdbwd_ms"]
    return row


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench(lambda: dst.copy_(src)) * 1e-3)


def fmt(r, key, digits=2):
    """A number of row r to the table; "–" where it is missing or is an error string (a failed graph capture)."""
    return f"{r[key]:.{digits}f}" if isinstance(r.get(key), (int, float)) else "–"


def markdown(rows) -> str:
    """The table of rows; the CUDA-graph columns (ours and fla, side by side) only where a row has them."""
    ops = len({r.get("op") for r in rows}) > 1  # rows of several operators (a merged file): name each row's
    graph = any("ours_fwd_graph_ms" in r for r in rows)
    cols = [("ours fwd", "ours_fwd_ms")] + [("ours fwd (graph)", "ours_fwd_graph_ms")] * graph + \
        [("fla fwd", "fla_fwd_ms")] + [("fla fwd (graph)", "fla_fwd_graph_ms")] * graph + \
        [("SDPA fwd", "sdpa_fwd_ms"), ("ours f+b", "ours_fwdbwd_ms"), ("fla f+b", "fla_fwdbwd_ms"),
         ("SDPA f+b", "sdpa_fwdbwd_ms")]
    head = "| shape | B×T | heads q/kv | " + " | ".join(c for c, _ in cols) + " | fwd vs fla | f+b vs fla | peak ours/fla MiB |"
    lines = [("| op " if ops else "") + head, "|" + "---|" * (len(cols) + 6 + ops)]
    for r in rows:
        lines.append((f"| {r['op']} " if ops else "") + f"| {r['shape']} | {r['B']}×{r['T']} | {r['q_heads']}/{r['kv_heads']} | "
                     + " | ".join(fmt(r, key) for _, key in cols)
                     + f" | {fmt(r, 'speedup_fwd_vs_fla')}× | {fmt(r, 'speedup_fwdbwd_vs_fla')}× | "
                     f"{fmt(r, 'ours_peak_mib', 0)}/{fmt(r, 'fla_peak_mib', 0)} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--markdown", type=Path, default=None)
    p.add_argument("--render", type=Path, nargs="+", default=None,
                   help="only turn JSONs this script wrote into one markdown table (no GPU needed); with --output, "
                        "their rows merged into one JSON (each run's machine and command kept under 'runs')")
    p.add_argument("--no-fla", action="store_true", help="skip flash-linear-attention (faster: for A/B runs of our kernels)")
    p.add_argument("--only", default=None, help="comma-separated shape names/B×T to run, e.g. 8x2048,smollm2")
    p.add_argument("--op", choices=("gdn", "linear", "kda", "deltanet"), default="gdn",
                   help="the operator timed: the gated delta rule, the linear (VaLA) target's decayed linear attention, "
                        "the gated delta rule with a decay per key channel (kda), or the delta rule (deltanet, g = 0)")
    p.add_argument("--cudagraph", action="store_true",
                   help="also time each forward replayed from a CUDA graph (*_fwd_graph_ms: no host launch cost)")
    add_operator_options(p)
    args = p.parse_args()
    apply_operator_options(args)
    if args.render:
        runs = [json.loads(path.read_text()) for path in args.render]
        rows = [row for run in runs for row in run["rows"]]
        md = markdown(rows)
        print(md)
        if args.output:
            args.output.write_text(json.dumps({"runs": [{k: v for k, v in run.items() if k != "rows"} for run in runs],
                                               "rows": rows}, indent=1) + "\n")
        if args.markdown:
            args.markdown.write_text(md + "\n")
        return
    fla, guard = (None, False) if args.no_fla else load_fla(args.op)
    rows = []

    # copy bandwidth for the memory-traffic floor
    bw = copy_bandwidth()

    std = lambda B, T: ("std", B, T, 16, 16, 128, 128)  # noqa: E731
    # the standard shapes first (SPEC §7), then the GQA shapes: a run cut short keeps the former
    shapes = [std(8, 2048), std(2, 8192), std(4, 4096), std(1, 16384), std(1, 32768),
              ("smollm2", 4, 4096, 9, 3, 64, 64), ("llama3-8b", 2, 4096, 32, 8, 128, 128)]
    meta = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "copy_bandwidth_Bps": bw, "fla_guard_disabled": guard,
            "note": NOTES[args.op],
            "kda_sub_chunk_dots": not args.kda_sub_chunk_steps, "kda_flush_exp": args.kda_flush_exp,
            "kda_chunk_dots": not args.kda_no_chunk_dots, "decays": args.decays,
            "linear_segment": linear_fwd.SEGMENT, "linear_segment_from": linear_fwd.SEGMENT_FROM,
            "linear_one_pass": getattr(linear_fused, "ONE_PASS", False),
            "linear_dv_in_dq": getattr(linear_bwd, "DV_IN_DQ", False),
            "linear_fused_segment": getattr(linear_fused, "SEGMENT", None),
            "gdn_keep_forward": getattr(function, "KEEP_FORWARD", None),  # None: a tree before the switch
            # earlier files lack this key: their fla timings at G = 1 included copies of k, v, g and β
            "fla_inputs_copied_at_g1": False}
    if args.only:
        keep = set(args.only.split(","))
        shapes = [sh for sh in shapes if sh[0] in keep or f"{sh[1]}x{sh[2]}" in keep]
    for shape in shapes:
        rows.append(bench_shape(*shape, fla=fla, bw=bw, graph=args.cudagraph, op=args.op, decays=args.decays))
        print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
        if args.output:  # after every shape, so a run cut short keeps what it measured
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps({**meta, "rows": rows}, indent=1))

    md = markdown(rows)
    print(md)
    fla_line = "fla not run" if fla is None else f"fla guard on gated backward was {'on (disabled here)' if guard else 'off'}"
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {fla_line}")
    if args.markdown:
        args.markdown.write_text(md + "\n")


if __name__ == "__main__":
    main()
