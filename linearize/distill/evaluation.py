"""Held-out evaluation during training: teacher and student on the same held-out rows."""

from __future__ import annotations

import math

import torch

from .batches import batch_positions
from .losses import last_hidden, next_token_labels

FAR = 512  # the far split: predictions made with at least this many earlier tokens of their document in context


@torch.no_grad()
def evaluate(run, chunk: int = 1024, far: int = FAR) -> dict:
    """Held-out perplexity of teacher and student, KL(teacher ‖ student), top-1 agreement — logits
    made ``chunk`` tokens at a time through each LM head, never for the whole batch. All four over the same
    positions: those with a next token in their document (a row's last position and a document's last
    token, which perplexity cannot score, count in none). The same three (``*_far``, and ``far_tokens``
    how many) over the predictions with at least ``far`` tokens of their document before them, as
    ``linearize eval`` splits perplexity past 512 tokens: the long context that packed short documents
    weigh little in the whole (absent when no document of the rows is that long)."""
    was_training = run.student.training
    run.student.eval()
    ids, pos = run.data.heldout_ids, run.data.heldout_pos
    rows = max(1, min(ids.shape[0], run.cfg.data.eval_tokens // ids.shape[1]))
    ids, pos = ids[:rows].to(run.device), batch_positions(pos[:rows], run.device)
    labels = next_token_labels(ids, pos).flatten()
    at = (pos if pos is not None else torch.arange(ids.shape[1], device=ids.device).expand_as(ids)).flatten()
    hidden = {name: last_hidden(m, ids, pos).flatten(0, 1) for name, m in (("teacher", run.teacher), ("student", run.student))}
    # per split (all, far): Σ teacher NLL, Σ student NLL, Σ KL, agreements, predictions — on the device, read once
    sums = torch.zeros(2, 5, dtype=torch.float64, device=ids.device)
    for a in range(0, labels.numel(), chunk):
        lt = run.teacher.lm_head(hidden["teacher"][a:a + chunk]).float().log_softmax(-1)
        ls = run.student.lm_head(hidden["student"][a:a + chunk]).float().log_softmax(-1)
        y = labels[a:a + chunk]
        scored = y != -100
        per = torch.stack([torch.nn.functional.nll_loss(lt, y, ignore_index=-100, reduction="none"),
                           torch.nn.functional.nll_loss(ls, y, ignore_index=-100, reduction="none"),
                           (lt.exp() * (lt - ls)).sum(-1), (lt.argmax(-1) == ls.argmax(-1)).float(),
                           torch.ones_like(y, dtype=torch.float32)], -1).double()  # (tokens, 5), each position once
        for i, keep in enumerate((scored, scored & (at[a:a + chunk] >= far))):
            sums[i] += torch.where(keep[:, None], per, 0.0).sum(0)  # (where, not a product: no NaN of a skipped row)
    run.student.train(was_training)
    out = {}
    for (teacher, student, kl, agree, n), suffix in zip(sums.tolist(), ("", "_far")):
        if suffix:
            if not n:
                continue
            out["far_tokens"] = int(n)
        n = max(n, 1)
        out.update({f"ppl_teacher{suffix}": math.exp(teacher / n), f"ppl_student{suffix}": math.exp(student / n),
                    f"kl{suffix}": kl / n, f"top1_agreement{suffix}": agree / n})
    return out


def describe(initial: dict | None, final: dict) -> str:
    """A run's closing lines: the held-out perplexities at init and at the end, KL and top-1 agreement, and the
    far split where there is one."""
    ini = initial or {}
    text = (f"held-out perplexity: teacher {final['ppl_teacher']:.2f}, student at init "
            f"{ini.get('ppl_student', float('nan')):.2f} -> after training {final['ppl_student']:.2f}; "
            f"KL {final['kl']:.3f}, top-1 agreement {final['top1_agreement']:.3f}")
    if "ppl_student_far" in final:
        text += (f"\npast {FAR} tokens of context ({final['far_tokens']} predictions): teacher "
                 f"{final['ppl_teacher_far']:.2f}, student at init {ini.get('ppl_student_far', float('nan')):.2f} -> "
                 f"after training {final['ppl_student_far']:.2f}; KL {final['kl_far']:.3f}")
    return text
