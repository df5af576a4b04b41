"""Measuring how close linearized attention is to the teacher: built-in text, activation capture,
per-layer fidelity of each initialization, perplexity."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .models.adapters import decoder_layers, project_qkv
from .ops import softmax_attention, taylor_attention, uniform_attention, vala_attention

INITS = ("uniform", "vala", "seed", "stable")
COLORS = {"uniform": "tab:blue", "vala": "tab:orange", "seed": "tab:green", "stable": "tab:red"}


BUILTIN_TRAIN_SHARE = 0.9  # of the built-in topics; distill holds out at least the rest (linearize.distill.data)


def builtin_text(split: str = "heldout") -> str:
    """Offline English prose from the standard library (``pydoc_data.topics``, ~465 kB).

    ``"train"`` is the first 90% of the topics (sorted by name), ``"heldout"`` the rest.
    """
    from pydoc_data.topics import topics

    keys = sorted(topics)
    cut = int(len(keys) * BUILTIN_TRAIN_SHARE)
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout'; got {split!r}")
    chosen = keys[:cut] if split == "train" else keys[cut:]
    return "\n\n".join(topics[k] for k in chosen)


def text_ids(tokenizer, num_tokens: int, split: str = "heldout", batch: int = 1) -> torch.Tensor:
    """``(batch, num_tokens)`` token ids of built-in text, rows taken one after another."""
    ids = tokenizer(builtin_text(split), return_tensors="pt").input_ids[0]
    need = batch * num_tokens
    if ids.numel() < need:
        raise ValueError(f"built-in {split} text has {ids.numel()} tokens; asked for {batch}×{num_tokens}")
    return ids[:need].view(batch, num_tokens)


@dataclass
class AttentionCapture:
    """One attention block's input and output during a teacher forward."""

    hidden_states: torch.Tensor  # (B, T, d_model)
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    output: torch.Tensor  # (B, T, Hq·D): the attention output before o_proj


def attention_modules(model) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in decoder_layers(model)]


class _Captured(Exception):
    """Raised by :func:`capture_attention`'s last hook to end the forward early."""


@torch.no_grad()
def capture_attention(
    model, input_ids: torch.Tensor, layers: list[int] | None = None, position_ids: torch.Tensor | None = None,
    stop_early: bool = False,
) -> dict[int, AttentionCapture]:
    """Run the teacher once; return each chosen layer's attention input and output.

    ``position_ids`` restarting inside a row mark packed documents (attention stays inside each).
    ``stop_early``: end the forward as soon as the last chosen layer's attention output is captured —
    its ``o_proj``, the later layers, the final norm and the LM head do not run (not for a model whose
    layers FSDP gathers: its hooks would be left mid-forward)."""
    mods = attention_modules(model)
    layers = list(range(len(mods))) if layers is None else layers
    last = max(i % len(mods) for i in layers) if layers else None
    got: dict[int, dict] = {i: {} for i in layers}
    handles = []
    for i in layers:
        def pre(mod, args, kwargs, i=i):
            got[i]["hidden_states"] = kwargs.get("hidden_states", args[0] if args else None)
            got[i]["position_embeddings"] = kwargs["position_embeddings"]

        def o_in(mod, args, i=i):
            got[i]["output"] = args[0]
            if stop_early and i % len(mods) == last:
                raise _Captured

        handles.append(mods[i].register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mods[i].o_proj.register_forward_pre_hook(o_in))
    try:
        model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=1)  # no (B, T, V) logits
    except _Captured:
        pass
    finally:
        for h in handles:
            h.remove()
    return {i: AttentionCapture(**got[i]) for i in layers}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    return err if math.isfinite(err) else math.inf


