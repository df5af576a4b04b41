"""Correctness of the Triton GDN backend on a CUDA GPU: forward, final state and every gradient
against a float64 reference, on fresh random inputs, with NaN-poisoned outputs.

    python scripts/check_kernels_gpu.py --output results/kernels_gpu_errors.json

The float64 reference is the chunkwise PyTorch operator run in float64 on the GPU (CI checks it
against the recurrent definition to 1e-10); it gets the *same* (rounded) inputs, so the error is
the kernels' own. Tolerances (SPEC §7): fp32 ≤ 1e-5, bf16 ≤ 1e-2, NaN/Inf never.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from linearize.ops import gated_delta_rule  # noqa: E402
from _poison import poisoned_outputs  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """‖a − ref‖ / ‖ref‖ in float64; inf where ``a`` holds a NaN or an Inf."""
    return ((a.double() - ref).norm() / ref.norm()).item() if torch.isfinite(a).all() else math.inf


def make_inputs(B, T, H, G, K, V, dtype, seed, beta_mode, N):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    q = r(B, T, H * G, K)
    k = F.normalize(r(B, T, H, K), dim=-1)  # unit keys, as the Taylor form feeds them
    v = r(B, T, H, V)
    g = -torch.rand(B, T, H, device="cuda", generator=gen) * 0.2
    beta = {"uniform": torch.rand(B, T, H, device="cuda", generator=gen),
            "bound": torch.ones(B, T, H, device="cuda"),  # β at the stable form's bound β_max = 1
            "bound2": 2 * torch.ones(B, T, H, device="cuda")}[beta_mode]  # erase eigenvalue −1
    h0 = r(N, H, K, V) * 0.1
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [h0]


def check(B, T, H, G, K, V, dtype, beta_mode="uniform", cu=None, grads=True, seed=0, v_offset=False):
    """``v_offset``: also the Taylor back fused in the output kernel (a float32 ``[B, T, H, V]`` offset, and
    its gradient ``dv_offset``)."""
    N = B if cu is None else len(cu) - 1
    cu_t = torch.tensor(cu, device="cuda") if cu is not None else None
    inputs = make_inputs(B, T, H, G, K, V, dtype, seed, beta_mode, N)
    if v_offset:
        inputs.append(torch.randn(B, T, H, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 2)))
    scale = K**-0.5
    res = {}
    outs = {}
    for name, dt, backend in (("ref", torch.float64, "torch"), ("ours", dtype, "triton")):
        leaves = [x.detach().to(dt if i < 5 else (torch.float64 if name == "ref" else torch.float32)).clone()
                  .requires_grad_(grads) for i, x in enumerate(inputs)]
        o, ht = gated_delta_rule(*leaves[:5], scale=scale, initial_state=leaves[5], output_final_state=True,
                                 cu_seqlens=cu_t, backend=backend, v_offset=leaves[6] if v_offset else None)
        got = [o.detach(), ht.detach()]
        if grads:
            gen = torch.Generator(device="cuda").manual_seed(seed + 1)
            do = torch.randn(o.shape, device="cuda", generator=gen, dtype=torch.float64)
            dht = torch.randn(ht.shape, device="cuda", generator=gen, dtype=torch.float64)
            ((o.double() * do).sum() + (ht.double() * dht).sum()).backward()
            got += [x.grad for x in leaves]
        outs[name] = got
    for n, a, b in zip(NAMES + ("dv_offset",), outs["ours"], outs["ref"]):
        res[n] = rel_err(a, b)
    worst = max(res.values())
    return {"kind": "operator + v_offset" if v_offset else "operator", "B": B, "T": T, "q_heads": H * G, "kv_heads": H, "K": K, "V": V, "dtype": str(dtype).split(".")[-1],
            "beta": beta_mode, "cu_seqlens": cu, "errors": res, "max_error": worst,
            "tolerance": TOL[dtype], "pass": worst <= TOL[dtype]}


def check_front(B, T, H, K, V, cu=None, seed=0, dtype=torch.float32):
    """The fused Taylor front against the PyTorch front in float64: outputs and gradients. ``dtype``: of k
    and v (bf16 is what a bf16 model feeds it: k̂ and u then come back in bf16, the rest in float32); the
    reference gets the same rounded k and v."""
    from linearize.ops.taylor import taylor_front
    from linearize.ops.triton.front import taylor_front_triton

    gen = torch.Generator(device="cuda").manual_seed(seed)
    k = (torch.randn(B, T, H, K, device="cuda", generator=gen) + 0.3).to(dtype).float()
    v = torch.randn(B, T, H, V, device="cuda", generator=gen).to(dtype).float()
    rho = torch.rand(H, device="cuda", generator=gen) + 0.5
    f = 2 * torch.sigmoid(torch.randn(B, T, H, device="cuda", generator=gen))
    cu_t = torch.tensor(cu, device="cuda") if cu is not None else None
    got = {}
    for name, dt in (("ref", torch.float64), ("ours", torch.float32)):
        leaves = [x.to(dt if i > 1 or name == "ref" else dtype).clone().requires_grad_(True)
                  for i, x in enumerate((k, v, rho, f))]
        if name == "ref":
            fr = taylor_front(torch.zeros_like(leaves[0]), *leaves[:2], rho=leaves[2], beta_factor=leaves[3], cu_seqlens=cu_t)
            outs = (fr.k, fr.v, fr.g, fr.beta, fr.v_mean)
        else:
            outs = taylor_front_triton(*leaves[:3], 1.0, beta_factor=leaves[3], cu_seqlens=cu_t)
        g2 = torch.Generator(device="cuda").manual_seed(seed + 1)
        sum((o.double() * torch.randn(o.shape, device="cuda", generator=g2, dtype=torch.float64)).sum() for o in outs).backward()
        got[name] = [o.detach() for o in outs] + [x.grad for x in leaves]
    names = ("khat", "u", "g", "beta", "vbar", "dk", "dv", "drho", "dbeta_factor")
    res = {n: rel_err(a, b) for n, a, b in zip(names, got["ours"], got["ref"])}
    worst = max(res.values())
    tol = TOL[dtype]
    return {"kind": "taylor_front", "B": B, "T": T, "q_heads": H, "kv_heads": H, "K": K, "V": V,
            "dtype": str(dtype).split(".")[-1], "beta": "front", "cu_seqlens": cu, "errors": res, "max_error": worst,
            "tolerance": tol, "pass": worst <= tol}


def check_rope(B, T, H, D, dtype, seed=0):
    """RoPE in one Triton pass (linearize/ops/triton/rope.py) against transformers' apply_rotary_pos_emb in
    float64 on the same rounded x, cos, sin: output and the gradient of x."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from linearize.modules.rope import apply_rope_triton

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, T, H, D, device="cuda", generator=gen).to(dtype)
    ang = torch.arange(T, device="cuda")[:, None] * 10000.0 ** (-torch.arange(0, D, 2, device="cuda") / D)
    cos, sin = (f(torch.cat([ang, ang], -1))[None].expand(B, T, D).to(dtype) for f in (torch.cos, torch.sin))
    dy = torch.randn(B, T, H, D, device="cuda", generator=gen).to(dtype)
    xr = x.double().requires_grad_(True)
    want, _ = apply_rotary_pos_emb(xr, xr, cos.double(), sin.double(), unsqueeze_dim=2)
    want.backward(dy.double())
    xt = x.clone().requires_grad_(True)
    got = apply_rope_triton(xt, cos, sin)
    got.backward(dy)
    res = {"y": rel_err(got, want), "dx": rel_err(xt.grad, xr.grad)}
    worst, tol = max(res.values()), TOL[dtype]
    return {"kind": "rope", "B": B, "T": T, "q_heads": H, "kv_heads": H, "K": D, "V": D,
            "dtype": str(dtype).split(".")[-1], "beta": "rope", "cu_seqlens": None, "errors": res, "max_error": worst, "tolerance": tol, "pass": worst <= tol}


