"""The two training objectives: align (each GDN block against its teacher attention's output) and
distill (the student's next-token distribution against the teacher's).

Each objective is an ``nn.Module`` whose forward computes the loss of one batch — teacher forward
included, without gradient — so ``DistributedDataParallel`` can wrap it and average gradients
during the backward. The teacher is held outside the module tree (it is frozen and not trained).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def gdn_layers(model) -> dict:
    """``{layer index: GDNAttention}`` of a converted model."""
    from ..layers import GDNAttention
    from ..models.adapters import decoder_layers

    return {i: layer.self_attn for i, layer in enumerate(decoder_layers(model)) if isinstance(layer.self_attn, GDNAttention)}


def align_weights(layers, layer_weights: dict | None) -> dict[int, float]:
    """Each converted layer's weight in the align loss: ``layer_weights[i]``, else 1."""
    unknown = sorted(set(layer_weights or {}) - set(layers))
    if unknown:
        raise ValueError(f"layer_weights names layers {unknown}, which are not converted GDN layers "
                         f"(converted: {sorted(layers)}); use their indices")
    weights = {i: float((layer_weights or {}).get(i, 1.0)) for i in layers}
    if sum(weights.values()) <= 0:
        raise ValueError("layer_weights gives every converted layer weight 0: nothing would train")
    return weights


# ---------------------------------------------------------------------------------------- align


class _RowSquaredError(torch.autograd.Function):
    """``Σ (out − ref)²`` per row of ``(B, T, C)``, accumulated in float32; ``ref`` is a constant.

    The same value autograd gets from ``(out.float() - ref.float()).pow(2).sum((1, 2))``, without holding
    a float32 copy of the difference for every layer until the backward: it is recomputed there."""

    @staticmethod
    def forward(ctx, out, ref):
        ctx.save_for_backward(out, ref)
        return torch.linalg.vector_norm(out.float() - ref, dim=(1, 2)).square()  # not in place: fp32 out is out

    @staticmethod
    def backward(ctx, grad):
        out, ref = ctx.saved_tensors
        return (out.float() - ref).mul_(2 * grad[:, None, None]).to(out.dtype), None


def _row_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's per-row ``(Σ (out − ref)², Σ ref²)``, float32, ``(B,)`` each; the first differentiable."""
    if out.is_cuda:
        from ..modules.rowsq import row_squared_errors

        sse, ref_sq = row_squared_errors(out.unsqueeze(2), [ref])
        return sse[0], ref_sq[0]
    with torch.no_grad():
        ref_sq = torch.linalg.vector_norm(ref, dim=(1, 2), dtype=torch.float32).square()
    return _RowSquaredError.apply(out, ref), ref_sq


def _layer_errors(layers: dict, caps: dict, pos, batched: bool) -> dict:
    """``{layer: (Σ squared error, Σ teacher square) per row}`` of each block on the teacher's captured
    input: every block in one :func:`linearize.distill.align.batched_attention_outputs` call and one Triton
    pass over the stacked output where that applies, else block by block."""
    from .align import batched_attention_outputs

    if not layers:
        return {}
    refs = [caps[i].output.detach() for i in layers]
    o = None
    pe = caps[next(iter(layers))].position_embeddings
    if batched and all(caps[i].position_embeddings is pe for i in layers):
        o = batched_attention_outputs(list(layers.values()), [caps[i].hidden_states for i in layers], pe, pos)
    if o is not None:  # (B, T, layer, D)
        from ..modules.rowsq import row_squared_errors

        sse, ref_sq = row_squared_errors(o, refs)
        return dict(zip(layers, zip(sse.unbind(0), ref_sq.unbind(0))))
    return {i: _row_errors(gdn.attention_output(caps[i].hidden_states, caps[i].position_embeddings, pos), ref)
            for (i, gdn), ref in zip(layers.items(), refs)}


def align_loss(student, teacher, ids, pos, kind: str, layer_weights: dict | None = None,
               batched: bool = True, stop_early: bool = True) -> tuple[torch.Tensor, dict]:
    """Weighted mean over the converted layers of each block's (normalized) MSE to the teacher's attention
    output (``layer_weights``: ``{layer index: weight}``, others 1), and ``{layer: loss}`` as detached
    0-dim tensors — read back (:func:`per_layer_values`) only after the backward, so no layer waits on a
    host sync while the GPU drains its queue. ``batched``: all blocks in one front and operator call where
    the batched align path applies. A layer of weight 0 adds nothing to the loss and its block gets no
    gradient: its error is computed apart, without autograd (on the batched path it would otherwise share
    the others' operator call and get a zero gradient, which weight decay would act on). ``stop_early``:
    the teacher forward ends after the last captured layer (not under FSDP, whose root must finish)."""
    from ..eval import capture_attention

    layers = gdn_layers(student)
    weights = align_weights(layers, layer_weights)
    caps = capture_attention(teacher, ids, list(layers), position_ids=pos, stop_early=stop_early)
    live = {i: gdn for i, gdn in layers.items() if weights[i]}
    found = _layer_errors(live, caps, pos, batched)
    if len(live) < len(layers):
        with torch.no_grad():
            found.update(_layer_errors({i: gdn for i, gdn in layers.items() if i not in live}, caps, pos, batched))
    per_layer = {}
    total = 0.0
    for i in layers:
        sse_i, ref_sq_i = found[i]
        n = caps[i].output[0].numel()
        err = sse_i / n  # per row, so shards average exactly
        if kind == "nmse":  # over the teacher's own mean square (a constant)
            err = err / (ref_sq_i / n).clamp_min(1e-12)
        err = err.mean()
        per_layer[i] = err.detach()
        if weights[i]:
            total = total + weights[i] * err
    return total / sum(weights.values()), per_layer


