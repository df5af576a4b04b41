"""``torch.compile`` for decoding a converted model, applied for a while and then taken back.

A decode step is one token per row: its matrix products are small and its element-wise work — the GDN
block's running means, β, the gate, the rank-1 update, the window's and the cache's softmax, the norms, the
MLP's activation — is a few hundred tiny operations per layer, each paying the framework's dispatch. On a GPU
the CUDA graph removes that cost (:class:`linearize.decoding.Decoder`); :func:`compiled_blocks` also fuses
the element-wise work it records. On a CPU there is no graph: :func:`compiled_steps` compiles each GDN
block's decode step, so that a step runs a few fused loops instead of several hundred operations
(SmolLM2-135M with the recipe's cache of 1,024 on a 2-core CPU: ``results/bench_decode_cpu_compiled.json``).
There the norms and MLPs stay eager: a compiled region's entry costs more than their few operations save (the
same decode was about 8% slower with :func:`compiled_blocks` as well).

Both patch the modules' methods on the instances and put them back on exit; compiled code is kept by
``torch.compile`` itself, keyed on the functions, so a second use of the same shapes compiles nothing.
Shapes are static (``dynamic=False``): a prefill runs outside, and a decode step's shapes do not change
with the context. Neither changes what is computed beyond float rounding (the compiler reorders sums).
"""

from __future__ import annotations

import contextlib

import torch

from .layers.gdn_attention import GDNAttention


def _patched(targets, compiled=lambda module, fn: torch.compile(fn, dynamic=False)):
    """Replace ``(module, method)`` pairs on the instances by ``compiled(module, method)``; returns what puts
    each back."""
    patched = []
    for child, method in targets:
        patched.append((child, method, child.__dict__.get(method)))
        setattr(child, method, compiled(child, getattr(child, method)))
    return patched


def _restore(patched) -> None:
    for child, method, before in patched:
        if before is None:
            delattr(child, method)
        else:
            setattr(child, method, before)


@contextlib.contextmanager
def compiled_blocks(model, enabled: bool = True):
    """Within: every decoder block's norms and MLP, and what a GDN block's decode step computes before its kernel
    (``GDNAttention.step_inputs``: q/k/v, their norms and RoPE, q's scale, the β and decay factors), run through
    ``torch.compile``, their element-wise work fused into a few kernels; afterwards the model is as it was. The
    step kernel and the cache updates stay as they are. A graph recorded within keeps the compiled kernels."""
    from .models.adapters import decoder_layers

    targets = []
    if enabled:
        for block in decoder_layers(model):
            for name, child in block.named_children():
                method = "forward" if name == "mlp" or name.endswith("norm") else \
                    "step_inputs" if isinstance(child, GDNAttention) else None
                if method:
                    targets.append((child, method))
    patched = _patched(targets)
    try:
        yield
    finally:
        _restore(patched)


@contextlib.contextmanager
def compiled_steps(model, enabled: bool = True):
    """Within: every GDN block's decode step (``GDNAttention._step``: the Taylor-GDN update, the window's and the
    sparse cache's softmax and their in-place updates, the mix) through ``torch.compile`` as one region; afterwards
    the model is as it was. For eager decoding (a CPU); a CUDA graph has no per-operation cost to remove there.
    The step's stacked projections (one product, :func:`linearize.layers.step_projection.step_projections`) run
    eagerly before it: their weights' bookkeeping is host-side, and inside it would split the region in two (as it
    does for a block whose projections cannot be stacked, a LoRA-wrapped one). Shapes are static: each batch size
    compiles once, and past torch's recompile limit (8 by default) the step runs eagerly."""
    from .layers.step_projection import step_projections

    def compiled(attn, fn):
        step = torch.compile(fn, dynamic=False)

        def run(hidden_states, *args, **kwargs):
            proj = step_projections(attn, hidden_states) if attn.stacked_step else None
            return step(hidden_states, *args, proj=proj, **kwargs)
        return run

    targets = [(m, "_step") for m in model.modules() if isinstance(m, GDNAttention)] if enabled else []
    patched = _patched(targets, compiled)
    try:
        yield
    finally:
        _restore(patched)
