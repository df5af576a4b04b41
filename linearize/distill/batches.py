"""Which rows each step trains on, and how their positions reach the models."""

from __future__ import annotations

import torch


def batch_rows(num_rows: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Rows of global step ``step``: a fixed permutation per epoch, so a resumed run replays exactly."""
    per_epoch = max(1, num_rows // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    idx = perm[(i * batch_size) % num_rows:][:batch_size]
    if idx.numel() < batch_size:  # fewer rows than a batch: wrap around
        idx = torch.cat([idx, perm[: batch_size - idx.numel()]])
    return idx


def batch_positions(pos: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The ``position_ids`` to give the models for a batch whose positions are ``pos`` (on the host): None
    when every row is one document from position 0 — the models' own default, with no document tables to
    build, and no host sync in transformers' mask code, which reads ``position_ids`` back to look for
    packed documents — else ``pos`` on ``device``."""
    if pos.device.type == "cpu" and torch.equal(pos, torch.arange(pos.shape[1]).expand_as(pos)):
        return None
    return pos.to(device)


def rows_of_length(ids: torch.Tensor, pos: torch.Tensor, length: int,
                   bos: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The data's ``(n, L)`` rows cut into pieces of ``length``, positions restarting at each piece (a
    document cut by a piece boundary goes on as a new one, as at row boundaries); ``length`` must divide
    ``L``. Without ``bos``: the ``(n·L/length, length)`` reshape. With it (the id every row opens with):
    each piece opens with it too, so a cut document's rest follows a ``bos`` of its own
    (:func:`linearize.corpus.rows.cut_rows`, on the rows' documents), and the last few tokens that no longer
    fill a piece are dropped."""
    n, L = ids.shape
    if length == L:
        return ids, pos
    if L % length:
        raise ValueError(f"a stage's seq_len {length} must divide the data's rows of {L} tokens")
    from .data import restart_rows

    if bos is None:
        return ids.reshape(-1, length), restart_rows(pos.reshape(-1, length))
    from ..corpus.rows import cut_rows

    flat_ids, starts = ids.reshape(-1).numpy(), (pos.reshape(-1) == 0).numpy()
    cuts = starts.nonzero()[0].tolist() + [flat_ids.size]
    docs = [flat_ids[a + (flat_ids[a] == bos): b] for a, b in zip(cuts[:-1], cuts[1:])]
    out_ids, out_pos = cut_rows(docs, length, None, bos)
    return torch.from_numpy(out_ids), torch.from_numpy(out_pos)
