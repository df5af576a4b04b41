"""Run setup, in a fixed order: processes and device → output directory (lock, resume check, stale
files) → seed → teacher, data → student (convert, LoRA, float32 masters) → sharding → the recipe saved."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import RecipeConfig, RecipeError, check_conversion, to_yaml
from ..saving import write_atomic
from .data import PackedData, build_data
from .lora import add_lora
from .optim import trainable_names
from .parallel import barrier, init_distributed, is_main, shard_layers, world
from .precision import float32_trainables
from .rundir import RunLock, check_output, clean_stale


@dataclass
class Run:
    cfg: RecipeConfig
    out: Path
    device: torch.device
    dtype: torch.dtype
    teacher: torch.nn.Module
    student: torch.nn.Module
    tokenizer: object
    data: PackedData
    fsdp: bool = False  # decoder layers sharded with FSDP2 (parallel: fsdp under torchrun)
    skeleton: torch.nn.Module | None = None  # FSDP, rank 0: an unsharded CPU copy to save the model into
    lock: RunLock | None = None  # rank 0 holds output.dir's lock for the whole run


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device=cuda but no CUDA device is available; use device=cpu or auto")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def setup(cfg: RecipeConfig, resume: bool) -> Run:
    out = Path(cfg.output.dir)
    rank, size = world()
    for i, st in enumerate(cfg.stages):
        if st.batch_size % size:
            raise RecipeError(f"stages.{i}.batch_size={st.batch_size} must divide among {size} processes")
    lock = RunLock(out) if rank == 0 else None
    if lock is not None:
        lock.acquire()
    try:
        check_output(out, resume)
        if resume and (out / "recipe.yaml").read_text() != to_yaml(cfg):
            raise RecipeError(f"--resume: the recipe differs from the one saved in {out / 'recipe.yaml'}; resume with that recipe")
        device = resolve_device(cfg.device)
        init_distributed(device)
        barrier()  # every process has checked the output directory before rank 0 writes into it
        if rank == 0:
            clean_stale(out)
        run = _build(cfg, out, device)
        run.lock = lock
        if rank == 0:
            write_atomic(out / "recipe.yaml", to_yaml(cfg))
        barrier()
        return run
    except BaseException:
        if lock is not None:
            lock.release(failed=True)
        raise


def _build(cfg: RecipeConfig, out: Path, device: torch.device) -> Run:
    from transformers import set_seed

    from ..conversion import convert
    from ..layers import GDNOptions
    from ..models import load_teacher
    from ..models.families import family_of
    from .losses import align_weights, gdn_layers

    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    set_seed(cfg.seed)
    teacher, tok = load_teacher(cfg.teacher.model)
    family_of(teacher.config)
    check_conversion(cfg.convert.layers, cfg.convert.keep_softmax, teacher.config.num_hidden_layers,
                     ("convert.layers", "convert.keep_softmax"), config=teacher.config)  # what global names
    data = build_data(cfg.data, tok, getattr(teacher.config, "max_position_embeddings", None))
    fsdp = cfg.parallel == "fsdp" and world()[1] > 1
    # converted where it trains, unless sharded: the attention capture, ρ, the sparse cache's probes and the
    # calibration steps run on the GPU, not on the host's CPU (176 s for the corpus recipe's conversion on a
    # 2-core CPU; 100 calibration steps held 12 cores for over 10 minutes beside two other runs)
    student = copy.deepcopy(teacher).to("cpu" if fsdp else device)
    convert(student, to=cfg.convert.to, layers=cfg.convert.layers, keep_softmax=cfg.convert.keep_softmax, tokenizer=tok,
            calibration_tokens=cfg.convert.calibration_tokens, calibration_steps=cfg.convert.calibration_steps,
            options=GDNOptions(form=cfg.convert.form, beta_max=cfg.convert.beta_max, short_conv=cfg.convert.short_conv,
                               window=cfg.convert.window, sinks=cfg.convert.sinks, output_gate=cfg.convert.output_gate,
                               calibrate_mix=cfg.convert.calibrate_mix, decay_rank=cfg.convert.decay_rank,
                               write_gate=cfg.convert.write_gate, mix_order=cfg.convert.mix_order,
                               sparse_cache=cfg.convert.sparse_cache, fused_front=cfg.convert.fused_front))
    for i, st in enumerate(cfg.stages):
        if st.name == "align":
            try:
                align_weights(gdn_layers(student), st.layer_weights)
            except ValueError as e:
                raise RecipeError(f"stages.{i}.{e}") from None
    add_lora(student, cfg)
    teacher.to(device=device, dtype=dtype).requires_grad_(False)
    student.to(device=device, dtype=dtype)
    union = {n for st in cfg.stages for n in trainable_names(student, st)}
    if dtype != torch.float32:
        float32_trainables(student, union, dtype)
        union = {n for st in cfg.stages for n in trainable_names(student, st)}
    skeleton = None
    if fsdp:
        skeleton = copy.deepcopy(student).cpu() if is_main() else None
        # FSDP2 fixes which parameters take gradients when it first gathers them: every parameter any
        # stage trains keeps requires_grad for the whole run; each stage's optimizer holds its own
        for n, p in student.named_parameters():
            p.requires_grad_(n in union)
        shard_layers(teacher, device)
        shard_layers(student, device)
    return Run(cfg, out, device, dtype, teacher, student, tok, data, fsdp, skeleton)


def cleanup(run: Run) -> None:
    if run.lock is not None:
        run.lock.release()
