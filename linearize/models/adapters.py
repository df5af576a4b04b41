"""How each family's attention module turns hidden states into q, k, v (SPEC §2 notation).

Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 and Gemma 3 (q_norm/k_norm before RoPE) share one
shape of code in transformers 5.x: project, view as heads, optional per-head norm, RoPE.
"""

from __future__ import annotations

import torch


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder blocks of a causal LM of any supported family (each has ``.self_attn``)."""
    return model.model.layers


def global_layers(config) -> list[int]:
    """The layers that attend over the whole context, so whose KV cache grows with it: those its
    ``layer_types`` call ``full_attention`` (Gemma 3: every 6th; the others keep a sliding window, a cache of
    fixed size already); every layer of a model without sliding windows."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is None:
        sliding = getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True)
        return [] if sliding else list(range(n))
    return [i for i, t in enumerate(types[:n]) if t == "full_attention"]


def project_qkv(attn: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings,
                fused: bool = False, with_v: bool = True, rope: bool = True, mix=None,
                projections=None) -> tuple[torch.Tensor, ...]:
    """``(q, k, v)`` as ``[B, T, H, D]``, after the module's norms and RoPE, before the softmax scale.
    ``fused``: RoPE through one Triton pass each way (``linearize/modules/rope.py``) where it applies.
    ``with_v=False``: v is left to the caller (returned as None). ``rope=False``: q and k before RoPE
    (the caller applies it, :func:`apply_rope`). ``mix``: ``(q, k, v) -> (q, k, v)`` on the projections'
    outputs, before the norms and RoPE (the GDN block's short convolution). ``projections``: the three
    projections' outputs ``[B, T, H·D]``, already computed (the decode step's stacked product)."""

    B, T, _ = hidden_states.shape
    d = attn.head_dim
    if projections is not None:
        q, k, v = (p.reshape(B, T, -1, d) for p in projections)
    else:
        q = attn.q_proj(hidden_states).view(B, T, -1, d)
        k = attn.k_proj(hidden_states).view(B, T, -1, d)
        v = attn.v_proj(hidden_states).view(B, T, -1, d) if with_v else None
    if mix is not None:
        q, k, v = mix(q, k, v)
    if getattr(attn, "q_norm", None) is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    if not rope:
        return q, k, v
    return (*apply_rope(q, k, position_embeddings, fused), v)


def apply_rope(q: torch.Tensor, k: torch.Tensor, position_embeddings, fused: bool = False):
    """RoPE of q and k, ``[B, T, H, D]`` (any head counts): transformers' function, or with ``fused`` one
    Triton pass each (``linearize/modules/rope.py``) where that applies."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = position_embeddings
    if fused:
        from ..modules.rope import apply_rope_triton, rope_usable

        if rope_usable(q, cos) and rope_usable(k, cos):
            return apply_rope_triton(q, cos, sin), apply_rope_triton(k, cos, sin)
    # apply_rotary_pos_emb wants (B, H, T, D) with unsqueeze_dim=1; (B, T, H, D) takes unsqueeze_dim=2
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)


def head_counts(teacher: torch.nn.Module) -> tuple[int, int]:
    """``(query heads, KV heads)`` read off the teacher's projections, each shape checked: the GDN block
    reuses them as they are, so a layout it does not expect has to stop the conversion here."""
    d = teacher.head_dim
    q, k, v, o = teacher.q_proj, teacher.k_proj, teacher.v_proj, teacher.o_proj
    hidden = q.in_features
    if q.out_features % d or k.out_features % d:
        raise ValueError(f"layer {teacher.layer_idx}: q_proj/k_proj widths {q.out_features}/{k.out_features} "
                         f"are not multiples of head_dim {d}")
    Hq, H = q.out_features // d, k.out_features // d
    checks = {"k_proj.in_features": (k.in_features, hidden), "v_proj.in_features": (v.in_features, hidden),
              "v_proj.out_features": (v.out_features, H * d), "o_proj.in_features": (o.in_features, Hq * d)}
    for name, (got, want) in checks.items():
        if got != want:
            raise ValueError(f"layer {teacher.layer_idx}: {name} is {got}, expected {want} "
                             f"({Hq} query heads, {H} KV heads of {d})")
    if Hq % H:
        raise ValueError(f"layer {teacher.layer_idx}: {Hq} query heads are not a multiple of {H} KV heads")
    return Hq, H
