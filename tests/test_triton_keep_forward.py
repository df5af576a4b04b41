"""The GDN/DeltaNet Triton backward from what the forward kept (``function.KEEP_FORWARD``) against the backward
that computes it again, and both against the float64 reference, under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from _calls import counted_calls
from test_ops import gdn_inputs, rel

from linearize.ops import gated_delta_rule, taylor_back

NAMES = "o h q k v g beta h0 v_offset".split()


def run(q, k, v, g, beta, h0, vm, cu, backend):
    """Output, final state and every input's gradient of one weighted loss on both outputs."""
    from linearize.ops.triton import chunk_gated_delta_rule_triton

    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) if x is not None else None
              for x in (q, k, v, g, beta, h0, vm)]
    q, k, v, g, beta, h0, vm = leaves
    if backend == "reference":
        o, h = gated_delta_rule(q, k, v, g, beta, scale=0.6, initial_state=h0, output_final_state=True,
                                cu_seqlens=cu, backend="reference")
        o = taylor_back(o, vm)
    else:
        o, h = chunk_gated_delta_rule_triton(q, k, v, g, beta, scale=0.6, initial_state=h0, output_final_state=True,
                                             cu_seqlens=cu, v_offset=vm)
    gen = torch.Generator().manual_seed(9)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum()
    (loss + (h.double() * torch.randn(h.shape, generator=gen, dtype=torch.float64)).sum()).backward()
    return [o.detach(), h.detach()] + [x.grad if x is not None else None for x in leaves]


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("decay", [True, False], ids=["gdn", "deltanet"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 1e-2)], ids=["fp32", "fp16"])
def test_backward_from_the_kept_forward_equals_the_one_that_computes_it_again(poisoned, monkeypatch, group, decay,
                                                                                dtype, tol):
    """Kept, the forward's state kernel stores every chunk's state (the output kernel still reads one per
    ``group`` chunks of them) and the backward launches neither ``recompute_w_u`` nor ``chunk_fwd_h``; its
    outputs and gradients are the very values of the path that computes them again, and both are the
    float64 reference's (GQA, packed documents with an empty one, the Taylor back, initial state). A forward
    that wants no gradient keeps nothing and returns the same output."""
    from linearize.ops.triton import chunk_bwd, chunk_fwd, function

    monkeypatch.setattr(chunk_fwd, "output_group", lambda K: group)
    calls = counted_calls(monkeypatch, chunk_bwd, ["recompute_w_u", "chunk_fwd_h"])  # the backward's own
    B, T, H, G, K, V, cu = 1, 300, 2, 2, 16, 32, torch.tensor([0, 37, 37, 101, 300])
    q, k, v, g, beta = gdn_inputs(B, T, H, G, K, V, seed=21, dtype=torch.float64, beta_scale=2.0)
    g = g if decay else None
    h0 = torch.randn(4, H, K, V, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    vm = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    want = run(q, k, v, g, beta, h0, vm, cu, "reference")
    low = [x.to(dtype) if x is not None else None for x in (q, k, v, g, beta)] + [h0.float(), vm.float()]

    monkeypatch.setattr(function, "KEEP_FORWARD", False)
    again = run(*low, cu, "triton")
    assert calls == {"recompute_w_u": 1, "chunk_fwd_h": 1}
    monkeypatch.setattr(function, "KEEP_FORWARD", True)
    kept = run(*low, cu, "triton")
    assert calls == {"recompute_w_u": 1, "chunk_fwd_h": 1}  # none more
    for name, a, b, ref in zip(NAMES, kept, again, want):
        if ref is None:
            assert a is None and b is None, name
            continue
        assert torch.equal(a, b), name
        assert torch.isfinite(a).all() and rel(a, ref) < tol, (name, rel(a, ref))
    # nothing kept where autograd will not differentiate: under no_grad with leaves that require gradients, and
    # with gradients on but no leaf requiring one; the output the same
    asked = []  # the keep argument of each forward launcher call
    real_fwd = function.chunk_gated_delta_rule_fwd
    monkeypatch.setattr(function, "chunk_gated_delta_rule_fwd", lambda **kw: asked.append(kw["keep"]) or real_fwd(**kw))
    leaves = [x.detach().clone().requires_grad_(True) if x is not None else None for x in low]
    kw = dict(scale=0.6, output_final_state=True, cu_seqlens=cu)
    with torch.no_grad():
        o, _ = function.chunk_gated_delta_rule_triton(*leaves[:5], initial_state=leaves[5], v_offset=leaves[6], **kw)
    o2, _ = function.chunk_gated_delta_rule_triton(*low[:5], initial_state=low[5], v_offset=low[6], **kw)
    assert asked == [False, False] and torch.equal(o, kept[0]) and torch.equal(o2, kept[0])


def test_kept_forward_stores_every_chunks_state():
    """``keep=True`` returns ``chunk_fwd.Kept`` with one state per chunk (not per output group) and Δ shaped like v;
    without it the forward returns three values."""
    from linearize.ops.triton.chunk_fwd import Kept, chunk_gated_delta_rule_fwd, output_group

    q, k, v, g, beta = (x.float() for x in gdn_inputs(2, 130, 1, 1, 128, 16, seed=1))
    args = dict(q=q, k=k, v=v, g=g, beta=beta, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None)
    assert output_group(128) > 1
    assert len(chunk_gated_delta_rule_fwd(**args)) == 3
    o, ht, tm, kept = chunk_gated_delta_rule_fwd(**args, keep=True)
    assert isinstance(kept, Kept) and ht is None
    assert kept.hs.shape == (2 * 3, 1, 128, 16) and kept.v_new.shape == (2 * 130, 1, 16)
    assert kept.w.shape == (2 * 130, 1, 128) and kept.gcum.shape == (2 * 130, 1)


@pytest.mark.parametrize("decay", [True, False], ids=["gdn", "deltanet"])
def test_kept_forward_without_states_dense_batch(poisoned, monkeypatch, decay):
    """The other branches: a dense batch of two, no initial state, no final state (so no ``dht``), output groups
    of 2 over three chunks: the kept path's gradients equal the recomputing path's and the float64 reference's."""
    from linearize.ops.triton import chunk_bwd, chunk_fwd, chunk_gated_delta_rule_triton, function

    monkeypatch.setattr(chunk_fwd, "output_group", lambda K: 2)
    calls = counted_calls(monkeypatch, chunk_bwd, ["recompute_w_u", "chunk_fwd_h"])
    inputs = list(gdn_inputs(2, 150, 2, 1, 16, 16, seed=8, dtype=torch.float64, beta_scale=2.0))
    inputs[3] = inputs[3] if decay else None
    got = {}
    for name, keep in (("reference", None), ("again", False), ("kept", True)):
        monkeypatch.setattr(function, "KEEP_FORWARD", bool(keep))
        leaves = [x.detach().clone().to(torch.float64 if keep is None else torch.float32).requires_grad_(True)
                  if x is not None else None for x in inputs]
        if keep is None:
            o, _ = gated_delta_rule(*leaves, scale=0.6, backend="reference")
        else:
            o, _ = chunk_gated_delta_rule_triton(*leaves, scale=0.6)
        (o.double() * torch.randn(o.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)).sum().backward()
        got[name] = [o.detach()] + [x.grad for x in leaves if x is not None]
    assert calls == {"recompute_w_u": 1, "chunk_fwd_h": 1}  # the recomputing path's only
    for a, b, ref in zip(got["kept"], got["again"], got["reference"]):
        assert torch.equal(a, b) and rel(a, ref) < 1e-5
