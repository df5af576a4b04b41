"""The Taylor-GDN part of the sink + sliding-window block: its *old stream* through the state.

At query ``t`` the old stream is the token ``t − W`` that just left the window (``fresh_inputs``'
``old_k``/``old_v``); it writes into the state where it belongs to the query's document and is not one
of its ``S`` sinks — from a document's ``(W + S + 1)``-th token on (``old_ok``). Two ways to run it:

- :func:`composed_old_stream`: the PyTorch Taylor front with that mask, then the chunk operator (or a
  decode step) — every case: a cache to continue, padding, the seed form, the write gate, the second
  order mix;
- :func:`fused_old_stream`: a fresh sequence, no mask (training, scoring, a prompt's prefill into an empty
  cache; :func:`~linearize.layers.paths.fused_window_path`), through the fused Triton front
  (``ops/triton/front.py``). A masked step leaves the count, the means and the state where they were, so
  each document's old stream is the Taylor form of its tail after the first ``W + S`` tokens, started fresh. Cut every document there
  (:func:`document_pieces`) and the front and the operator run it unmasked: the tail starts with fresh
  means and a fresh state. The head's outputs stand for no old token; its count is 0, where
  :func:`~linearize.ops.window.mix_by_mass` puts all the weight on the exact part (and no gradient on them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import compute_dtype, gated_delta_rule, gated_delta_rule_step
from ..ops.common import LastTensorMemo
from ..ops.kda import scale_log_decay
from ..ops.taylor import RunningSums, TaylorInputs, fold_decay, taylor_back, taylor_front
from ..ops.window import old_square_sums
from ..ops.window_inputs import WindowInputs
from .paths import operator_dtype


@dataclass
class OldStream:
    """What :func:`~linearize.ops.window.mix_by_mass` reads of the old stream, and what a cache keeps of it."""

    o: torch.Tensor  # (B, T, G·H, V): the Taylor-GDN's output over the old tokens
    k_mean: torch.Tensor  # (B, T, H, K): their mean key
    count: torch.Tensor  # (B, T): how many there are (this step's write included)
    state: torch.Tensor | None = None  # (B, H, K, V) after the last token, when a cache continues
    sums: RunningSums | None = None
    square_sum: torch.Tensor | None = None  # (B, T, G·H): Σ (q·k)² over them (mix_order 2)


def composed_old_stream(block, q: torch.Tensor, inp: WindowInputs, beta_factor: torch.Tensor,
                        gate_factor: torch.Tensor, cu_seqlens=None, layer=None, dtype=None) -> OldStream:
    """The PyTorch front with the old stream's mask, continuing ``layer`` (a cache layer) where given.
    q ``(B, T, G·H, K)`` scaled, in the front's dtype; ``dtype``: the model's (the operator runs in it
    when it is 16-bit)."""
    opts, dt, T = block.options, q.dtype, q.shape[1]
    h0 = layer.state if layer is not None else None
    old_v = inp.old_v.to(dt)
    front = taylor_front(q, inp.old_k.to(dt), old_v, form=opts.form, rho=block.rho.to(dt), beta_max=opts.beta_max,
                         beta_factor=beta_factor, mask=inp.old_ok, initial=layer.sums if h0 is not None else None,
                         cu_seqlens=cu_seqlens, write_factor=block.write_gate(old_v) if opts.write_gate else None)
    front.g = scale_log_decay(front.g, gate_factor)
    q_old, front = (q, front) if block.decays else fold_decay(q, front)  # the mix reads q itself
    if T == 1 and h0 is not None:
        o, state = gated_delta_rule_step(q_old[:, 0], front.k[:, 0], front.v[:, 0], front.g[:, 0], front.beta[:, 0], h0)
        o = taylor_back(o[:, None], front.v_mean)
    else:
        cdt = operator_dtype(dtype, dt)
        o, state = gated_delta_rule(q=q_old.to(cdt), k=front.k.to(cdt), v=front.v.to(cdt),
                                    g=front.g if block.decays else None, beta=front.beta, initial_state=h0,
                                    output_final_state=layer is not None, cu_seqlens=cu_seqlens,
                                    backend=opts.backend, v_offset=front.v_mean)
    square_sum = None
    if opts.mix_order == 2:  # Σ (q·k)² over the old tokens, from Σkkᵀ carried in the running sums
        square_sum, moment = old_square_sums(q, inp.old_k.to(dt), inp.old_ok,
                                             initial=layer.sums.kk if h0 is not None else None,
                                             output_final_state=layer is not None, cu_seqlens=cu_seqlens,
                                             backend=opts.backend)
        if layer is not None:
            front.sums.kk = moment
    return OldStream(o, front.k_mean, front.count, state, front.sums, square_sum)


def fused_old_stream(block, q: torch.Tensor, inp: WindowInputs, beta_factor: torch.Tensor,
                     gate_factor: torch.Tensor, cu_seqlens=None, layer=None, dtype=None) -> OldStream:
    """A fresh sequence's old stream through the fused front, on every document cut after its first
    ``W + S`` tokens; the rows of a batch (``cu_seqlens`` None) as the documents of one packed row.
    Arguments as :func:`composed_old_stream`, but q may come in the model's 16-bit dtype (a prefill whose every
    step reads it so: the front, its ρ and the running sums stay float32); ``layer``: None, or a cache layer
    not yet written (a prompt's prefill, rows only), for which each row's state and running sums after its
    last token come back too."""
    if layer is not None and (layer.state is not None or cu_seqlens is not None):
        raise ValueError("the fused old stream starts a fresh sequence: a cache to continue takes composed_old_stream")
    from ..ops.triton.front import taylor_front_triton

    B, T = q.shape[:2]
    ft = compute_dtype(q.dtype)  # the front's dtype
    prefix = block.options.window + block.options.sinks
    pieces = document_pieces(cu_seqlens, B, T, prefix, q.device)
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:])  # noqa: E731  (B, T, ...) → (1, B·T, ...)
    kh, u, g, beta, v_mean, k_mean = taylor_front_triton(flat(inp.old_k), flat(inp.old_v), block.rho.to(ft),
                                                         block.options.beta_max, beta_factor=flat(beta_factor),
                                                         cu_seqlens=pieces, k_mean=True)
    # the old tokens written so far: the old stream writes from position W + S + 1 on (pos counts from 1)
    count = (inp.pos - prefix).clamp_min(0)  # (B, T)
    front = TaylorInputs(k=kh, v=u, g=scale_log_decay(g, flat(gate_factor)), beta=beta, v_mean=v_mean, sums=None,
                         count=flat(count))
    q_old, front = (flat(q), front) if block.decays else fold_decay(flat(q).to(ft), front)
    cdt = operator_dtype(dtype, ft)
    o, ht = gated_delta_rule(q=q_old.to(cdt), k=front.k.to(cdt), v=front.v.to(cdt), g=front.g if block.decays else None,
                             beta=front.beta, cu_seqlens=pieces, backend=block.options.backend, v_offset=front.v_mean,
                             output_final_state=layer is not None)
    k_mean = k_mean.view(B, T, *k_mean.shape[2:])
    out = OldStream(o.view(B, T, *o.shape[2:]), k_mean, count)
    if layer is not None:
        out.state, out.sums = rows_final_state(ht, pieces, k_mean, v_mean.view(B, T, *v_mean.shape[2:]), count, ft)
    return out


def rows_final_state(ht: torch.Tensor, pieces: torch.Tensor, k_mean: torch.Tensor, v_mean: torch.Tensor,
                     count: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, RunningSums]:
    """Each row's old-stream state and running sums after its last token, from the fused path's per-piece
    final states ``ht`` (``pieces``: :func:`document_pieces` of the rows): the state of the piece that ends the
    row, zero where the row has no old token yet (its only piece is the head); ``Σk = k̄·n``, ``Σv = v̄·n``."""
    B, T = count.shape
    n = count[:, -1].to(dtype)  # (B,): old tokens written
    ends = torch.arange(1, B + 1, device=pieces.device) * T
    state = ht[torch.searchsorted(pieces, ends) - 1] * (n > 0).to(ht.dtype)[:, None, None, None]
    return state, RunningSums(k=k_mean[:, -1].to(dtype) * n[:, None, None], v=v_mean[:, -1].to(dtype) * n[:, None, None],
                              count=n)


def document_pieces(cu_seqlens: torch.Tensor | None, B: int, T: int, prefix: int, device) -> torch.Tensor:
    """Offsets ``(N' + 1,)`` of the ``B·T`` flattened tokens with every document cut after its first
    ``prefix`` tokens, empty pieces dropped. ``cu_seqlens`` None: each of the B rows one document.
    Remembered per ``cu_seqlens`` tensor (or shape), so every layer passes the kernels the same tensor and
    their chunk tables are built once per step; made outside inference mode, so a tensor remembered by a prefill
    under ``torch.inference_mode()`` can still be saved for a later training step's backward.

    Example:
        >>> document_pieces(torch.tensor([0, 3, 10, 12]), 1, 12, 4, "cpu").tolist()
        [0, 3, 7, 10, 12]
    """
    if cu_seqlens is None:
        key = (B, T, prefix, str(device))
        if key not in _ROWS:
            _ROWS.clear()  # one shape at a time is what training uses
            _ROWS[key] = _cut(torch.arange(0, (B + 1) * T, T), prefix, device)
        return _ROWS[key]
    return _PIECES.get(cu_seqlens, lambda: _cut(cu_seqlens, prefix, cu_seqlens.device), key=(prefix,))


def _cut(cu: torch.Tensor, prefix: int, device) -> torch.Tensor:
    """``cu`` with a cut ``prefix`` tokens into every document (none past its end); sorted, unique, long, on
    ``device`` (worked out on the host)."""
    with torch.inference_mode(False):
        cu = cu.to("cpu", torch.long)
        cuts = torch.minimum(cu[:-1] + prefix, cu[1:])
        return torch.cat([cu, cuts]).unique(sorted=True).to(device)


_ROWS: dict = {}
_PIECES = LastTensorMemo()  # every layer of one step passes the same cu_seqlens