def check_rowsq(B, T, L, D, dtype, seed=0):
    """The align loss's sums (linearize/ops/triton/rowsq.py) on a (B, T, L, D) output against float64."""
    from linearize.modules.rowsq import row_squared_errors

    gen = torch.Generator(device="cuda").manual_seed(seed)
    o = torch.randn(B, T, L, D, device="cuda", generator=gen).to(dtype)
    refs = [torch.randn(B, T, D, device="cuda", generator=gen).to(dtype) for _ in range(L)]
    w = torch.randn(L, B, device="cuda", generator=gen, dtype=torch.float64)
    o_ = o.clone().requires_grad_(True)
    sse, rsq = row_squared_errors(o_, refs)
    (sse.double() * w).sum().backward()
    o64 = o.double().requires_grad_(True)
    r64 = torch.stack([r.double() for r in refs], 2)
    want = (o64 - r64).pow(2).sum((1, 3)).T
    (want * w).sum().backward()
    res = {"sse": rel_err(sse, want.detach()), "ref_sq": rel_err(rsq, r64.pow(2).sum((1, 3)).T), "do": rel_err(o_.grad, o64.grad)}
    worst, tol = max(res.values()), TOL[dtype]
    return {"kind": "rowsq", "B": B, "T": T, "q_heads": L, "kv_heads": L, "K": D, "V": D,
            "dtype": str(dtype).split(".")[-1], "beta": "rowsq", "cu_seqlens": None, "errors": res, "max_error": worst,
            "tolerance": tol, "pass": worst <= tol}


