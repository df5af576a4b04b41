"""The training stages: one global step counter over the recipe's stages in order.

- ``align``: one teacher forward per batch (no grad) captures every converted layer's attention input
  and output; each GDN block, run on the teacher's input, learns to reproduce the teacher's output.
- ``distill``: the student model against the teacher's logits (chunked KL, optional CE).

A step: the objective's forward and backward (gradients averaged over processes by DDP or FSDP), a
check that the loss is finite, clipping, the optimizer step, a check that the parameters are finite
(so the last checkpoint is always good), then logging, evaluation and checkpointing on their
intervals. Checkpoints are taken every ``checkpoint_every`` global steps and at each stage's end;
resuming replays the same batches from the newest intact checkpoint, so a killed run resumed gives
the uninterrupted metrics.
"""

from __future__ import annotations

import math
import time

import torch

from ..config import RecipeError, stage_seq_len
from . import checkpoint
from .batches import batch_positions, batch_rows, rows_of_length
from .evaluation import evaluate
from .export import save_stage_model, stage_label
from .losses import objective_for, per_layer_values
from .metrics import MetricLogger, truncate_metrics
from .optim import make_optimizer, trainable_names
from .parallel import all_finite, all_mean, barrier, clip_gradients, data_parallel, is_main, is_sharded, world


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss or parameters); the message names the last good checkpoint."""


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; ``str()`` says where the run stopped and what to resume from."""


def _resume_point(run, resume: bool) -> tuple:
    """``(checkpoint path, state)`` to go on from (``(None, None)``: from the start), restored into the run."""
    if not resume:
        return None, None
    path, state = checkpoint.load_latest(run.out)
    if path is None and checkpoint.checkpoints(run.out):
        raise RecipeError(f"--resume: no checkpoint in {run.out / checkpoint.CKPT_DIR} reads back whole; "
                          "start a new run in another output.dir")
    if state is not None:
        try:
            checkpoint.restore(run, state)
        except ValueError as e:
            raise RecipeError(f"--resume: {e}") from None
    if is_main():
        truncate_metrics(run.out, state["step"] if state else 0)
    barrier()
    return path, state


def train(run, resume: bool, progress=None) -> dict:
    """Run every stage from the start or from the newest checkpoint; returns the final evaluation."""
    cfg = run.cfg
    names = sorted({n for st in cfg.stages for n in trainable_names(run.student, st)})
    resumed_from, state = _resume_point(run, resume)
    start_stage, start_step = (state["stage"], state["stage_step"]) if state else (0, 0)
    step = state["step"] if state else 0
    rank, size = world()
    logger = MetricLogger(run.out) if is_main() else None
    last_ckpt, si, last_eval = resumed_from, start_stage, None
    try:
        for si, st in enumerate(cfg.stages):
            if si < start_stage:
                continue
            opt, sched, _ = make_optimizer(run.student, st, cfg.optim, run.fsdp)
            first = start_step if si == start_stage else 0
            if state is not None and si == start_stage and state["opt_stage"] == si:
                checkpoint.restore_optimizer(run, opt, sched, state)
            objective = data_parallel(objective_for(st, run.student, run.teacher, run.fsdp), run.device, run.fsdp)
            params = [p for g in opt.param_groups for p in g["params"]]
            run.student.train()
            train_ids, train_pos = rows_of_length(run.data.train_ids, run.data.train_pos, stage_seq_len(cfg, st),
                                                 run.data.bos)
            for s in range(first, st.steps):
                t0 = time.perf_counter()
                rows = batch_rows(train_ids.shape[0], st.batch_size, step, cfg.seed)[rank::size]
                ids = train_ids[rows].to(run.device)
                pos = batch_positions(train_pos[rows], run.device)
                loss, per_layer = objective(ids, pos)
                run.student.zero_grad(set_to_none=True)
                loss.backward()
                if run.fsdp:  # FSDP reduces its shards' gradients; the unsharded ones (embeddings, norm, head) are ours
                    for p in params:
                        if p.grad is not None and not is_sharded(p.grad):
                            all_mean(p.grad)
                loss_value = all_mean(loss.detach().clone()).item()
                where = f"last good checkpoint: {last_ckpt or 'none'}"
                if not math.isfinite(loss_value):
                    raise TrainingError(f"loss became {loss_value} at stage {st.name} step {s}; stopped ({where})")
                if cfg.optim.grad_clip:
                    clip_gradients(params, cfg.optim.grad_clip)
                opt.step()
                sched.step()
                if not all_finite(params, run.device):
                    raise TrainingError(f"parameters became non-finite at stage {st.name} step {s}; stopped ({where})")
                step += 1
                rec = {"step": step, "stage": st.name, "stage_step": s + 1, "loss": loss_value,
                       "lr": sched.get_last_lr()[0], "tokens_per_s": ids.numel() * size / (time.perf_counter() - t0)}
                if run.device.type == "cuda":  # this process's peak so far, MiB
                    rec["peak_mem_mib"] = torch.cuda.max_memory_allocated(run.device) / 2**20
                if per_layer is not None:
                    rec["layer_loss"] = per_layer_values(per_layer)
                if (s + 1) % cfg.output.eval_every == 0 or s + 1 == st.steps:
                    last_eval = evaluate(run)
                    rec.update({f"eval_{k}": v for k, v in last_eval.items()})
                if logger is not None and ((s + 1) % cfg.output.log_every == 0 or "eval_kl" in rec):
                    logger.log(rec)
                if progress is not None and is_main():
                    progress(rec, step)
                if s + 1 == st.steps and cfg.output.save_stages and si + 1 < len(cfg.stages):
                    save_stage_model(run, stage_label(cfg.stages, si), step, last_eval)  # before the stage's last checkpoint: a kill
                    barrier()  # between the two redoes the stage's last steps from the one before, and saves again
                if step % cfg.output.checkpoint_every == 0 or s + 1 == st.steps:
                    nxt = (si, s + 1) if s + 1 < st.steps else (si + 1, 0)
                    last_ckpt = checkpoint.save(run, step, *nxt, opt, sched, si, names) or last_ckpt
                    barrier()
    except KeyboardInterrupt:
        last = last_ckpt
        raise TrainingInterrupted(f"interrupted at step {step} ({cfg.stages[min(si, len(cfg.stages) - 1)].name}); "
                                  f"last checkpoint: {last or 'none'}; continue the run with --resume") from None
    finally:
        if logger is not None:
            logger.close()
    return last_eval if last_eval is not None else evaluate(run)  # the last stage ends with an evaluation
