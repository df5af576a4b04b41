"""GDN attention: a drop-in for a transformers attention module (Llama, Mistral, Qwen2/3, Gemma 3).

It keeps the teacher's ``q_proj/k_proj/v_proj/o_proj`` (plain ``nn.Linear``, so peft finds them by
name), its ``q_norm/k_norm`` and its RoPE (``position_embeddings`` from the model), and replaces
softmax by the stable Taylor form of SPEC §2 run through the GDN operator. At initialization it
computes that form exactly; training moves away from it through new parameters that start at the
identity:

- ``rho``: per-KV-head query-norm scale of the bounded ``c_t = ρ k̂_t`` (calibrated at convert);
- ``gate_proj``: a data-dependent exponent on the decay, ``α_t ← α_t^{exp(w·x_t + b)}`` (zero init; not in
  the ``deltanet`` target, which has no decay: its state is ``t×`` the GDN one, see ``ops.taylor.fold_decay``);
- ``channel_gate_proj`` (the ``kda`` target): a low-rank correction of that exponent per key channel, so each
  channel decays on its own (:mod:`linearize.layers.channel_decay`; zero init: the gdn block exactly);
- ``beta_proj``: a bounded factor on β, ``2σ(w·x_t + b)`` ∈ (0, 2) (zero init → 1);
- ``q_conv/k_conv/v_conv`` (with ``GDNOptions.short_conv``): a short causal depthwise convolution on the
  projections' outputs (:mod:`linearize.layers.short_conv`; identity init);
- ``mix_bias`` (with ``GDNOptions.window``): exact softmax over a sliding window and the attention sinks,
  the Taylor-GDN over the older tokens, mixed by their share of the softmax mass, with this per-head
  correction on the older part's normalizer (:mod:`linearize.ops.window`; 0 at init, where the block is
  the teacher exactly for the first ``window + sinks`` tokens);
- ``cache_probe`` (with ``GDNOptions.sparse_cache``, a buffer: no gradient reaches it): the score that picks,
  per KV head, which older tokens a sparse exact cache keeps beside the window (:mod:`linearize.ops.sparse_cache`;
  fitted at convert by :meth:`GDNAttention.fit_cache_probe`);
- ``out_gate`` (with ``GDNOptions.output_gate``): a gate and mixed RMSNorm on the output before ``o_proj``
  (:mod:`linearize.layers.output_gate`; identity init);
- ``write_gate`` (with ``GDNOptions.write_gate``): a strength ``exp(w·v + b)`` on each token's write into the
  state (:mod:`linearize.layers.write_gate`; 1 at init).
"""

from __future__ import annotations

import torch
from torch import nn

from ..compat import attention_cache
from ..models.adapters import head_counts, project_qkv
from ..ops import compute_dtype, gated_delta_rule, gated_delta_rule_step
from ..ops import sparse_cache as sc
from ..ops.decode import taylor_gdn_step_
from ..ops.kda import scale_log_decay
from ..ops.taylor import calibrate_rho, correction_factors, fold_decay, taylor_back, taylor_front
from ..ops.window import (
    flex_usable,
    mix_by_mass,
    normalizer_gap,
    sink_window_flex,
    sink_window_softmax,
    window_triton_usable,
)
from ..ops.window_inputs import WindowBuffers, cached_inputs, fresh_inputs
from ..ops.window_step import sink_window_gdn_step_
from .cache import gdn_cache_layer
from .channel_decay import ChannelDecay
from .options import GDNOptions
from .output_gate import OutputGate
from .packing import by_rows, flatten_rows, packed_cu_seqlens, token_mask
from .paths import fused_path, fused_window_path, operator_dtype
from .short_conv import CONV_NAMES, conv_qkv, identity_weight, since_document_start
from .step_projection import step_projections
from .window_front import composed_old_stream, fused_old_stream
from .write_gate import WriteGate


