"""Which tokens of a batch are real and where its documents start, as the converted blocks read them off
what the model passes down: the padding mask, and packed documents' restarting positions (``cu_seqlens``).
"""

from __future__ import annotations

import torch

from ..ops.common import LastTensorMemo


def flatten_rows(hidden: list[torch.Tensor], position_embeddings):
    """``(B, T, ...)`` → ``(1, B·T, ...)`` for each hidden state and for the position embeddings: packed
    documents run as one row whose document offsets are ``cu_seqlens``."""
    B, T = hidden[0].shape[:2]
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    cos, sin = position_embeddings
    return [flat(h) for h in hidden], (flat(cos.expand(B, -1, -1)), flat(sin.expand(B, -1, -1)))


def by_rows(fn, rows: int, *args):
    """``fn(*args)`` with each tensor argument ``(1, N, ...)`` — a flattened batch — split back into ``rows``
    rows of ``N / rows`` tokens, and each tensor it returns joined into one row again. For attention whose
    cost grows with the row (a block mask, a dense selection): packed documents never cross a row."""
    if rows == 1:
        return fn(*args)
    split = lambda x: x.reshape(rows, -1, *x.shape[2:]) if torch.is_tensor(x) else x  # noqa: E731
    return tuple(o.reshape(1, -1, *o.shape[2:]) for o in fn(*(split(a) for a in args)))


def token_mask(attention_mask: torch.Tensor | None, B: int, T: int) -> torch.Tensor | None:
    """``(B, T)`` bool, False for padding, from whatever mask the model passed down (or None).

    4-D masks (bool: True = attend; float: 0 = attend) are read on their diagonal — does token t
    attend to itself? — which holds for full and sliding-window masks alike and is False only for
    padding; 2-D masks are the user's padding mask itself.
    """
    if attention_mask is None:
        return None
    if not torch.is_tensor(attention_mask) or torch.compiler.is_compiling():  # (a trace keeps nothing between calls)
        return _token_mask(attention_mask, B, T)
    # every layer of one forward passes the same mask: read back (a sync) once, not once a layer
    return _LAST_MASK.get(attention_mask, lambda: _token_mask(attention_mask, B, T),
                          key=(B, T, torch.is_inference_mode_enabled()))


def _token_mask(m: torch.Tensor, B: int, T: int) -> torch.Tensor | None:
    if m.dim() == 4:
        if m.shape[-2] < T:
            return None
        S = m.shape[-1]
        rows = torch.arange(m.shape[-2] - T, m.shape[-2], device=m.device)
        m = m[:, 0, rows, S - T + torch.arange(T, device=m.device)]
        m = m if m.dtype == torch.bool else m == 0  # additive: 0 = attend
    elif m.dim() == 2:
        m = m[:, -T:]
        m = m if m.dtype == torch.bool else m != 0  # the user's padding mask: 1 = a token
    else:
        return None
    if m.shape != (B, T) or bool(m.all()):
        return None
    return m


def packed_cu_seqlens(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document offsets of the flattened ``(B·T)`` tokens when rows pack several documents.

    A document starts at every row start and wherever the position does not follow the previous
    one (the rule transformers uses for packed sequences); None when each row is one document.
    """
    return _LAST_PACKING.get(position_ids, lambda: _document_starts(position_ids))


def _document_starts(position_ids: torch.Tensor) -> torch.Tensor | None:
    B, T = position_ids.shape
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] - position_ids[:, :-1] != 1
    if int(starts.sum()) == B:
        return None
    idx = starts.flatten().nonzero().flatten()
    return torch.cat([idx, idx.new_tensor([B * T])])


_LAST_PACKING = LastTensorMemo()  # every layer of one forward passes the same position_ids
_LAST_MASK = LastTensorMemo()
