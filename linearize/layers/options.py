"""How a converted block computes, and the names users may give it. Torch-free, so the CLI and the
recipe schema can check a form or target name before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

# the Taylor forms of SPEC §2: "stable" (bounded c_t = ρ k̂_t, the default) and "seed" (the literal
# form of seed 000, c_t = k̃_t, which diverges on real checkpoints: kept for study)
FORMS = ("stable", "seed")
# what `convert --to` builds: the gated delta rule, the delta rule without a decay (the same Taylor
# initialization, exactly: linearize.ops.taylor.fold_decay), VaLA, the first-order linear attention of
# seed 000 with a learnable decay correction (linearize.layers.vala_attention), or KDA, the gated delta rule
# with one decay per key channel (linearize.layers.channel_decay; the gdn block exactly at init)
TARGETS = ("gdn", "deltanet", "linear", "kda")
# how `--keep-softmax N` picks its N layers: the worst-initialized ("error"), or the strongest long-range
# induction heads ("induction", linearize.retrieval)
KEEP_RULES = ("error", "induction")


def keep_count(spec) -> tuple[int, str] | None:
    """``(N, rule)`` of a ``--keep-softmax`` count, ``"N"`` or ``"N:rule"`` (an int: rule "error"); None for
    indices (``"3,7"``, ``"5,"``). Raises ValueError for a rule not in :data:`KEEP_RULES`."""
    if isinstance(spec, int):
        return spec, "error"
    count, colon, rule = str(spec).strip().partition(":")
    if not count.strip().isdigit():
        return None
    rule = rule.strip() if colon else "error"
    if rule not in KEEP_RULES:
        raise ValueError(f"the rule after ':' must be one of {', '.join(KEEP_RULES)} (e.g. '{count.strip()}:induction')")
    return int(count), rule
BACKENDS = ("auto", "torch", "triton", "reference")
DEFAULT_BETA_MAX = 1.0


def check_form(form: str, what: str = "form") -> str:
    if form not in FORMS:
        raise ValueError(f"{what} must be one of {', '.join(repr(f) for f in FORMS)}; got {form!r}")
    return form


def check_target(to: str, what: str = "--to") -> str:
    if to not in TARGETS:
        raise ValueError(f"{what} {to!r} is not supported; supported targets: {', '.join(TARGETS)}")
    return to


@dataclass
class GDNOptions:
    """How a converted block computes; saved in config.json under ``linearize``."""

    form: str = "stable"  # one of FORMS
    target: str = "gdn"  # one of TARGETS
    beta_max: float = DEFAULT_BETA_MAX
    backend: str = "auto"  # one of BACKENDS
    # the Taylor front as one Triton kernel each way (ops/triton/front.py) instead of ~30 PyTorch ops:
    # None = on CUDA, True = wherever Triton runs (also TRITON_INTERPRET=1 on the CPU, for tests), False = never;
    # the window block's old stream by default only where no gradient is wanted (layers.paths.fused_window_path)
    fused_front: bool | None = None
    # a learnable causal depthwise convolution of this kernel size on q, k and v (identity at init; 0 = off)
    short_conv: int = 0
    # exact softmax over each query's last `window` tokens (itself included) and its document's first
    # `sinks` tokens, the Taylor-GDN over every other earlier token, mixed by their share of the softmax
    # mass (linearize.ops.window); 0 = off (the pure Taylor-GDN block)
    window: int = 0
    sinks: int = 0
    # at convert, set the mix's per-head normalizer correction (mix_bias) to its mean gap on the calibration
    # text instead of 0. On SmolLM2 at conversion: median layer error 0.221 -> 0.200 but perplexity 12.0 ->
    # 12.6 (teacher 10.6), so it is off by default until a training ablation says otherwise
    calibrate_mix: bool = False
    # the window block's estimate of the older tokens' normalizer: 1 = first order (log n + q·k̄), 2 = second
    # order (+ ½ the variance of the query's logits over them, from a running Σkkᵀ: a second state the size of
    # the GDN state). A retrieval head picks one token out of thousands, where the first order puts the old
    # share near 0 and the mix's gradient with it (scripts/retrieval_capacity.py). Decode steps then take the
    # composed ops, not the fused step kernels
    mix_order: int = 1
    # a gate and a mixed RMSNorm on the output before o_proj (linearize.layers.output_gate; identity at init)
    output_gate: bool = False
    # the kda target: rank of the low-rank per-channel decay correction (linearize.layers.channel_decay)
    decay_rank: int = 16
    # a learnable strength on each token's write into the state, exp(w·v + b) per KV head (linearize.layers.
    # write_gate; 1 at init). Decode steps then take the composed ops, not the fused step kernels
    write_gate: bool = False
    # with a window: an exact cache of this many older tokens per KV head beside the window and sinks, chosen
    # as they leave the window by a probe fitted at convert (linearize.ops.sparse_cache); decoding keeps them
    # at a fixed size. 0 = off. Decode steps then take the composed ops, not the fused step kernels
    sparse_cache: int = 0

    def __post_init__(self):
        check_form(self.form)
        check_target(self.target, "target")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if not (self.beta_max > 0 and self.beta_max < float("inf")):
            raise ValueError(f"beta_max must be a positive number; got {self.beta_max!r}")
        k = self.short_conv
        if isinstance(k, bool) or not isinstance(k, int) or not (k == 0 or 2 <= k <= 8):
            raise ValueError(f"short_conv must be 0 (off) or a kernel size from 2 to 8; got {k!r}")
        for name, lo in (("window", 0), ("sinks", 0)):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < lo or n > 65536:
                raise ValueError(f"{name} must be a whole number of tokens from 0 to 65536; got {n!r}")
        if self.sinks and not self.window:
            raise ValueError(f"sinks={self.sinks} needs a window: set window (e.g. 64) or sinks=0")
        if self.target == "linear":
            _check_linear(self)
        r = self.decay_rank
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 4096:
            raise ValueError(f"decay_rank must be a whole number from 1 to 4096; got {r!r}")
        if not isinstance(self.calibrate_mix, bool):
            raise ValueError(f"calibrate_mix must be true or false; got {self.calibrate_mix!r}")
        if self.mix_order not in (1, 2) or isinstance(self.mix_order, bool):
            raise ValueError(f"mix_order must be 1 (first-order normalizer) or 2 (second order); got {self.mix_order!r}")
        if self.mix_order == 2 and not self.window:
            raise ValueError("mix_order=2 is an option of the sink + sliding-window block: set window (e.g. 64)")
        if not isinstance(self.write_gate, bool):
            raise ValueError(f"write_gate must be true or false; got {self.write_gate!r}")
        if self.write_gate and self.target == "linear":
            raise ValueError("write_gate is an option of the delta-rule targets (gdn, deltanet, kda), not of linear")
        c = self.sparse_cache
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= 65536:
            raise ValueError(f"sparse_cache must be a whole number of tokens from 0 (off) to 65536; got {c!r}")
        if c and not self.window:
            raise ValueError(f"sparse_cache={c} is an option of the sink + sliding-window block: set window (e.g. 64)")
        if not isinstance(self.output_gate, bool):
            raise ValueError(f"output_gate must be true or false; got {self.output_gate!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def _check_linear(o: GDNOptions) -> None:
    """What the linear (VaLA) target does not have: one error naming the setting to change."""
    if o.window or o.sinks:
        raise ValueError(f"window must be 0 for the linear target (it has no sink/window form); got window={o.window}, "
                         f"sinks={o.sinks}: set window=0 and sinks=0 (CLI: --window 0), or convert to gdn or deltanet")
    if o.form != "stable":
        raise ValueError(f"form must be 'stable' for the linear target (the other forms are Taylor-GDN ones); got {o.form!r}")


def resize_sparse_cache(model, size: int) -> int:
    """Give every converted block of ``model`` that has a sparse cache ``size`` slots per KV head instead of the
    ones it was converted or trained with — its probe, which picks the tokens, does not depend on the size — to
    evaluate or decode with more (or less) exact memory. Returns the blocks changed (0: the model has no cache)."""
    if size < 1:
        raise ValueError(f"a sparse cache needs at least 1 slot; got {size}")
    changed = 0
    for module in model.modules():
        opts = getattr(module, "options", None)
        if isinstance(opts, GDNOptions) and opts.sparse_cache:
            module.options = replace(opts, sparse_cache=size)
            changed += 1
    if changed:
        save_option(model, "sparse_cache", size)
    return changed


def save_option(model, name: str, value) -> None:
    """Set a block option in what ``save_pretrained`` writes (``config.linearize["options"]``), where there is one."""
    saved = (getattr(model.config, "linearize", None) or {}).get("options")
    if isinstance(saved, dict):
        saved[name] = value