class GDNAttention(nn.Module):
    """Gated DeltaNet attention initialized from a softmax attention module's weights."""

    fused_step = True  # False: decode steps through the composed ops, the reference the fused step is tested on
    stacked_step = True  # False: a fused step's projections one product each (layers/step_projection.py)

    def __init__(self, teacher: nn.Module, options: GDNOptions | None = None):
        super().__init__()
        self.options = options or GDNOptions()
        self.config = teacher.config
        self.layer_idx = teacher.layer_idx
        self.head_dim = teacher.head_dim
        self.scaling = float(teacher.scaling)
        self.num_heads, self.num_kv_heads = head_counts(teacher)
        self.is_causal = True
        # the teacher's own modules, reused as they are
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = teacher.q_proj, teacher.k_proj, teacher.v_proj, teacher.o_proj
        if getattr(teacher, "q_norm", None) is not None:
            self.q_norm, self.k_norm = teacher.q_norm, teacher.k_norm
        # new parameters, identity at init
        hidden = self.q_proj.in_features
        p = self.q_proj.weight
        self.decays = self.options.target != "deltanet"  # deltanet: α ≡ 1, no gate
        self.per_channel = self.options.target == "kda"  # kda: one decay per key channel
        self._add_corrections(hidden, p)
        if self.options.short_conv:  # [H·D, K] depthwise taps each, on q_proj/k_proj/v_proj's outputs
            widths = (self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features)
            for name, width in zip(CONV_NAMES, widths):
                setattr(self, name, nn.Parameter(identity_weight(width, self.options.short_conv, p.device, p.dtype)))
        if self.options.window:  # per query head, on log Z of the tokens older than the window and the sinks
            self.mix_bias = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32, device=p.device))
        if self.options.output_gate:
            self.out_gate = OutputGate(hidden, self.num_heads, self.head_dim, device=p.device, dtype=p.dtype)
        if self.options.write_gate:  # the fused step kernels know no write strength: steps take the composed ops
            self.write_gate = WriteGate(self.num_kv_heads, self.head_dim, device=p.device)
            self.fused_step = False
        if self.options.mix_order == 2:  # nor the old keys' second moment
            self.fused_step = False
        if self.options.sparse_cache:
            self._add_cache_probe()

    def _add_cache_probe(self) -> None:  # the sparse cache's score, zero until fitted: its weights, then its bias
        self.register_buffer("cache_probe", self.q_proj.weight.new_zeros(self.num_kv_heads, self.q_proj.in_features + 1))

    def add_sparse_cache(self, size: int) -> None:
        """A sparse cache of ``size`` slots for a window block without one; its probe zero until fitted."""
        if self.options.sparse_cache:
            raise ValueError(f"the block has a sparse cache of {self.options.sparse_cache} already")
        from dataclasses import replace
        self.options = replace(self.options, sparse_cache=size)  # (checked there: a window block)
        self._add_cache_probe()

    def _add_corrections(self, hidden: int, p: torch.Tensor) -> None:
        """The Taylor-GDN's own parameters: ρ, the β factor and, where the state decays, the decay correction."""
        self.rho = nn.Parameter(torch.ones(self.num_kv_heads, dtype=torch.float32, device=p.device))
        self.beta_proj = nn.Linear(hidden, self.num_kv_heads, device=p.device, dtype=p.dtype)
        if self.decays:
            self.gate_proj = nn.Linear(hidden, self.num_kv_heads, device=p.device, dtype=p.dtype)
        for lin in (self.beta_proj, *([self.gate_proj] if self.decays else [])):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        if self.per_channel:
            self.channel_gate_proj = ChannelDecay(hidden, self.num_kv_heads, self.head_dim, self.options.decay_rank,
                                                  device=p.device, dtype=p.dtype)

    @torch.no_grad()
    def calibrate(self, hidden_states: torch.Tensor, position_embeddings) -> None:
        """Set ρ per KV head to the mean norm of the scaled queries on calibration activations; with a window
        (and ``calibrate_mix``), ``mix_bias`` per head to the mean gap of the mix's normalizer (its order) there."""
        mix = (lambda q, k, v: conv_qkv(self, q, k, v)[:3]) if self.options.short_conv else None  # noqa: E731
        q, _, _ = project_qkv(self, hidden_states, position_embeddings, mix=mix)
        rho = calibrate_rho(q.float() * self.scaling, self.num_kv_heads)
        if rho.shape != self.rho.shape:  # copy_ would broadcast a wrong shape silently
            raise RuntimeError(f"calibrated rho has shape {tuple(rho.shape)}; the block has {tuple(self.rho.shape)} KV heads")
        self.rho.copy_(rho)
        if self.options.window and self.options.calibrate_mix:  # the mix's normalizer gap, per head, on these rows
            q, k, _ = project_qkv(self, hidden_states, position_embeddings, mix=mix)
            self.mix_bias.copy_(normalizer_gap(q.float() * self.scaling, k.float(), self.options.window, self.options.sinks,
                                              self.options.mix_order))

    @torch.no_grad()
    def fit_cache_probe(self, hidden_states: torch.Tensor, position_embeddings) -> None:
        """Fit ``cache_probe`` (``GDNOptions.sparse_cache``) by ridge regression: per KV head, the block's input
        at a token against the log of the largest attention the teacher's q/k (the block's own at conversion)
        pay it from ``window`` or more tokens later, on these rows (each one document from its start)."""
        mix = (lambda q, k, v: conv_qkv(self, q, k, v)[:3]) if self.options.short_conv else None  # noqa: E731
        q, k, _ = project_qkv(self, hidden_states, position_embeddings, mix=mix)
        dev = "cuda" if torch.cuda.is_available() else q.device  # float64 T×T softmaxes: minutes on a CPU
        target = sc.far_attention(q.to(dev).double() * self.scaling, k.to(dev), self.options.window)
        self.cache_probe.copy_(sc.fit_probe(hidden_states.to(dev), target))

    def project(self, hidden_states, position_embeddings, mask=None, cu_seqlens=None, fused=False, conv_past=None,
                projections=None):
        """``(q, k, v, conv_tails)`` after the norms and RoPE, before the softmax scale; with ``short_conv``
        q/k/v convolved first (``conv_past``/``conv_tails``: the cache's last inputs before and after)."""
        tails = None
        mix = None
        if self.options.short_conv:
            since = since_document_start(cu_seqlens, hidden_states.shape[1]) if cu_seqlens is not None else None

            def mix(q, k, v):
                nonlocal tails
                *qkv, tails = conv_qkv(self, q, k, v, mask, since, conv_past)
                return qkv

        q, k, v = project_qkv(self, hidden_states, position_embeddings, fused=fused, mix=mix, projections=projections)
        return q, k, v, tails

    def gdn_inputs(self, hidden_states, position_embeddings, mask=None, initial=None, cu_seqlens=None, fused=False,
                   conv_past=None):
        """``(q, scale, front, conv_tails)``: q and the Taylor front's GDN inputs; the operator takes ``scale·q``.
        With ``short_conv``, q/k/v are convolved first (``conv_past``: the cache's last inputs, see
        :func:`conv_qkv`) and ``conv_tails`` are the last inputs to cache; otherwise it is None.

        PyTorch front: everything in float32 (float64 if the model is), q scaled (scale 1). Fused front
        (``fused``, as :func:`fused_path` decides: the Triton kernels, ``front.sums`` None): q, k̂ and u
        stay in the model's dtype — the kernels compute in float32 inside and the operator applies the
        softmax scale — so a bf16 model makes no float32 copies of q, k, v; g, β and v̄ are float32."""
        q, k, v, tails = self.project(hidden_states, position_embeddings, mask, cu_seqlens, fused, conv_past)
        dt = compute_dtype(q.dtype)
        beta_factor, gate_factor = correction_factors(*self._logits(hidden_states), dt)
        if fused:
            from ..ops.taylor import TaylorInputs
            from ..ops.triton.front import taylor_front_triton

            kh, u, g, beta, v_mean = taylor_front_triton(k, v, self.rho.to(dt), self.options.beta_max,
                                                         beta_factor=beta_factor, cu_seqlens=cu_seqlens)
            front = TaylorInputs(k=kh, v=u, g=g, beta=beta, v_mean=v_mean, sums=None)
            scale = self.scaling
        else:
            q, k, v = q.to(dt) * self.scaling, k.to(dt), v.to(dt)
            front = taylor_front(
                q, k, v, form=self.options.form, rho=self.rho.to(dt), beta_max=self.options.beta_max,
                beta_factor=beta_factor, mask=mask, initial=initial, cu_seqlens=cu_seqlens,
                write_factor=self.write_gate(v) if self.options.write_gate else None,
            )
            scale = 1.0
        front.g = scale_log_decay(front.g, gate_factor)
        if not self.decays:
            q, front = fold_decay(q, front)
        return q, scale, front, tails

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        B, T, _ = hidden_states.shape
        cache = attention_cache(past_key_values, cache)
        use_cache = cache is not None and kwargs.get("use_cache", True) is not False
        layer = gdn_cache_layer(cache, self.layer_idx, own_columns=self._no_softmax_layer()) if use_cache else None
        initial = layer.sums if layer is not None and layer.state is not None else None
        h0 = layer.state if initial is not None else None
        conv_past = layer.conv_inputs if initial is not None else None

        # a decode step of linearize.decoding: one new real token per row, whatever mask the model built
        # (reading it would sync with the host, which a captured CUDA graph cannot)
        mask = None if kwargs.get("decode_step") and T == 1 else token_mask(attention_mask, B, T)
        if layer is None and mask is None:  # training/scoring: packed documents restart the state
            return self.o_proj(self._fresh_output(hidden_states, position_embeddings, kwargs.get("position_ids"))), None
        buffers = sparse = None
        if self.options.window:
            o, state, sums, tails, buffers, sparse = self._attend_window(hidden_states, position_embeddings, mask, layer)
        else:
            o, state, sums, tails = self._attend(hidden_states, position_embeddings, mask, initial, h0, use_cache,
                                                 conv_past=conv_past)
        if layer is not None:
            layer.set_state(state, sums, T, tails, buffers, sparse)
        return self.o_proj(self._gated(o, hidden_states)), None

    def _no_softmax_layer(self) -> bool:
        """True where this block's model keeps no softmax layer (a converted config says so); a block alone: False."""
        info = getattr(getattr(self, "config", None), "linearize", None)
        return isinstance(info, dict) and info.get("softmax_layers") == []

    def attention_output(self, hidden_states: torch.Tensor, position_embeddings, position_ids=None,
                         mask=None) -> torch.Tensor:
        """The block's output before ``o_proj``, ``(B, T, Hq·D)``, from a fresh state: what the
        teacher's attention computes before its ``o_proj``. Documents packed in a row (positions
        restarting, as in transformers' packed format) each start from a fresh state and fresh means.
        (Public for callers outside ``forward``, which may register it as an FSDP forward method;
        ``forward`` itself calls the unregistered body, so FSDP does not reshard before ``o_proj``.)"""
        return self._fresh_output(hidden_states, position_embeddings, position_ids, mask)

    def _fresh_output(self, hidden_states, position_embeddings, position_ids=None, mask=None) -> torch.Tensor:
        B, T, _ = hidden_states.shape
        cu = packed_cu_seqlens(position_ids) if position_ids is not None and mask is None else None
        attend = self._attend_window if self.options.window else self._attend
        if cu is None:
            o = attend(hidden_states, position_embeddings, mask)[0]
        else:  # one flat row; the window block's exact part then runs row by row (its cost grows with the row)
            (flat,), pe = flatten_rows([hidden_states], position_embeddings)
            rows = {"rows": B} if self.options.window else {}
            o = attend(flat, pe, None, cu_seqlens=cu, **rows)[0].view(B, T, -1)
        return self._gated(o, hidden_states)

    def _logits(self, hidden_states: torch.Tensor, proj=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``beta_proj`` and ``gate_proj`` outputs ``(B, T, H)`` (the gate's 0 without a decay; ``proj``: a
        step's stacked products), the gate's per key channel ``(B, T, H, K)`` in the kda target."""
        if proj:
            beta, gate = proj[3:]
        else:
            beta = self.beta_proj(hidden_states)
            gate = self.gate_proj(hidden_states) if self.decays else torch.zeros_like(beta)
        return beta, self.channel_gate_proj(hidden_states, gate) if self.per_channel else gate

    def _gated(self, o: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.out_gate(o, hidden_states) if self.options.output_gate else o

    def _attend_window(self, hidden_states, position_embeddings, mask, layer=None, cu_seqlens=None, rows=1):
        """The sink + sliding-window block (``GDNOptions.window``): exact softmax over each query's window and
        sinks, the Taylor-GDN over the older tokens — fed the token leaving the window at every step
        (:mod:`~linearize.layers.window_front`) — mixed by :func:`mix_by_mass`. ``layer``: the cache layer to
        continue from (None: a fresh sequence).
        Returns ``(o, state, sums, conv_tails, window buffers, sparse-cache buffers)``. The β and decay
        corrections are read off the current token, as in GDN. With ``sparse_cache`` the exact part also
        covers each query's cache (:mod:`linearize.ops.sparse_cache`). ``rows``: a flattened batch's rows."""
        B, T, _ = hidden_states.shape
        W, S = self.options.window, self.options.sinks
        h0 = layer.state if layer is not None else None
        conv_past = layer.conv_inputs if h0 is not None else None
        if T == 1 and h0 is not None and mask is None and self.options.form == "stable" and self.fused_step:
            return self._step(hidden_states, position_embeddings, None, layer.sums, h0, conv_past, layer.window_buffers,
                              layer.cache_buffers)
        # the old stream through the fused front, and RoPE through its Triton pass: a fresh sequence, or a
        # prompt's prefill into an empty cache (rows: the fused path returns their state)
        fused = fused_window_path(self.options, hidden_states, mask, fresh=layer is None or (h0 is None and cu_seqlens is None))
        q, k, v, tails = self.project(hidden_states, position_embeddings, mask, cu_seqlens, fused, conv_past=conv_past)
        dt = compute_dtype(q.dtype)
        C, sparse = self.options.sparse_cache, None
        # a prefill or scoring on the fused front and the window and mix kernels reads q in the model's dtype at
        # every step (the kernels cast it so anyway); every other path scales it in float32
        lean = fused and not C and window_triton_usable(q, self.options.backend)
        q = q * self.scaling if lean else q.to(dt) * self.scaling
        flex = layer is None and flex_usable(q)  # a fresh sequence in training on CUDA: one fused kernel
        if layer is None:
            inp, buffers = fresh_inputs(k, v, W, S, cu_seqlens, mask, gather_sinks=not flex), None
        else:
            past = layer.window_buffers if h0 is not None else WindowBuffers.empty(k, W, S)
            inp, buffers = cached_inputs(k, v, past, W, S, mask)
        if C:  # each token's selection key, from its position in its document
            token_key = sc.token_keys(hidden_states, self.cache_probe, inp.pos, S)
        if flex and C:
            o_exact, lse = by_rows(sc.sink_window_cache_flex, rows, q, k, v, inp.key_doc[:, W:], inp.query_doc, inp.pos,
                                   W, S, token_key, inp.old_ok, C)
        elif flex:
            o_exact, lse = by_rows(sink_window_flex, rows, q, k, v, inp.key_doc[:, W:], inp.query_doc, inp.pos, W, S)
        elif window_triton_usable(q, self.options.backend):  # a prefill or scoring: one kernel, q in the keys' dtype
            from ..ops.triton.window_fwd import sink_window_triton

            kd = inp.k.dtype
            o_exact, lse = sink_window_triton(q.to(kd), inp.k, inp.v, inp.key_doc, inp.query_doc, W,
                                              *(None if x is None else x.to(kd) for x in (inp.sink_k, inp.sink_v)),
                                              inp.sink_ok)
        else:
            o_exact, lse = sink_window_softmax(q, inp.k, inp.v, inp.key_doc, inp.query_doc, W, inp.sink_k, inp.sink_v,
                                               inp.sink_ok)
        if C and not flex:  # the cache beside the window and sinks, under one normalizer
            if layer is None:
                o_c, lse_c = by_rows(sc.fresh_cache, rows, q, inp.old_k, inp.old_v, inp.old_ok, token_key,
                                     inp.key_doc[:, :T], inp.query_doc, W, C)
            else:
                cpast = layer.cache_buffers if h0 is not None else sc.CacheBuffers.empty(k, C, W)
                args = (q, inp.old_k, inp.old_v, inp.old_ok, token_key, cpast, W)  # a decode step: in place
                o_c, lse_c, sparse = sc.cache_step_(*args) if T == 1 else \
                    sc.cached_cache(*args, C, self.options.backend, fresh=h0 is None)
            o_exact, lse = sc.merge_softmax(o_exact, lse, o_c, lse_c)
        beta_logit, gate_logit = self._logits(hidden_states)
        if mask is not None:  # a padding slot still writes the token leaving the window: with factors 1
            m = mask[(...,) + (None,) * (gate_logit.dim() - 2)]  # (B, T, 1) or, per channel, (B, T, 1, 1)
            beta_logit, gate_logit = beta_logit * mask[..., None], gate_logit * m
        beta_factor, gate_factor = correction_factors(beta_logit, gate_logit, dt)
        old = (fused_old_stream if fused else composed_old_stream)(self, q, inp, beta_factor, gate_factor, cu_seqlens,
                                                                   layer, hidden_states.dtype)
        o = mix_by_mass(o_exact, lse, old.o, q, old.k_mean, old.count, self.mix_bias, old.square_sum,
                        self.options.backend, out_dtype=hidden_states.dtype)
        return o.reshape(B, T, -1), old.state, old.sums, tails, buffers, sparse

    def _attend(self, hidden_states, position_embeddings, mask, initial=None, h0=None, output_final_state=False,
                cu_seqlens=None, conv_past=None):
        B, T, _ = hidden_states.shape
        if T == 1 and h0 is not None and self.options.form == "stable" and self.decays and self.fused_step:
            return self._step(hidden_states, position_embeddings, mask, initial, h0, conv_past)
        fused = fused_path(self.options, hidden_states, mask, initial, output_final_state)
        q, scale, front, tails = self.gdn_inputs(hidden_states, position_embeddings, mask, initial, cu_seqlens, fused,
                                                 conv_past)
        if T == 1 and h0 is not None:  # one decode step: a rank-1 update and a mat-vec per KV head (never fused)
            o, state = gated_delta_rule_step(q[:, 0], front.k[:, 0], front.v[:, 0], front.g[:, 0], front.beta[:, 0], h0)
            o = taylor_back(o[:, None], front.v_mean)  # (B, 1, Hq, V)
        else:
            # the front computes in float32 (prefix sums over long documents); the chunkwise operator runs in
            # the model's own precision — bf16/fp16 tensor cores on the GPU, float32 state inside — like
            # the softmax attention it replaces. g and β stay float32. (On the fused path q, k̂, u already
            # are in that precision and these casts do nothing.) The Taylor back ``+ v̄`` is the operator's
            # v_offset: the Triton backend adds it in its output kernel.
            cdt = operator_dtype(hidden_states.dtype, q.dtype)
            o, state = gated_delta_rule(
                q=q.to(cdt), k=front.k.to(cdt), v=front.v.to(cdt), g=front.g if self.decays else None, beta=front.beta,
                scale=scale, initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                backend=self.options.backend, v_offset=front.v_mean,
            )  # (B, T, Hq, V)
        return o.reshape(B, T, -1).to(hidden_states.dtype), state, front.sums, tails

    def step_inputs(self, hidden_states, position_embeddings, mask, conv_past, proj, dt, scaled):
        """A decode step's ``(q, k, v, conv_tails, beta_factor, gate_factor)``, ``q`` scaled in ``dt`` where ``scaled``
        (the window's step takes it so): all its element-wise work before the step kernel, one region to compile."""
        q, k, v, tails = self.project(hidden_states, position_embeddings, mask, conv_past=conv_past,
                                      projections=proj and proj[:3])
        q = q.to(dt) * self.scaling if scaled else q
        return q, k, v, tails, *correction_factors(*self._logits(hidden_states, proj), dt)

    def _step(self, hidden_states, position_embeddings, mask, sums, h0, conv_past=None, buffers=None, cache=None,
              proj=None):
        """One decode step updating the cache's state, sums (and window ``buffers``) in place, in one kernel on
        CUDA: :func:`~linearize.ops.decode.taylor_gdn_step_`, :func:`~linearize.ops.window_step.sink_window_gdn_step_`.
        ``proj``: the :func:`~linearize.layers.step_projection.step_projections` of ``hidden_states``, if made already."""
        B = hidden_states.shape[0]
        proj = proj or (step_projections(self, hidden_states) if self.stacked_step else None)  # one product for five
        dt, backend = h0.dtype, {"reference": "torch"}.get(self.options.backend, self.options.backend)
        if self.per_channel:  # the decode-step kernels take one decay per head: kda's step is the torch body
            backend = "torch"
        q, k, v, tails, beta_factor, gate_factor = self.step_inputs(hidden_states, position_embeddings, mask, conv_past,
                                                                    proj, dt, buffers is not None)
        common = (h0, sums.k, sums.v, sums.count, self.rho.to(dt), beta_factor[:, 0], gate_factor[:, 0])
        if buffers is not None:  # (with a sparse cache, the probe that scores the new token: the step keys it)
            probe = None if cache is None else (hidden_states[:, 0], self.cache_probe)
            o = sink_window_gdn_step_(q[:, 0], k[:, 0], v[:, 0], buffers, *common, self.mix_bias,
                                      self.options.beta_max, self.options.window, self.options.sinks,
                                      decays=self.decays, backend=backend, cache=cache, probe=probe)
            return o.reshape(B, 1, -1).to(hidden_states.dtype), h0, sums, tails, buffers, cache
        o = taylor_gdn_step_(q[:, 0], k[:, 0], v[:, 0], *common, self.options.beta_max, self.scaling,
                             mask=None if mask is None else mask[:, 0], backend=backend)
        return o.reshape(B, 1, -1).to(hidden_states.dtype), h0, sums, tails
