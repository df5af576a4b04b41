"""Held-out evaluation during training: teacher and student on the same held-out rows."""

from __future__ import annotations

import math

import torch

from .batches import batch_positions
from .losses import last_hidden, next_token_labels


@torch.no_grad()
def evaluate(run, chunk: int = 1024) -> dict:
    """Held-out perplexity of teacher and student, KL(teacher ‖ student), top-1 agreement — logits
    made ``chunk`` tokens at a time through each LM head, never for the whole batch. All four over the same
    positions: those with a next token in their document (a row's last position and a document's last
    token, which perplexity cannot score, count in none)."""
    was_training = run.student.training
    run.student.eval()
    ids, pos = run.data.heldout_ids, run.data.heldout_pos
    rows = max(1, min(ids.shape[0], run.cfg.data.eval_tokens // ids.shape[1]))
    ids, pos = ids[:rows].to(run.device), batch_positions(pos[:rows], run.device)
    labels = next_token_labels(ids, pos).flatten()
    hidden = {name: last_hidden(m, ids, pos).flatten(0, 1) for name, m in (("teacher", run.teacher), ("student", run.student))}
    ce = {"teacher": 0.0, "student": 0.0}
    kl, agree = 0.0, 0.0
    n, valid = labels.numel(), int((labels != -100).sum())
    for a in range(0, n, chunk):
        lt = run.teacher.lm_head(hidden["teacher"][a:a + chunk]).float().log_softmax(-1)
        ls = run.student.lm_head(hidden["student"][a:a + chunk]).float().log_softmax(-1)
        y = labels[a:a + chunk]
        for name, lp in (("teacher", lt), ("student", ls)):
            ce[name] += torch.nn.functional.nll_loss(lp, y, ignore_index=-100, reduction="sum").item()
        scored = y != -100
        kl += (lt.exp() * (lt - ls)).sum(-1)[scored].sum().item()
        agree += (lt.argmax(-1) == ls.argmax(-1))[scored].sum().item()
    run.student.train(was_training)
    valid = max(valid, 1)
    return {"ppl_teacher": math.exp(ce["teacher"] / valid), "ppl_student": math.exp(ce["student"] / valid),
            "kl": kl / valid, "top1_agreement": agree / valid}