def per_layer_values(per_layer: dict) -> dict:
    """``{layer: float}`` from ``align_loss``'s tensors, in one device→host copy."""
    return dict(zip(per_layer, torch.stack(list(per_layer.values())).tolist())) if per_layer else {}


# ---------------------------------------------------------------------------------------- distill


def next_token_labels(ids, pos):
    """Labels for next-token prediction; no target across a document boundary (``pos`` None: every row is
    one document) or at a row end."""
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    if pos is not None:
        labels[:, :-1][pos[:, 1:] == 0] = -100
    return labels


def last_hidden(model, ids, pos) -> torch.Tensor:
    """The final (normed) hidden states, through the model's own forward — which FSDP needs — with
    logits for one position only: the LM head then runs chunk by chunk."""
    with no_causal_mask(model):
        out = model(input_ids=ids, position_ids=pos, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


_NO_MASK = "linearize_no_causal_mask"  # an attention implementation no mask function knows


@contextmanager
def no_causal_mask(model):
    """While in it, a student whose every layer is a converted block gets no causal mask from transformers:
    none of its layers reads one (they take packing from ``position_ids``, and padding from a mask, which
    training never passes), and building it found the packed documents by reading ``position_ids`` back from
    the GPU (a sync a forward) and laid out a ``(B, 1, T, T)`` mask. transformers builds none for an
    attention implementation no mask function is registered for; the configs get such a name, restored
    after. Models with softmax layers (hybrids, teachers) are left as they are."""
    from ..decoding import all_gdn

    if not all_gdn(model):
        yield
        return
    configs = {id(c): c for c in (model.config, getattr(model.base_model, "config", None)) if c is not None}
    # the attribute behind transformers' property (whose setter also rewrites sub-configs), else the plain one
    attr = lambda c: "_attn_implementation_internal" if "_attn_implementation_internal" in vars(c) else "_attn_implementation"  # noqa: E731
    saved = [(c, attr(c), getattr(c, attr(c))) for c in configs.values()]
    try:
        for c, a, _ in saved:
            setattr(c, a, _NO_MASK)
        yield
    finally:
        for c, a, name in saved:
            setattr(c, a, name)


def chunked_kl(student_h, teacher_h, lm_s, lm_t, labels, T: float, chunk: int, ce_weight: float):
    """KL(teacher ‖ student) per token at temperature T (× T²), and optional CE, chunk by chunk: each chunk's
    logits go through :func:`linearize.modules.kl.kl_loss`, which keeps only their gradient for the backward."""
    from ..modules.kl import kl_loss

    s_flat, t_flat = student_h.flatten(0, 1), teacher_h.flatten(0, 1)
    y = labels.flatten()
    n = s_flat.shape[0]
    ce_w = None
    if ce_weight:  # a device scalar: no host sync for the count of real targets
        ce_w = ce_weight / (y != -100).sum().clamp_min(1).float()
    total = 0.0
    for a in range(0, n, chunk):
        ls = lm_s(s_flat[a:a + chunk])
        with torch.no_grad():
            lt = lm_t(t_flat[a:a + chunk])
        total = total + kl_loss(ls, lt, y[a:a + chunk], T, kl_weight=1.0 / n, ce_weight=ce_w)
    return total


# ---------------------------------------------------------------------------------------- objectives


class AlignObjective(nn.Module):
    """``forward(ids, pos) -> (loss, {layer: loss})`` of the align stage (see :func:`align_loss`)."""

    def __init__(self, student, teacher, kind: str, layer_weights: dict | None, fsdp: bool):
        super().__init__()
        self.student = student
        self._teacher = (teacher,)  # not a submodule: frozen, and not DDP's to broadcast
        self.kind, self.layer_weights, self.fsdp = kind, layer_weights, fsdp

    def forward(self, ids, pos):
        return align_loss(self.student, self._teacher[0], ids, pos, self.kind, self.layer_weights,
                          batched=not self.fsdp, stop_early=not self.fsdp)


class DistillObjective(nn.Module):
    """``forward(ids, pos) -> (loss, None)``: chunked KL(teacher ‖ student) (+ CE) of the distill stage."""

    def __init__(self, student, teacher, temperature: float, kl_chunk: int, ce_weight: float):
        super().__init__()
        self.student = student
        self._teacher = (teacher,)
        self.temperature, self.kl_chunk, self.ce_weight = temperature, kl_chunk, ce_weight

    def forward(self, ids, pos):
        teacher = self._teacher[0]
        with torch.no_grad():
            th = last_hidden(teacher, ids, pos)
        sh = last_hidden(self.student, ids, pos)
        loss = chunked_kl(sh, th, self.student.lm_head, teacher.lm_head, next_token_labels(ids, pos),
                          self.temperature, self.kl_chunk, self.ce_weight)
        return loss, None


def objective_for(stage, student, teacher, fsdp: bool) -> nn.Module:
    if stage.name == "align":
        return AlignObjective(student, teacher, stage.loss, stage.layer_weights, fsdp)
    return DistillObjective(student, teacher, stage.temperature, stage.kl_chunk, stage.ce_weight)
