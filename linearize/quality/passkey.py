"""Passkey retrieval: a 5-digit key hidden at a chosen depth in filler text, asked for at the end.

The test of Mohtashami & Jaggi (2023, landmark attention) as LongLoRA and others run it: the same
filler sentences repeated to the prompt length, the key sentence inserted after ``depth`` of them,
the question last; greedy decoding; right if the first number in the answer is the key. Prompts are
built in token space, so a prompt's length is the asked length to within one filler sentence.
Deterministic: each (length, depth) draws its keys from ``random.Random`` seeded by the seed and the cell, the same
for every model and whatever other cells a run asks for (runs before drew them in cell order from one seed).

The depths run from the start of the filler to a quarter before its end, never to the end: a key sentence right
before the question ends 35 tokens before the prompt does (SmolLM2's tokenizer), inside a converted block's exact
window, so it tests no long-range retrieval; and there SmolLM2-135M-Instruct answers " the pass key." at every
length, so the cell scored the teacher 0 and students at random (``scripts/passkey_recount.py``,
``results/passkey_far_depths_recount.md``).

With ``needles = N > 1`` (``linearize eval --passkey-keys N``) the prompt holds N key sentences, each naming
whose key it is (" The pass key of Carol is …"), and asks for one of them by name: the multi-key needle of
RULER (Hsieh et al. 2024). The asked key sits at the depth; the others, each with its own name and key, at
seeded random places in the filler. One key can be found by any head that finds a number; N keys test
associative recall — the name must select the key — which a state of fixed size blurs. An answer that is
another needle's key counts as ``confused``. With N = 1 the prompts are exactly the single-key ones.

    prompt = make_prompt(tokenizer, length=1024, depth=0.5, key="48213")
    run_passkey(model, tokenizer, lengths=(512, 1024, 2048), trials=5)["acc"]
    run_passkey(model, tokenizer, lengths=(2048,), needles=4)["lengths"]["2048"]["confused"]
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from ..checks import UserError

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
# the named form, for prompts of several needles (first names: one token each in SmolLM2's and Gemma 3's tokenizers)
NAMED_NEEDLE = " The pass key of {name} is {key}. Remember it. {key} is the pass key of {name}."
NAMED_QUESTION = " What is the pass key of {name}? The pass key of {name} is"
NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "James", "Jack", "Laura", "Peter")


def depths(n: int) -> list[float]:
    """``n`` depths evenly from 0 (the key right after the intro) to ``1 − 1/n`` (a ``1/n`` of the filler still
    after it): 4 gives 0, 0.25, 0.5 and 0.75."""
    return [round(i / n, 6) for i in range(n)]


DEPTHS = tuple(depths(4))


def check_needles(needles: int) -> None:
    if not 1 <= needles <= len(NAMES):
        raise UserError(f"--passkey-keys must be 1 to {len(NAMES)}; got {needles}")


@dataclass
class PasskeyPrompt:
    ids: list[int]  # the whole prompt, special tokens included
    key: str
    depth: float  # as asked: the fraction of filler before the key
    key_at: int  # index in ``ids`` where the key sentence starts
    others: tuple[str, ...] = ()  # the other needles' keys (a prompt of several)


def make_prompt(tokenizer, length: int, depth: float, key: str, needles: int = 1, seed: str = "") -> PasskeyPrompt:
    """A prompt of at most ``length`` tokens and more than ``length - len(filler)``. ``needles > 1``: that many
    named key sentences, ``key`` the one asked for at ``depth``; the names, the other keys (all distinct) and
    their places come from ``random.Random(seed)``."""
    check_needles(needles)
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    intro = tokenizer(INTRO).input_ids  # with the tokenizer's BOS, if it adds one
    filler, others = enc(FILLER), []
    if needles == 1:
        texts, question, spots = [NEEDLE.format(key=key)], QUESTION, []
    else:
        rng = random.Random(seed)
        names = rng.sample(NAMES, needles)  # names[0] is asked for
        while len(others) < needles - 1:  # keys all distinct
            k = str(rng.randint(10000, 99999))
            if k != key and k not in others:
                others.append(k)
        texts = [NAMED_NEEDLE.format(name=n, key=k) for n, k in zip(names, (key, *others))]
        question, spots = NAMED_QUESTION.format(name=names[0]), [rng.random() for _ in others]
    sentences, question = [enc(t) for t in texts], enc(question)
    reps = (length - len(intro) - sum(map(len, sentences)) - len(question)) // len(filler)
    if reps < 1:
        raise UserError(f"--passkey-len {length} is too short for the passkey prompt; use at least "
                        f"{len(intro) + sum(map(len, sentences)) + len(question) + len(filler)}")
    # each needle after that many filler sentences; at a tie the asked one first
    order = sorted(enumerate([round(depth * reps), *(round(x * reps) for x in spots)]), key=lambda p: (p[1], p[0]))
    ids, done, key_at = list(intro), 0, 0
    for i, before in order:
        ids += filler * (before - done)
        if i == 0:
            key_at = len(ids)
        ids += sentences[i]
        done = before
    ids += filler * (reps - done) + question
    return PasskeyPrompt(ids=ids, key=key, depth=depth, key_at=key_at, others=tuple(others))


def answer_key(text: str) -> str | None:
    """The first number in the model's answer."""
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


def keys(seed: int, count: int, cell: str = "") -> list[str]:
    """``count`` 5-digit keys; with a ``cell`` (a length and depth), the cell's own: the keys of a prompt then do not
    depend on the other lengths and depths asked."""
    rng = random.Random(f"{seed}:{cell}" if cell else seed)
    return [str(rng.randint(10000, 99999)) for _ in range(count)]


def run_passkey(model, tokenizer, lengths, depths=DEPTHS, trials: int = 5, seed: int = 0,
                max_new_tokens: int = 10, needles: int = 1) -> dict:
    """Accuracy per length and depth over ``trials`` keys each; ``records`` holds every answer. ``needles``: key
    sentences a prompt (the asked keys are the single-key test's; see the module docstring)."""
    import torch

    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    records = []
    for n, d in [(n, d) for n in lengths for d in depths]:
        for i, key in enumerate(keys(seed, trials, f"{n}:{d}")):
            p = make_prompt(tokenizer, n, d, key, needles, seed=f"{seed}:{n}:{d}:{i}")
            ids = torch.tensor([p.ids], device=device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                     do_sample=False, pad_token_id=pad)
            text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            record = {"length": n, "tokens": len(p.ids), "depth": d, "key": p.key, "answer": text,
                      "correct": answer_key(text) == p.key}
            if p.others:
                record.update(others=list(p.others), confused=answer_key(text) in p.others)
            records.append(record)
    return summarize(records, lengths, depths)


def summarize(records: list[dict], lengths, depths) -> dict:
    """Accuracy overall, per length and per depth; with several needles also the share ``confused`` per length."""
    def acc(rs, what="correct"):
        return sum(r[what] for r in rs) / len(rs) if rs else None

    by_length = {}
    for n in lengths:
        rs = [r for r in records if r["length"] == n]
        by_length[str(n)] = {"acc": acc(rs), "depths": {str(d): acc([r for r in rs if r["depth"] == d]) for d in depths}}
        if any("confused" in r for r in rs):
            by_length[str(n)]["confused"] = acc(rs, "confused")
    return {"acc": acc(records), "lengths": by_length, "records": records}
