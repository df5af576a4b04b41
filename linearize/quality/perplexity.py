"""Per-domain perplexity on held-out rows: each domain's documents packed into ``(rows, seq_len)``.

Every model is scored on the same rows (token ids, built once from the corpus or the built-in
held-out text), so teacher and student compare token for token. Perplexity is exp(mean NLL) over
every predicted token of a domain's rows (``seq_len - 1`` per row: the first token is context only),
and also per span of context length (``by_context``: the tokens predicted from 1-64 earlier tokens of their
row, 65-512, 513-2048, ...): a converted block with a window of 64 and its sinks is exact over the first
span, so what a model loses beyond it is what its state does not carry. The mean NLL at every context length
is kept too (``nll_by_context_length``), so that a teacher measured alone can be split at the spans of any
student later (:func:`span_perplexity`).

    rows = pack(documents, seq_len=512, tokens=65536)        # (128, 512) int64
    domain_perplexity(model, rows)                          # {"ppl": ..., "nll": ..., "tokens": ...}
"""

from __future__ import annotations

import math

from ..checks import UserError


def pack(documents, seq_len: int, tokens: int, sep: int | None = None, bos: int | None = None):
    """Documents (token ids, in order; ``bos`` before each and ``sep`` after each, if given) cut into
    ``tokens // seq_len`` rows of ``seq_len`` as training cuts them (:func:`linearize.corpus.rows.cut_rows`:
    with a ``bos``, every row opens with it); fewer rows if the documents run out (whole rows only).
    Returns ``(rows, seq_len)``."""
    import torch

    from ..corpus.rows import cut_rows

    n_rows = max(tokens // seq_len, 1)
    enough = n_rows * (seq_len + 1) + seq_len  # each row opened again takes one stream token less
    docs, have = [], 0
    for doc in documents:
        docs.append(doc)
        have += len(doc) + (bos is not None) + (sep is not None)
        if have >= enough:
            break
    ids, _ = cut_rows(docs, seq_len, sep, bos, max_rows=n_rows)
    return torch.from_numpy(ids)


def corpus_rows(corpus_dir, seq_len: int, tokens: int, tokenizer=None, split: str = "heldout") -> dict:
    """``{domain: (rows, seq_len)}`` from the held-out (or test) split of a corpus made by :mod:`linearize.corpus`
    (its documents carry no special tokens: the corpus tokenizer's end-of-text id goes between them); with a
    ``tokenizer``, the corpus must have been cut with the same vocabulary, and each document opens with the
    id that tokenizer puts first of its own accord (Gemma's ``<bos>``, as in training: without it Gemma 3's
    perplexity is several times higher; SmolLM2 adds none)."""
    from ..corpus.reader import open_corpus
    from ..corpus.tokenizer import document_start, tokenizer_mismatch

    corpus = open_corpus(corpus_dir)
    why = None if tokenizer is None else tokenizer_mismatch(corpus.manifest["tokenizer"], tokenizer)
    if why:
        raise UserError(f"--corpus {corpus_dir}: {why}; build it with the model's tokenizer "
                        "(linearize data build --tokenizer ...)")
    special = corpus.manifest["tokenizer"].get("special_tokens", {})
    # between documents the end-of-text training puts there: the corpus's own, else the tokenizer's eos
    sep = special.get("<|endoftext|>", getattr(tokenizer, "eos_token_id", None) if tokenizer is not None
                      else special.get("</s>"))
    bos = None if tokenizer is None else document_start(tokenizer)
    rows = {d: pack(corpus.documents(d, split=split), seq_len, tokens, sep, bos) for d in corpus.domains}
    short = [d for d, r in rows.items() if r.shape[0] == 0]
    if short:
        raise too_short(corpus_dir, short, seq_len, split)
    return rows


def too_short(corpus_dir, domains: list[str], seq_len: int, split: str) -> UserError:
    """The refusal of a corpus split with fewer tokens than one row in some domains (here, and before any
    model loads in :func:`linearize.quality.report.check_plan`)."""
    return UserError(f"--corpus {corpus_dir}: domain(s) {', '.join(domains)} hold fewer than --seq-len {seq_len} "
                     f"{split} tokens; lower --seq-len")


def builtin_rows(tokenizer, seq_len: int, tokens: int) -> dict:
    """``{"builtin": (rows, seq_len)}`` from the built-in held-out prose (:func:`linearize.eval.text_ids`)."""
    from ..eval import builtin_text, text_ids

    have = len(tokenizer(builtin_text("heldout")).input_ids)
    n = min(tokens, have) // seq_len
    if n < 1:
        raise UserError(f"--seq-len {seq_len}: the built-in held-out text has {have} tokens; lower --seq-len")
    return {"builtin": text_ids(tokenizer, seq_len, split="heldout", batch=n)}


def check_vocab(rows: dict, vocab_size: int, who: str) -> None:
    top = max((int(r.max()) for r in rows.values() if r.numel()), default=-1)
    if top >= vocab_size:
        raise UserError(f"the corpus holds token id {top} but {who} has {vocab_size} embeddings; "
                        "build the corpus with this model's tokenizer")


# logits per forward at most, counted in (token, vocabulary entry) pairs: 16K tokens of SmolLM2's 49K
# vocabulary, 3.2 GB in float32 (64 rows of 2,048 would be 26 GB, which ran a GPU shared with training out
# of memory); Gemma 3's 262K vocabulary gets 3K tokens (16K tokens of it, 17 GB, ran a 24 GB CPU machine
# out of memory), a row at a time whatever the vocabulary
MAX_LOGITS_PER_FORWARD = 16384 * 49152


CONTEXT_EDGES = (64, 512, 2048, 8192, 32768)  # the spans of ``by_context`` end at these context lengths


def context_spans(seq_len: int, extra: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """``[(first, last)]`` context lengths (tokens of the row before the predicted one, 1 … seq_len − 1) per
    span, cut after each of :data:`CONTEXT_EDGES` and ``extra`` below ``seq_len − 1``."""
    ends = sorted({e for e in (*CONTEXT_EDGES, *extra) if 0 < e < seq_len - 1}) + [seq_len - 1]
    return [(1 if i == 0 else ends[i - 1] + 1, e) for i, e in enumerate(ends)]


def exact_reach(model) -> tuple[int, ...]:
    """The context lengths up to which a converted model's blocks read every earlier token exactly: window +
    sinks, and window + sinks + sparse cache where the blocks keep one (nothing for a softmax model). Past the
    last, only the GDN state carries the older tokens: the span where a converted model differs from its teacher."""
    from ..layers.gdn_attention import GDNAttention

    reach = set()
    for m in model.modules():
        if isinstance(m, GDNAttention) and m.options.window:
            o = m.options
            reach |= {o.window + o.sinks, o.window + o.sinks + (o.sparse_cache or 0)}
    return tuple(sorted(reach))


def domain_perplexity(model, rows, batch_size: int = 8, edges: tuple[int, ...] = ()) -> dict:
    """exp(mean next-token NLL) of ``model`` over ``(R, T)`` rows, in float64 sums, overall and per span of
    context length (``by_context``, keyed ``"first-last"``, cut at :data:`CONTEXT_EDGES` and ``edges``); at most
    ``batch_size`` rows and :data:`MAX_LOGITS_PER_FORWARD` logits per forward."""
    import torch

    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    step = max(1, min(batch_size, MAX_LOGITS_PER_FORWARD // max(1, rows.shape[1] * vocab)))
    per_position = torch.zeros(rows.shape[1] - 1, dtype=torch.float64)  # NLL summed over rows, by context length − 1
    with torch.no_grad():
        for i in range(0, rows.shape[0], step):
            ids = rows[i: i + step].to(device)  # (b, T)
            logits = model(input_ids=ids, use_cache=False).logits.float()  # (b, T, V)
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
            per_position += loss.double().sum(0).cpu()
    count = rows.shape[0] * per_position.numel()
    mean = float(per_position.sum()) / count
    spans = {}
    for first, last in context_spans(rows.shape[1], edges):
        n = rows.shape[0] * (last - first + 1)
        span_mean = float(per_position[first - 1: last].sum()) / n
        spans[f"{first}-{last}"] = {"ppl": math.exp(span_mean), "nll": span_mean, "tokens": n}
    by_length = [round(float(x) / rows.shape[0], 6) for x in per_position]  # mean NLL at context length 1, 2, …
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "by_context": spans, "nll_by_context_length": by_length}


def span_perplexity(nll_by_context_length: list[float], first: int, last: int) -> float:
    """Perplexity over the tokens predicted from ``first`` … ``last`` earlier tokens of their row, from a
    :func:`domain_perplexity` result's ``nll_by_context_length`` (every row has a token at every length, so
    the lengths weigh equally): a file measured alone split at another model's spans.

    Example:
        >>> round(span_perplexity([1.0, 2.0, 3.0], 2, 3), 4)  # exp((2 + 3) / 2)
        12.1825
    """
    if not 1 <= first <= last <= len(nll_by_context_length):
        raise ValueError(f"context lengths {first}-{last} are outside 1-{len(nll_by_context_length)}")
    span = nll_by_context_length[first - 1: last]
    return math.exp(sum(span) / len(span))
