"""Decoding a converted model: prefill through the chunkwise kernels, then one step per token, the step
of the whole model replayed from a CUDA graph.

A GDN layer's decoding state has a fixed size (the state, the running sums, the window's ring of keys
and values: :mod:`linearize.layers.cache`), and transformers' cache layers update it in place, so the
step of the whole model — embedding, every block, the head — reads and writes the same memory at every
position. Captured once per batch, it replays with no Python and no kernel-launch cost per layer; the
host only picks the next token and, every ``check_every`` steps, looks for the end of text. The softmax
layers a hybrid keeps decode from fixed-size key/value buffers (a bucket of slots past the prompt) under
a 4-D mask of the slots written so far, so their step is recorded in the same graph; softmax layers of
sliding-window attention, or attention kernels that take no 4-D mask, decode eagerly.

    dec = Decoder(model)                      # graph=None: on CUDA, when the step has fixed shapes
    out = dec.generate(ids, attention_mask=mask, max_new_tokens=64, eos_token_id=tok.eos_token_id)

Greedy decoding gives the tokens ``model.generate(do_sample=False)`` gives; sampling applies the
temperature, then top-k, then top-p, in the order transformers' logits processors do.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
import warnings
from dataclasses import dataclass

import torch

from .compat import cache_kwargs
from .compiling import compiled_blocks, compiled_steps
from .generation import Sampling, next_tokens, plain_generate_kwargs
from .layers.cache import GDNStateLayer, StaticKVLayer, StaticMask
from .layers.gdn_attention import GDNAttention
from .layers.step_projection import refresh as refresh_stacked


@dataclass
class Timing:
    """Of the last ``generate``: seconds of prefill, decode loop (capture included) and capture; steps run."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0
    steps: int = 0
    graphed: bool = False


def graph_generate(model, inputs: torch.Tensor | None, kwargs: dict) -> torch.Tensor | None:
    """What a converted model's ``generate()`` returns through the CUDA-graph decoder — on CUDA, when the step has
    fixed shapes (:func:`graphable`) and the call is plain (:func:`plain_generate_kwargs`) — or None (transformers')."""
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    rest = {k: v for k, v in kwargs.items() if k != "input_ids"}
    if not (torch.is_tensor(ids) and ids.dim() == 2 and ids.is_cuda and graphable(model)):
        return None
    plan = plain_generate_kwargs(model, rest)
    if plan is None or _GRAPH_FAILED:
        return None
    try:
        return model_decoder(model).generate(ids, **plan)
    except Exception as e:  # a capture this torch/transformers/Triton cannot do: say so once, then decode eagerly
        _GRAPH_FAILED.append(repr(e))
        warnings.warn(f"linearize: CUDA-graph decoding failed ({str(e)[:200]}); generate() uses transformers' "
                      "own decoding from now on", RuntimeWarning, stacklevel=3)
        return None


_GRAPH_FAILED: list[str] = []


def model_decoder(model) -> Decoder:
    """The graph decoder kept on ``model``, so that repeated ``generate()`` calls replay the graphs it has
    captured (one per batch size) instead of capturing again."""
    dec = model.__dict__.get("_linearize_decoder")
    if dec is None:
        dec = Decoder(model, graph=True)
        model.__dict__["_linearize_decoder"] = dec  # a plain attribute: not a submodule, not saved
    return dec


def all_gdn(model) -> bool:
    lin = getattr(model.config, "linearize", None) or {}
    return bool(lin.get("gdn_layers")) and not lin.get("softmax_layers")


def graphable(model) -> bool:
    """Whether the decode step of ``model`` has fixed shapes (what a CUDA graph records): every layer GDN, or
    softmax layers of full (not sliding-window) attention through SDPA or eager attention, whose keys and
    values then sit in fixed-size buffers (:class:`~linearize.layers.cache.StaticKVLayer`); a sparse cache is fixed-size."""
    if all_gdn(model):
        return True
    cfg = model.config
    softmax = (getattr(cfg, "linearize", None) or {}).get("softmax_layers") or []
    types = getattr(cfg, "layer_types", None)
    sliding = (any(types[i] != "full_attention" for i in softmax) if types is not None
               else getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True))
    return bool(softmax) and not sliding and getattr(cfg, "_attn_implementation", None) in ("sdpa", "eager")


