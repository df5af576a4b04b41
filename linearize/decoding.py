"""Decoding a converted model: prefill through the chunkwise kernels, then one step per token, the step
of the whole model replayed from a CUDA graph when every layer is GDN.

A GDN layer's decoding state has a fixed size (the state, the running sums, the window's ring of keys
and values: :mod:`linearize.layers.cache`), and transformers' cache layers update it in place, so the
step of the whole model — embedding, every block, the head — reads and writes the same memory at every
position. Captured once per batch, it replays with no Python and no kernel-launch cost per layer; the
host only picks the next token and, every ``check_every`` steps, looks for the end of text. Models that
keep softmax layers grow a KV cache, whose shapes change every step: they decode eagerly here.

    dec = Decoder(model)                      # graph=None: on CUDA, when every layer is GDN
    out = dec.generate(ids, attention_mask=mask, max_new_tokens=64, eos_token_id=tok.eos_token_id)

Greedy decoding gives the tokens ``model.generate(do_sample=False)`` gives; sampling applies the
temperature, then top-k, then top-p, in the order transformers' logits processors do.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from dataclasses import dataclass

import torch

from .compat import cache_kwargs
from .layers.cache import GDNStateLayer


@dataclass
class Sampling:
    """How the next token is chosen: greedy (``do_sample=False``) or sampled."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0; got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0; got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """``(B,)`` next tokens from the last position's ``(B, vocab)`` logits."""
    if not sampling.do_sample:
        return logits.argmax(-1)
    x = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = torch.topk(x, min(sampling.top_k, x.shape[-1]), dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if sampling.top_p < 1:
        sorted_x, order = torch.sort(x, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= 1 - sampling.top_p  # the low tail whose mass stays under 1 - top_p
        drop[..., -1] = False  # always keep the most likely token
        x = x.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(x.softmax(-1), 1, generator=generator)[:, 0]


@dataclass
class Timing:
    """Of the last ``generate``: seconds of the prefill, of the decode loop (capture included) and of the
    capture alone, and the decode steps run."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    capture_s: float = 0.0
    steps: int = 0
    graphed: bool = False


# model.generate() keywords the decoder handles; any other keyword keeps transformers' own generate()
PLAIN_KWARGS = {"attention_mask", "max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id",
                "pad_token_id"}
# generation-config fields that make transformers add a logits processor or change the search; set to
# anything but these values, generate() stays transformers' own
_UNHANDLED = {"num_beams": (None, 1), "num_return_sequences": (None, 1), "repetition_penalty": (None, 1.0),
              "no_repeat_ngram_size": (None, 0), "min_length": (None, 0), "min_new_tokens": (None, 0),
              "bad_words_ids": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
              "suppress_tokens": (None,), "begin_suppress_tokens": (None,), "sequence_bias": (None,),
              "min_p": (None,), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
              "encoder_repetition_penalty": (None, 1.0), "exponential_decay_length_penalty": (None,),
              "guidance_scale": (None, 1.0), "renormalize_logits": (None, False), "stop_strings": (None,),
              "max_time": (None,), "watermarking_config": (None,), "penalty_alpha": (None,)}
# transformers' values for what a generation config leaves None
_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


def plain_generate_kwargs(model, kwargs: dict) -> dict | None:
    """The :meth:`Decoder.generate` keywords for a ``model.generate(ids, **kwargs)`` call the decoder
    computes as transformers would (greedy or sampled, end of text, ``max_new_tokens`` given), else None."""
    if set(kwargs) - PLAIN_KWARGS or kwargs.get("max_new_tokens") is None:
        return None
    gc = getattr(model, "generation_config", None)
    for name, fine in _UNHANDLED.items():
        if getattr(gc, name, None) not in fine:
            return None
    value = lambda k: kwargs[k] if kwargs.get(k) is not None else (getattr(gc, k, None) if getattr(gc, k, None)  # noqa: E731
                                                                     is not None else _DEFAULTS[k])
    sampling = Sampling()  # greedy: temperature and the filters do not apply
    if value("do_sample"):
        sampling = Sampling(do_sample=True, temperature=float(value("temperature")), top_k=int(value("top_k") or 0),
                            top_p=float(value("top_p")))
    return {"attention_mask": kwargs.get("attention_mask"), "max_new_tokens": int(kwargs["max_new_tokens"]),
            "eos_token_id": kwargs.get("eos_token_id"), "pad_token_id": kwargs.get("pad_token_id"), "sampling": sampling}


def graph_generate(model, inputs: torch.Tensor | None, kwargs: dict) -> torch.Tensor | None:
    """What a converted model's ``generate()`` returns through the CUDA-graph decoder — on CUDA, when every
    layer is GDN and the call is plain (:func:`plain_generate_kwargs`) — or None: then transformers' own."""
    ids = inputs if inputs is not None else kwargs.get("input_ids")
    rest = {k: v for k, v in kwargs.items() if k != "input_ids"}
    if not (torch.is_tensor(ids) and ids.dim() == 2 and ids.is_cuda and all_gdn(model)):
        return None
    plan = plain_generate_kwargs(model, rest)
    if plan is None or _GRAPH_FAILED:
        return None
    try:
        return model_decoder(model).generate(ids, **plan)
    except RuntimeError as e:  # a capture this torch/transformers cannot do: say so once, then decode eagerly
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


class Decoder:
    """Generation for one converted model. With ``graph``, the step is captured once per batch size (three
    steps and the recording, in ``timing.capture_s``) on a cache the decoder then keeps: a later call of the
    same batch size prefills into a fresh cache, copies its fixed-size states into the kept one and replays
    the same graph. The model's weights must stay where they were captured: a decoder that finds them
    moved (``.to()``, a reload) captures again."""

    def __init__(self, model, graph: bool | None = None, check_every: int = 8, compile: bool = False):
        self.model = model
        device = next(model.parameters()).device
        can = device.type == "cuda" and all_gdn(model)
        if graph and not can:
            raise ValueError("graph decoding needs a CUDA device and a model whose every layer is GDN "
                             "(softmax layers grow a KV cache); use graph=None or False")
        self.graph = can if graph is None else graph
        self.check_every = max(1, check_every)
        self.compile = compile  # the graph records each block's norms and MLP compiled (fewer kernels a step)
        self.timing = Timing()
        self._graphs: dict[int, tuple] = {}  # batch size -> (weights' addresses, cache, ids, pos, logits, run)

    def __deepcopy__(self, memo):  # a copied model (copy.deepcopy) gets a decoder of its own, no graphs
        new = copy.copy(self)
        new.model, new.timing, new._graphs = copy.deepcopy(self.model, memo), Timing(), {}
        return new

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 32,
                 eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
                 sampling: Sampling | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """``(B, T + n)``: the prompts (left-padded where ``attention_mask`` has zeros) and their continuations.
        A row that has produced an end-of-text token continues with ``pad_token_id``; both default to the
        model's ``generation_config``, as in ``model.generate`` (the pad to the first end-of-text token)."""
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
        logits = model(input_ids, attention_mask=mask, position_ids=pos, **cache_kwargs(cache), use_cache=True,
                       logits_to_keep=1).logits[:, -1]
        self.timing = Timing(prefill_s=_now(dev) - t0, graphed=self.graph)
        t0 = _now(dev)
        if self.graph:
            ids_buf, pos_buf, logits_buf, run = self._graph_for(cache, B, dev)
        else:
            ids_buf, pos_buf, logits_buf, run = self._eager_step(cache, mask)
        pos_buf.copy_(pos[:, -1:] + 1)
        out = [input_ids]
        done = torch.zeros(B, dtype=torch.bool, device=dev)
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
    def _body(self, cache, ids_buf, pos_buf, logits_buf, mask=None):
        logits = self.model(input_ids=ids_buf, position_ids=pos_buf, attention_mask=mask, **cache_kwargs(cache),
                            use_cache=True, logits_to_keep=1, decode_step=True).logits[:, -1]
        logits_buf.copy_(logits)
        pos_buf.add_(1)

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

    def _graph_for(self, cache, B, dev):
        """The captured step for batch ``B``, continuing from the prefilled ``cache``: the kept graph, its
        cache loaded with ``cache``'s states, or a new capture on ``cache`` (which the decoder then keeps)."""
        weights = tuple(p.data_ptr() for p in self.model.parameters())
        kept = self._graphs.get(B)
        t0 = _now(dev)
        if kept is not None and kept[0] == weights and _load_states(kept[1], cache):
            return kept[2:]
        step = self._graphed_step(cache, B, dev)
        self._graphs[B] = (weights, cache, *step)
        self.timing.capture_s = _now(dev) - t0
        return step

    def _graphed_step(self, cache, B, dev):
        """Capture the step on this cache's tensors. The capture runs the step three times (two warm-ups
        that also compile any Triton kernel, then the recorded one); the cache is put back afterwards."""
        ids_buf, pos_buf, logits_buf = self._buffers(B, dev)
        layers = [layer for layer in cache.layers if isinstance(layer, GDNStateLayer)]
        saved = [(layer.seen, {i: layer.recurrent_states[i].clone() for i in _slots(layer)}) for layer in layers]
        pos_buf.zero_()
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        graph = torch.cuda.CUDAGraph()
        with compiled_blocks(self.model, self.compile):  # compiled in the warm-ups, recorded, then put back
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._body(cache, ids_buf, pos_buf, logits_buf)
            torch.cuda.current_stream(dev).wait_stream(stream)
            with torch.cuda.graph(graph):
                self._body(cache, ids_buf, pos_buf, logits_buf)
        for layer, (seen, tensors) in zip(layers, saved):
            layer.seen = seen
            for i, x in tensors.items():
                layer.recurrent_states[i].copy_(x)

        def run():
            graph.replay()
            for layer in layers:  # what get_seq_length reports, for a caller that continues eagerly
                layer.seen += 1

        return ids_buf, pos_buf, logits_buf, run


@contextlib.contextmanager
def compiled_blocks(model, enabled: bool = True):
    """Within: every decoder block's norms and MLP run through ``torch.compile`` (their element-wise
    work fused into a few kernels); afterwards the model is as it was. The attention blocks stay as they
    are (their cache updates and kernels are not what a compiler fuses). A graph recorded within keeps the
    compiled kernels."""
    from .models.adapters import decoder_layers

    patched = []
    if enabled:
        for block in decoder_layers(model):
            for name, child in block.named_children():
                if name == "mlp" or name.endswith("norm"):
                    patched.append((child, child.__dict__.get("forward")))
                    child.forward = torch.compile(child.forward, fullgraph=True, dynamic=False)
    try:
        yield
    finally:
        for child, forward in patched:
            if forward is None:
                del child.forward
            else:
                child.forward = forward


def _load_states(kept, cache) -> bool:
    """Copy ``cache``'s GDN states into ``kept``'s tensors (which a captured graph reads); False, copying
    nothing, where the two do not hold the same slots of the same shapes."""
    if len(kept.layers) != len(cache.layers):
        return False
    pairs = list(zip(kept.layers, cache.layers))
    for a, b in pairs:
        if not (isinstance(a, GDNStateLayer) and isinstance(b, GDNStateLayer) and _slots(a) == _slots(b)):
            return False
        if any(a.recurrent_states[i].shape != b.recurrent_states[i].shape for i in _slots(b)):
            return False
    for a, b in pairs:
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
