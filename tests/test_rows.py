"""Rows cut from a document stream (linearize.corpus.rows): against a token-by-token construction."""

import numpy as np
import pytest

from linearize.corpus.rows import cut_rows


def rows_token_by_token(docs, L, eos, bos):
    """Append the stream one token at a time; a row that would open inside a document opens with ``bos``
    first (and a lone end-of-text left of a cut document is dropped)."""
    stream = [(t, i == 0) for d in docs for i, t in enumerate(([bos] if bos is not None else []) + list(d)
                                                                + ([eos] if eos is not None else []))]
    rows, cur, k = [], [], 0
    while k < len(stream):
        tok, start = stream[k]
        if not cur and not start and bos is not None:
            if tok == eos and (k + 1 == len(stream) or stream[k + 1][1]):
                k += 1
                continue
            cur.append((bos, True))
        cur.append((tok, start))
        k += 1
        if len(cur) == L:
            rows.append(cur)
            cur = []
    ids = [[t for t, _ in r] for r in rows]
    pos = []
    for r in rows:
        p, row = 0, []
        for j, (_, start) in enumerate(r):
            p = 0 if (start or j == 0) else p + 1
            row.append(p)
        pos.append(row)
    return ids, pos


@pytest.mark.parametrize("bos", [None, 7])
@pytest.mark.parametrize("eos", [None, 3])
@pytest.mark.parametrize("L", [4, 5, 16])
def test_cut_rows_matches_token_by_token(bos, eos, L):
    rng = np.random.default_rng(L)
    docs = [rng.integers(10, 100, size=int(n)) for n in rng.integers(1, 23, size=30)]
    ids, pos = cut_rows(docs, L, eos, bos)
    want_ids, want_pos = rows_token_by_token(docs, L, eos, bos)
    assert ids.tolist() == want_ids and pos.tolist() == want_pos
    if bos is not None:
        assert (ids[:, 0] == bos).all() and (pos[:, 0] == 0).all()
    few, _ = cut_rows(docs, L, eos, bos, max_rows=2)
    assert few.tolist() == want_ids[:2]


def test_cut_rows_reopens_a_cut_document_with_bos():
    ids, pos = cut_rows([[10, 11, 12, 13, 14], [20, 21]], 4, eos=3, bos=7)
    # stream 7 10 11 12 13 14 3 | 7 20 21 3: the first document goes on after a <bos> of its own
    assert ids.tolist() == [[7, 10, 11, 12], [7, 13, 14, 3], [7, 20, 21, 3]]
    assert pos.tolist() == [[0, 1, 2, 3]] * 3
    ids, _ = cut_rows([[10, 11, 12], [20, 21, 22, 23, 24, 25]], 4, eos=3, bos=7)
    # only the end-of-text of the first document is left after row one: the next row opens the second
    assert ids.tolist() == [[7, 10, 11, 12], [7, 20, 21, 22], [7, 23, 24, 25]]
    assert cut_rows([[1, 2]], 5, eos=3, bos=7)[0].shape == (0, 5)


def test_stage_pieces_open_with_bos_and_keep_the_text():
    """A stage with shorter rows (linearize.distill.batches.rows_of_length) cuts the data's rows again:
    each piece opens with bos, and without the bos ids the pieces are the rows' text in order."""
    import torch

    from linearize.distill.batches import rows_of_length

    rng = np.random.default_rng(3)
    docs = [rng.integers(10, 100, size=int(n)) for n in rng.integers(1, 40, size=40)]
    ids, pos = cut_rows(docs, 16, eos=3, bos=7)
    pieces, ppos = rows_of_length(torch.from_numpy(ids), torch.from_numpy(pos), 4, bos=7)
    assert (pieces[:, 0] == 7).all() and (ppos[:, 0] == 0).all()
    text = [t for t in ids.reshape(-1).tolist() if t != 7]
    got = [t for t in pieces.reshape(-1).tolist() if t != 7]
    assert len(got) > 0.6 * len(text) and got == text[:len(got)]
    for row, p in zip(pieces.tolist(), ppos.tolist()):  # a bos inside a piece starts a document there
        assert all((p[j] == 0) == (row[j] == 7) for j in range(4))
    plain, _ = rows_of_length(torch.from_numpy(ids), torch.from_numpy(pos), 4)
    assert plain.tolist() == ids.reshape(-1, 4).tolist()


def test_cut_rows_refuses_rows_too_short_for_bos():
    with pytest.raises(ValueError, match="seq_len >= 2"):
        cut_rows([[1, 2, 3]], 1, eos=3, bos=7)