@torch.no_grad()
def init_errors(
    attn: torch.nn.Module, cap: AttentionCapture, inits=INITS, beta_max: float | None = None,
    rho: torch.Tensor | None = None,
) -> dict[str, float]:
    """Relative error against the teacher's attention output of each initialization, in float64.

    Also returns ``"softmax"``: our exact softmax on the same q, k, v, a check on the q/k/v extraction.
    ``rho`` (per KV head) is the stable form's ρ; by default it is calibrated on ``cap`` itself.
    """
    q, k, v = (x.double() for x in project_qkv(attn, cap.hidden_states, cap.position_embeddings))
    ref = cap.output.double().view(q.shape[0], q.shape[1], q.shape[2], -1)
    s = float(attn.scaling)
    outs = {"softmax": lambda: softmax_attention(q, k, v, scale=s)}
    outs["uniform"] = lambda: uniform_attention(v, q.shape[2])
    outs["vala"] = lambda: vala_attention(q, k, v, scale=s)
    kw = {} if beta_max is None else {"beta_max": beta_max}
    if rho is not None:
        kw["rho"] = rho.double()
    outs["seed"] = lambda: taylor_attention(q, k, v, scale=s, form="seed")
    outs["stable"] = lambda: taylor_attention(q, k, v, scale=s, form="stable", **kw)
    return {name: relative_error(outs[name](), ref) for name in ("softmax", *inits)}


def layer_fidelity(model, input_ids: torch.Tensor, inits=INITS, beta_max: float | None = None) -> list[dict]:
    """Per layer: relative error of each initialization against the teacher on ``input_ids``."""
    caps = capture_attention(model, input_ids)
    mods = attention_modules(model)
    return [{"layer": i, **init_errors(mods[i], caps[i], inits, beta_max)} for i in sorted(caps)]


@torch.no_grad()
def perplexity(model, input_ids: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy) over ``(B, T)`` ids."""
    logits = model(input_ids=input_ids, use_cache=False).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten())
    return math.exp(loss.item())


def plot_fidelity(rows: list[dict], path, title: str, inits=INITS) -> None:
    """Per-layer relative error of each initialization as a PNG; layers kept softmax (rows with
    ``block == "softmax"``) are shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # left: every form (the seed form's blow-up needs the log axis); right: the finite ones, linear
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    layers = [r["layer"] for r in rows]
    kept = [r["layer"] for r in rows if r.get("block") == "softmax"]  # rows of a conversion report say
    for ax, names, log in ((axes[0], inits, True), (axes[1], [n for n in inits if n != "seed"], False)):
        for j, i in enumerate(kept):
            ax.axvspan(i - 0.5, i + 0.5, color="0.85", zorder=0, label="kept softmax" if j == 0 else None)
        for name in names:
            ax.plot(layers, [min(r[name], 1e30) for r in rows], marker="o", ms=3, label=name, color=COLORS.get(name))
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("relative error vs teacher attention")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def conversion_report(teacher_caps: dict[int, AttentionCapture], model, input_ids, teacher_ppl: float) -> dict:
    """Fidelity of a converted model against the teacher activations captured before converting.

    Per layer: the error of every initialization (``stable`` uses the block's calibrated ρ and β
    bound), of the block as converted (``converted``: the stable form, or with a window and sinks the
    sink + window block; 0 for a layer kept softmax), and whether the layer was converted; plus the
    perplexity of teacher and converted model on the same ids.
    """
    from .layers.gdn_attention import GDNAttention

    rows = []
    for i, cap in sorted(teacher_caps.items()):
        attn = attention_modules(model)[i]
        gdn = isinstance(attn, GDNAttention)
        errs = init_errors(attn, cap, rho=getattr(attn, "rho", None), beta_max=attn.options.beta_max if gdn else None)
        # the block as converted (with its window, sinks, gate: what the model runs); a kept softmax layer is the teacher
        with torch.no_grad():
            converted = relative_error(attn.attention_output(cap.hidden_states, cap.position_embeddings), cap.output) if gdn else 0.0
        rows.append({"layer": i, "block": "gdn" if gdn else "softmax", **errs, "converted": converted})
    return {
        "tokens": int(input_ids.numel()),
        "layers": rows,
        "perplexity": {"teacher": teacher_ppl, "converted": perplexity(model, input_ids)},
        "stable_beats_vala": sum(r["stable"] < r["vala"] for r in rows),
    }