class Decoder:
    """Generation for one converted model.

    With ``graph``, the step is captured once per batch size (three steps and the recording, in
    ``timing.capture_s``) on a cache the decoder then keeps: a later call of the same batch size prefills
    into a fresh cache, copies its fixed-size states into the kept one and replays the same graph. The
    model's weights must stay where they were captured: a decoder that finds them moved (``.to()``, a
    reload) captures again. ``static`` (default: as ``graph``) decodes on those fixed-size buffers without
    a graph: the recorded step, run eagerly. ``compile``: the graph is recorded with the blocks' norms,
    MLPs and GDN step inputs compiled (:func:`~linearize.compiling.compiled_blocks`); without a graph (a CPU),
    every GDN block's decode step is compiled instead (:func:`~linearize.compiling.compiled_steps`).

    The softmax layers of a hybrid model decode from fixed-size key/value buffers of the prompt's length
    plus ``max_new_tokens``, rounded up to ``kv_bucket`` (one graph per batch size and bucket), through a
    4-D mask of the slots written so far. ``prefill_chunk`` feeds the prompt that many tokens at a time
    (the states carried from chunk to chunk), so the prefill's activations — and its peak memory, for a
    model of GDN layers — stay those of one chunk however long the prompt."""

    def __init__(self, model, graph: bool | None = None, check_every: int = 8, compile: bool = False,
                 static: bool | None = None, kv_bucket: int = 256, prefill_chunk: int | None = None):
        self.model = model
        device = next(model.parameters()).device
        fixed = graphable(model)
        if graph and not (device.type == "cuda" and fixed):
            raise ValueError("graph decoding needs a CUDA device and a model whose decode step has fixed shapes "
                             "(GDN layers, softmax layers of full attention through SDPA or eager attention); "
                             "use graph=None or False")
        self.graph = device.type == "cuda" and fixed if graph is None else graph
        self._auto = graph is None  # a capture that fails then decodes eagerly (with a warning) instead of raising
        self.static = self.graph if static is None else static
        if self.static and not fixed:
            raise ValueError("static decoding needs GDN layers and softmax layers of full attention through SDPA "
                             "or eager attention; use static=None or False")
        self.check_every = max(1, check_every)
        self.compile = compile
        self.kv_bucket = max(1, kv_bucket)
        self.prefill_chunk = prefill_chunk  # prompt tokens a prefill call takes (None: all at once)
        self.timing = Timing()
        self._graphs: dict[tuple, tuple] = {}  # (batch, KV slots) -> (weights, cache, mask, ids, pos, logits, run)

    def __deepcopy__(self, memo):  # a copied model (copy.deepcopy) gets a decoder of its own, no graphs
        new = copy.copy(self)
        new.model, new.timing, new._graphs = copy.deepcopy(self.model, memo), Timing(), {}
        return new

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 sampling: Sampling | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(B, T + n)``: the prompts (left-padded where ``attention_mask`` has zeros) and their continuations.
        A row that has produced an end-of-text token continues with ``pad_token_id``; both default to the
        model's ``generation_config``, as in ``model.generate`` (the pad to the first end-of-text token)."""
        args = (input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, sampling, generator)
        try:
            return self._generate(*args)
        except Exception as e:  # a capture this torch/transformers/Triton cannot do: eager from now on, if allowed
            if not (self._auto and self.graph):
                raise
            warnings.warn(f"linearize: CUDA-graph decoding failed ({str(e)[:200]}); this decoder decodes eagerly "
                          "from now on", RuntimeWarning, stacklevel=2)
            self.graph = self.static = False
            self._graphs.clear()
            return self._generate(*args)

    @torch.inference_mode(False)  # the kept buffers must stay writable on later calls, in inference mode or not
    @torch.no_grad()
    def _generate(self, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id, sampling, generator):
        from transformers import DynamicCache

        sampling = sampling or Sampling()
        model, dev = self.model, input_ids.device
        B, T = input_ids.shape
        gc = getattr(model, "generation_config", None)
        eos_token_id = eos_token_id if eos_token_id is not None else getattr(gc, "eos_token_id", None)
        pad_token_id = pad_token_id if pad_token_id is not None else getattr(gc, "pad_token_id", None)
        eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else (eos_token_id or []), device=dev)
        pad = pad_token_id if pad_token_id is not None else (int(eos[0]) if eos.numel() else 0)
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        t0 = _now(dev)
        cache = DynamicCache(config=model.config)
        step = self.prefill_chunk or T  # chunk by chunk, the GDN state carried: activations of one chunk at a time
        for i in range(0, T, step):
            j = min(T, i + step)
            logits = model(input_ids[:, i:j], attention_mask=mask[:, :j], position_ids=pos[:, i:j],
                           **cache_kwargs(cache), use_cache=True, logits_to_keep=1).logits[:, -1]
        self.timing = Timing(prefill_s=_now(dev) - t0, graphed=self.graph)
        t0 = _now(dev)
        if self.static and max_new_tokens > 1:  # (one new token runs no step; a capture's warm-ups run two)
            ids_buf, pos_buf, logits_buf, run = self._static_step(cache, mask, max_new_tokens)
        else:
            ids_buf, pos_buf, logits_buf, run = self._eager_step(cache, mask)
        pos_buf.copy_(pos[:, -1:] + 1)
        out = [input_ids]
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        with compiled_steps(model, self.compile and not self.graph and dev.type == "cpu"):  # (a graph: compiled_blocks)
            for i in range(max_new_tokens):
                nxt = next_tokens(logits, sampling, generator)
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                out.append(nxt[:, None])
                if eos.numel():
                    done |= torch.isin(nxt, eos)
                    if (i + 1) % self.check_every == 0 and bool(done.all()):
                        break
                if i + 1 == max_new_tokens:
                    break
                ids_buf.copy_(nxt[:, None])
                run()
                logits = logits_buf
                self.timing.steps += 1
        self.timing.decode_s = _now(dev) - t0
        return torch.cat(out, 1)

    # the step: reads ids_buf/pos_buf, writes logits_buf, advances pos_buf and the cache ---------------
    def _body(self, cache, ids_buf, pos_buf, logits_buf, mask=None, kv: StaticMask | None = None):
        if kv is not None:  # the new token's slot joins the keys attended to (its key is written there)
            kv.open_slot()
            mask = kv.mask
        logits = self.model(input_ids=ids_buf, position_ids=pos_buf, attention_mask=mask, **cache_kwargs(cache),
                            use_cache=True, logits_to_keep=1, decode_step=True).logits[:, -1]
        logits_buf.copy_(logits)
        pos_buf.add_(1)
        if kv is not None:
            kv.position.add_(1)

    def _buffers(self, B, dev):
        vocab = self.model.get_output_embeddings().weight.shape[0]
        dtype = self.model.get_output_embeddings().weight.dtype
        return (torch.zeros(B, 1, dtype=torch.long, device=dev), torch.zeros(B, 1, dtype=torch.long, device=dev),
                torch.zeros(B, vocab, dtype=dtype, device=dev))

    def _eager_step(self, cache, mask):
        ids_buf, pos_buf, logits_buf = self._buffers(mask.shape[0], mask.device)
        state = {"mask": mask}
        softmax = not all_gdn(self.model)

        def run():  # softmax layers need the padding of the prompt: their mask grows by one column a step
            if softmax:
                state["mask"] = torch.cat([state["mask"], state["mask"].new_ones(mask.shape[0], 1)], 1)
            self._body(cache, ids_buf, pos_buf, logits_buf, state["mask"] if softmax else None)

        return ids_buf, pos_buf, logits_buf, run

    def _static_step(self, cache, mask, max_new_tokens):
        """The step for this batch on fixed-size buffers, continuing from the prefilled ``cache``: a kept one,
        loaded with ``cache``'s states, or a new one built on ``cache`` (and, with ``graph``, recorded)."""
        B, T = mask.shape
        slots = 0 if all_gdn(self.model) else -(-(T + max_new_tokens) // self.kv_bucket) * self.kv_bucket
        kept = self._graphs.get((B, slots))
        t0 = _now(mask.device)
        if kept is not None and kept[0] == _addresses(self.model) and _load_states(kept[1], cache):
            if kept[2] is not None:
                kept[2].reset(mask)
            return kept[3:]
        kv = None
        if slots:
            kv = StaticMask.for_model(self.model, B, slots, mask.device)
            kv.reset(mask)
            cache.layers = [layer if isinstance(layer, GDNStateLayer) else StaticKVLayer.from_dynamic(layer, slots, kv.position)
                            for layer in cache.layers]
        step = self._recorded_step(cache, B, mask.device, kv) if self.graph else self._plain_static_step(cache, B, mask.device, kv)
        if kv is not None:  # the warm-ups opened slots and moved the position on
            kv.reset(mask)
        self._graphs[(B, slots)] = (_addresses(self.model), cache, kv, *step)
        self.timing.capture_s = _now(mask.device) - t0 if self.graph else 0.0
        return step

    def _plain_static_step(self, cache, B, dev, kv):
        ids_buf, pos_buf, logits_buf = self._buffers(B, dev)

        def run():
            self._body(cache, ids_buf, pos_buf, logits_buf, kv=kv)

        return ids_buf, pos_buf, logits_buf, run

    def _recorded_step(self, cache, B, dev, kv):
        """Capture the step on this cache's tensors. The capture runs the step three times (two warm-ups
        that also compile any Triton kernel, then the recorded one); the cache is put back afterwards."""
        ids_buf, pos_buf, logits_buf = self._buffers(B, dev)
        counted = [layer for layer in cache.layers if isinstance(layer, (GDNStateLayer, StaticKVLayer))]
        seen = [layer.seen for layer in counted]
        layers = [layer for layer in counted if isinstance(layer, GDNStateLayer)]
        saved = [{i: layer.recurrent_states[i].clone() for i in _slots(layer)} for layer in layers]
        pos_buf.zero_()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        graph = torch.cuda.CUDAGraph()
        with compiled_blocks(self.model, self.compile):  # compiled in the warm-ups, recorded, then put back
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._body(cache, ids_buf, pos_buf, logits_buf, kv=kv)
            torch.cuda.current_stream(dev).wait_stream(stream)
            with collector_paused(), torch.cuda.graph(graph):
                self._body(cache, ids_buf, pos_buf, logits_buf, kv=kv)
        for layer, n in zip(counted, seen):
            layer.seen = n
        for layer, tensors in zip(layers, saved):
            for i, x in tensors.items():
                layer.recurrent_states[i].copy_(x)

        def run():
            graph.replay()
            for layer in counted:  # what get_seq_length reports, for a caller that continues eagerly
                layer.seen += 1

        return ids_buf, pos_buf, logits_buf, run


@contextlib.contextmanager
def collector_paused():
    """The garbage collector run, then off for the block: collecting an earlier CUDA graph (a dropped model's decoder
    holds its graphs in a cycle, :func:`model_decoder`) inside a capture invalidates it; torch does not collect first."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _addresses(model) -> tuple[int, ...]:
    """Where the tensors a recorded step reads live — parameters, buffers, the blocks' stacked projections
    (brought up to date first) — to tell whether a kept graph still reads the model."""
    stacked = []
    for module in model.modules():
        if isinstance(module, GDNAttention) and "_stacked" in module.__dict__:
            kept = refresh_stacked(module)
            stacked += [kept["weight"].data_ptr(), kept["bias"].data_ptr()] if kept is not None else [0]
    return (*(t.data_ptr() for t in model.parameters()), *(t.data_ptr() for t in model.buffers()), *stacked)


def drop_decode_caches(model) -> None:
    """Forget what decoding derived from the weights — the stacked projections, the kept decoder and its
    graphs — after writes the version counters do not see (``weight.data += …``, a LoRA merge)."""
    from .layers.step_projection import forget

    forget(model)
    model.__dict__.pop("_linearize_decoder", None)


def _load_states(kept, cache) -> bool:
    """Copy ``cache``'s states into ``kept``'s tensors (which a captured graph reads): GDN states slot by
    slot, a softmax layer's keys and values into the first slots of its fixed-size buffers. False, having
    copied nothing, where the two do not match (other slots or shapes, a prompt too long for the buffers)."""
    if len(kept.layers) != len(cache.layers):
        return False
    pairs = list(zip(kept.layers, cache.layers))
    for a, b in pairs:
        if isinstance(a, StaticKVLayer):
            k = getattr(b, "keys", None)
            if isinstance(b, GDNStateLayer) or k is None or k.shape[:2] != a.keys.shape[:2] or \
                    k.shape[2] > a.keys.shape[2]:
                return False
        elif not (isinstance(a, GDNStateLayer) and isinstance(b, GDNStateLayer) and _slots(a) == _slots(b)):
            return False
        elif any(a.recurrent_states[i].shape != b.recurrent_states[i].shape for i in _slots(b)):
            return False
    for a, b in pairs:
        if isinstance(a, StaticKVLayer):
            a.load(b)
            continue
        for i in _slots(b):
            a.recurrent_states[i].copy_(b.recurrent_states[i])
        a.seen = b.seen
    return True


def _slots(layer: GDNStateLayer) -> list[int]:
    return [i for i in range(layer.number_of_states) if layer.is_recurrent_states_initialized[i]]


def _now(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()
