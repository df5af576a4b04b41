"""Text in, text out for ``linearize generate``: prompts from the command line or a file, left-padded
into one batch, decoded by :class:`linearize.decoding.Decoder`, with the throughput it measured."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .checks import UserError
from .decoding import Decoder, Sampling


def load_for_generation(model: Path, device: str | None, rope: str | None = None, rope_layers: str = "softmax",
                        debug: bool = False, sparse_cache: int | None = None):
    """``(lm, tok)``: the converted model directory ``model`` on ``device`` (bf16 on CUDA, float32 on the CPU),
    with the RoPE scaling ``rope`` on ``rope_layers`` (:func:`linearize.models.rope.rope_scaling`) if given, and
    its sparse cache resized to ``sparse_cache`` slots (:func:`linearize.layers.options.resize_sparse_cache`)."""
    from transformers import AutoTokenizer

    from . import checks
    from .models.rope import check_layers, parse_rope_scaling, rope_scaling
    from .saving import load

    if rope:
        parse_rope_scaling(rope)
        check_layers(rope_layers)
    checks.sparse_cache_size(sparse_cache)
    if not (model / "config.json").is_file():
        raise UserError(f"{model} is not a converted model directory (no config.json); make one with linearize convert")
    checks.inspect_model(str(model))
    dev = checks.device_name(device)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    lm = checks.loaded(str(model), debug=debug, fn=lambda: load(model, dtype=dtype).to(dev))
    tok = checks.loaded(str(model), debug=debug, fn=lambda: AutoTokenizer.from_pretrained(model, trust_remote_code=False))
    if rope:
        rope_scaling(lm, rope, rope_layers)
    checks.resize_sparse_cache(lm, sparse_cache, str(model))
    return lm, tok


def read_prompts(prompt: str | None, batch_file: Path | None) -> list[str]:
    """The prompt, or the non-blank lines of ``batch_file`` (one prompt per line); not both."""
    if prompt is not None and batch_file is not None:
        raise UserError("give a prompt or --batch-file, not both")
    if batch_file is not None:
        if not batch_file.is_file():
            raise UserError(f"--batch-file {batch_file} is not a file; give a text file with one prompt per line")
        try:
            lines = batch_file.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise UserError(f"--batch-file {batch_file} is not UTF-8 text; give a text file with one prompt per line") from None
        prompts = [line for line in lines if line.strip()]
        if not prompts:
            raise UserError(f"--batch-file {batch_file} has no prompt; write one prompt per line")
        return prompts
    if prompt is None:
        raise UserError("no prompt; give text to continue (linearize generate -m DIR 'Once upon a time') "
                        "or --batch-file FILE with one prompt per line")
    if not prompt.strip():
        raise UserError("the prompt is empty; give text to continue, e.g. linearize generate -m DIR 'Once upon a time'")
    return [prompt]


def sampling_of(temperature: float, top_k: int, top_p: float) -> Sampling:
    """``temperature`` 0 is greedy decoding; otherwise sampling with these filters."""
    if temperature < 0 or temperature != temperature:
        raise UserError(f"--temperature must be 0 (greedy) or more; got {temperature}")
    if top_k < 0:
        raise UserError(f"--top-k must be 0 (off) or more; got {top_k}")
    if not 0 < top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1]; got {top_p}")
    if temperature == 0:
        return Sampling()
    return Sampling(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)


@dataclass
class Generated:
    texts: list[str]
    new_tokens: int  # tokens produced over the batch, end-of-text padding excluded
    prefill_s: float
    decode_s: float
    graphed: bool

    def summary(self) -> str:
        rate = self.new_tokens / self.decode_s if self.decode_s > 0 else float("inf")
        return (f"{self.new_tokens} new tokens over {len(self.texts)} prompt(s): prefill {self.prefill_s * 1e3:.1f} ms, "
                f"decode {self.decode_s:.2f} s, {rate:.1f} tokens/s ({'CUDA graph' if self.graphed else 'eager'})")


def generate_texts(lm, tok, prompts: list[str], max_new_tokens: int, chat: bool = False,
                   sampling: Sampling | None = None, seed: int = 0, compile: bool = False) -> Generated:
    if chat and not getattr(tok, "chat_template", None):
        raise UserError("--chat: the model's tokenizer has no chat template; drop --chat")
    rows = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] if chat else tok(p).input_ids for p in prompts]
    if any(not r for r in rows):
        raise UserError("a prompt has no tokens; give text to continue")
    dev = next(lm.parameters()).device
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):  # left padding: every row's last prompt token in the last column
        ids[i, T - len(r):] = torch.tensor(r)
        mask[i, T - len(r):] = 1
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    gen = torch.Generator(dev).manual_seed(seed)
    dec = Decoder(lm, compile=compile)
    out = dec.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens, eos_token_id=eos,
                       pad_token_id=pad, sampling=sampling, generator=gen)
    new = out[:, T:].cpu()
    texts, count = [], 0
    for row in new:
        ended = (row == eos).nonzero() if eos is not None else []
        n = int(ended[0]) + 1 if len(ended) else len(row)  # through the first end-of-text token
        count += n
        texts.append(tok.decode(row[:n], skip_special_tokens=True))
    t = dec.timing
    return Generated(texts, count, t.prefill_s, t.decode_s, t.graphed)