def check_kl(R, V, T, ce_w, seed=0):
    """The fused distillation loss (linearize/ops/triton/kl.py) on bf16 logits against float64 autograd."""
    from linearize.modules.kl import kl_loss

    gen = torch.Generator(device="cuda").manual_seed(seed)
    s = (torch.randn(R, V, device="cuda", generator=gen) * 3).bfloat16()
    t = (torch.randn(R, V, device="cuda", generator=gen) * 3).bfloat16()
    y = torch.randint(0, V, (R,), device="cuda", generator=gen)
    y[::7] = -100
    s64 = s.double().requires_grad_(True)
    lt, ls = (t.double() / T).log_softmax(-1), (s64 / T).log_softmax(-1)
    ref = (lt.exp() * (lt - ls)).sum() * T * T / R
    if ce_w is not None:
        ref = ref + ce_w * F.cross_entropy(s64, y, ignore_index=-100, reduction="sum")
    ref.backward()
    s_ = s.clone().requires_grad_(True)
    loss = kl_loss(s_, t, y, temperature=T, kl_weight=1 / R, ce_weight=ce_w, backend="triton")
    loss.backward()
    res = {"loss": abs(loss.item() - ref.item()) / abs(ref.item()),
           "grad": ((s_.grad.double() - s64.grad).norm() / s64.grad.norm()).item()}
    worst = max(res.values())
    return {"kind": "kl_loss", "B": R, "T": V, "q_heads": 0, "kv_heads": 0, "K": 0, "V": V, "dtype": "bfloat16",
            "beta": f"T={T}", "ce_weight": ce_w, "cu_seqlens": None, "errors": res, "max_error": worst, "tolerance": 1e-2,
            "pass": worst <= 1e-2}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--quick", action="store_true", help="three cases only (bf16 2x8192, fp32 GQA, fp32 packed)")
    p.add_argument("--front", action="store_true", help="the fused Taylor front only (ops/triton/front.py)")
    p.add_argument("--rope", action="store_true", help="the fused RoPE only (ops/triton/rope.py)")
    p.add_argument("--kl", action="store_true", help="the fused distillation loss only (ops/triton/kl.py)")
    p.add_argument("--align", action="store_true", help="the align stage's fused pieces only: the operator with "
                   "v_offset (the Taylor back) at the batched align shape, and the loss sums (ops/triton/rowsq.py)")
    p.add_argument("--cases", default=None, help="comma-separated indices into the full case list (0-17), "
                   "to split the check over several calls")
    args = p.parse_args()
    cases = []
    std = [(8, 2048), (4, 4096), (2, 8192), (1, 16384), (1, 32768)]
    for B, T in std:
        cases.append(dict(B=B, T=T, H=16, G=1, K=128, V=128, dtype=torch.bfloat16, grads=T <= 8192))
    for dtype in (torch.bfloat16, torch.float32):
        cases.append(dict(B=2, T=4096, H=3, G=3, K=64, V=64, dtype=dtype))  # SmolLM2
        cases.append(dict(B=1, T=4096, H=8, G=4, K=128, V=128, dtype=dtype))  # Llama-3-8B
        cases.append(dict(B=1, T=3000, H=1, G=4, K=256, V=256, dtype=dtype))  # Gemma 3 270M
        cases.append(dict(B=1, T=5000, H=4, G=2, K=64, V=64, dtype=dtype, cu=[0, 1, 63, 64, 65, 2000, 4999, 5000]))
        cases.append(dict(B=2, T=1000, H=4, G=1, K=128, V=128, dtype=dtype, beta_mode="bound"))
        cases.append(dict(B=2, T=1000, H=4, G=1, K=128, V=128, dtype=dtype, beta_mode="bound2"))
    cases.append(dict(B=1, T=65536, H=16, G=1, K=128, V=128, dtype=torch.bfloat16, grads=False))
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    if args.quick:  # a few cases with gradients: bf16 standard, fp32 GQA, fp32 packed
        cases = [cases[2], cases[11], cases[14]]
    if args.front:  # SmolLM2 training rows, packed documents, Llama-3-8B and Gemma head sizes
        cases = [dict(front=True, B=16, T=2048, H=3, K=64, V=64),
                 dict(front=True, B=1, T=32768, H=3, K=64, V=64, cu=[0, 1, 700, 5000, 5001, 20000, 32768]),
                 dict(front=True, B=2, T=4096, H=8, K=128, V=128), dict(front=True, B=1, T=3000, H=1, K=256, V=256)]
        # a bf16 model's path: k and v in bf16, k̂ and u returned in bf16
        cases += [dict(c, dtype=torch.bfloat16) for c in cases[:2]]
    if args.rope:  # SmolLM2 training rows (q and k), Llama-3-8B q
        cases = [dict(rope=True, B=16, T=2048, H=H, D=64, dtype=dt) for dt in (torch.bfloat16, torch.float32) for H in (9, 3)]
        cases.append(dict(rope=True, B=1, T=4096, H=32, D=128, dtype=torch.bfloat16))
        cases.append(dict(rope=True, B=4, T=2048, H=270, D=64, dtype=torch.bfloat16))  # 30 SmolLM2 layers' q at once
    if args.kl:  # one chunk of SmolLM2-sized logits, KL alone and KL + CE at T=2
        cases = [dict(kl=True, R=4096, V=49152, T=1.0, ce_w=None), dict(kl=True, R=4096, V=49152, T=2.0, ce_w=0.01)]
    if args.align:  # SmolLM2's 30 layers side by side (90 KV / 270 q heads, d=64), and their stacked output
        cases = [dict(B=2, T=2048, H=90, G=3, K=64, V=64, dtype=torch.bfloat16, v_offset=True)]
        cases += [dict(B=1, T=3000, H=6, G=3, K=64, V=64, dtype=torch.bfloat16, cu=[0, 1, 700, 2048, 3000], v_offset=True)]
        cases += [dict(rowsq=True, B=4, T=2048, L=30, D=576, dtype=dt) for dt in (torch.bfloat16, torch.float32)]
    rows = []
    meta = {"command": " ".join(["python", *sys.argv]), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": __import__("triton").__version__,
            "reference": "chunkwise PyTorch operator in float64 on the GPU, same rounded inputs"}
    for c in cases:
        with poisoned_outputs():  # every buffer the kernels' launcher allocates starts as NaN
            if c.get("front"):
                row = check_front(**{k: v for k, v in c.items() if k != "front"})
            elif c.get("rope"):
                row = check_rope(**{k: v for k, v in c.items() if k != "rope"})
            elif c.get("kl"):
                row = check_kl(**{k: v for k, v in c.items() if k != "kl"})
            elif c.get("rowsq"):
                row = check_rowsq(**{k: v for k, v in c.items() if k != "rowsq"})
            else:
                row = check(**c)
        rows.append(row)
        if args.output:  # written after every case, so a crash keeps what ran
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps({**meta, "rows": rows}, indent=1))
        print(f"{row['B']}x{row['T']:>6} q{row['q_heads']:>2}/kv{row['kv_heads']:>2} K{row['K']:>3} {row['dtype']:>8} "
              f"beta={row['beta']:<7} packed={'y' if row['cu_seqlens'] else 'n'} max err {row['max_error']:.2e} "
              f"({'ok' if row['pass'] else 'FAIL'}) " + " ".join(f"{k}={v:.1e}" for k, v in row["errors"].items()),
              flush=True)
    ok = all(r["pass"] for r in rows)
    print(f"{sum(r['pass'] for r in rows)} passed, {sum(not r['pass'] for r in rows)} failed")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
