"""What a ``generate()`` call asks for, in the terms of :mod:`linearize.decoding`: how the next token is
chosen (:class:`Sampling`, :func:`next_tokens`, in the order transformers' logits processors apply
temperature, top-k and top-p), and whether a ``model.generate(**kwargs)`` call is one the decoder
computes as transformers would (:func:`plain_generate_kwargs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
