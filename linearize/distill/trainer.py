"""``linearize distill``: the recipe runner. setup → train (stages) → save → cleanup.

Stages run in order over one global step counter:
- ``align``: one teacher forward per batch (no grad) captures every converted layer's attention
  input and output; each GDN block, run on the teacher's input, learns to reproduce the teacher's
  output (per-layer MSE or normalized MSE). Layers are independent graphs: no full-model graph.
- ``distill``: the student model against the teacher's logits: KL(teacher ‖ student) at a
  temperature, computed chunk by chunk through the LM head so vocabulary-sized logits never exist
  for the whole batch, plus optional cross-entropy.
Checkpoints (atomic, last K kept) hold the trained parameters, optimizer, scheduler, RNG and the
step; resuming replays the same batches, so a killed run resumed gives the uninterrupted losses.

Under ``torchrun`` the global batch is split across processes. ``parallel: ddp`` keeps the whole
model on every process and averages gradients; ``parallel: fsdp`` shards every decoder layer of
teacher and student with FSDP2 (``fully_shard``), gathering a layer's weights only while it runs —
for models whose teacher + student do not fit one GPU. Embeddings, final norm and LM head stay
whole; each attention block is its own unit, which the align stage calls alone. Checkpoints and the
saved model are gathered to full tensors.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import RecipeConfig, RecipeError, StageConfig, to_yaml
from .data import PackedData, build_data

CKPT_DIR = "checkpoints"


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss); the message names the last good checkpoint."""


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


# ---------------------------------------------------------------------------------------- processes


def world() -> tuple[int, int]:
    """``(rank, world_size)``; several under ``torchrun``, which sets the environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def init_distributed(device: torch.device) -> None:
    import torch.distributed as dist

    if world()[1] > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL's context on this process's own GPU, not GPU 0
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def all_mean(t: torch.Tensor) -> torch.Tensor:
    """Average over processes (a no-op for one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


# ---------------------------------------------------------------------------------------- setup


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RecipeError("device=cuda but no CUDA device is available; use device=cpu or auto")
    if name == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def check_output(out: Path, resume: bool) -> None:
    """Refuse another run's directory unless resuming it; refuse resuming nothing."""
    has_run = (out / "recipe.yaml").is_file()
    if resume and not has_run:
        raise RecipeError(f"--resume: {out} holds no run to resume (no recipe.yaml); drop --resume to start one")
    if not resume and out.exists() and any(out.iterdir()):
        what = "another run" if has_run else "files"
        raise RecipeError(f"output.dir {out} already holds {what}; pass --resume to continue it or choose another output.dir")


def budget(cfg: RecipeConfig) -> dict:
    rows = [s.steps * s.batch_size for s in cfg.stages]
    return {"stages": [{"name": s.name, "steps": s.steps, "tokens": r * cfg.data.seq_len}
                       for s, r in zip(cfg.stages, rows)],
            "total_steps": sum(s.steps for s in cfg.stages), "total_tokens": sum(rows) * cfg.data.seq_len}


def setup(cfg: RecipeConfig, resume: bool) -> Run:
    from .. import convert as convert_model
    from ..layers.gdn_attention import GDNOptions
    from ..models import load_teacher
    from ..models.families import family_of

    out = Path(cfg.output.dir)
    rank, size = world()
    for i, st in enumerate(cfg.stages):
        if st.batch_size % size:
            raise RecipeError(f"stages.{i}.batch_size={st.batch_size} must divide among {size} processes")
    check_output(out, resume)
    if resume:
        saved = (out / "recipe.yaml").read_text()
        if saved != to_yaml(cfg):
            raise RecipeError(f"--resume: the recipe differs from the one saved in {out / 'recipe.yaml'}; resume with that recipe")
    device = resolve_device(cfg.device)
    init_distributed(device)
    barrier()  # every process has checked the output directory before rank 0 writes into it
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    seed_everything(cfg.seed)
    teacher, tok = load_teacher(cfg.teacher.model)
    family_of(teacher.config)
    data = build_data(cfg.data, tok, getattr(teacher.config, "max_position_embeddings", None))
    student = copy.deepcopy(teacher)
    convert_model(student, layers=cfg.convert.layers, keep_softmax=cfg.convert.keep_softmax, tokenizer=tok,
                  calibration_tokens=cfg.convert.calibration_tokens,
                  options=GDNOptions(form=cfg.convert.form, beta_max=cfg.convert.beta_max))
    for i, st in enumerate(cfg.stages):
        if st.name == "align":
            try:
                align_weights(gdn_layers(student), st.layer_weights)
            except ValueError as e:
                raise RecipeError(f"stages.{i}.{e}") from None
    add_lora(student, cfg)
    teacher.to(device=device, dtype=dtype).requires_grad_(False)
    student.to(device=device, dtype=dtype)
    if dtype != torch.float32:
        float32_trainables(student, {n for st in cfg.stages for n in trainable_names(student, st)}, dtype)
    fsdp, skeleton = cfg.parallel == "fsdp" and size > 1, None
    if fsdp:
        skeleton = copy.deepcopy(student).cpu() if rank == 0 else None
        # FSDP2 fixes which parameters take gradients when it first gathers them: every parameter any
        # stage trains keeps requires_grad for the whole run; each stage's optimizer holds its own
        union = {n for st in cfg.stages for n in trainable_names(student, st)}
        for n, p in student.named_parameters():
            p.requires_grad_(n in union)
        shard_layers(teacher, device)
        shard_layers(student, device)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.yaml").write_text(to_yaml(cfg))
    barrier()
    return Run(cfg, out, device, dtype, teacher, student, tok, data, fsdp, skeleton)


def shard_layers(model, device: torch.device) -> None:
    """FSDP2: each decoder layer one unit, its parameters sharded over all processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ..models.adapters import decoder_layers

    mesh = init_device_mesh(device.type, (world()[1],))
    for layer in decoder_layers(model):
        fully_shard(layer.self_attn, mesh=mesh)  # its own unit: the align stage calls it alone
        fully_shard(layer, mesh=mesh)
    # the model itself is the root unit (FSDP's end-of-backward hook lives there) but owns no shards:
    # embeddings, final norm and LM head stay whole, so the LM head can run chunk by chunk afterwards
    fully_shard(model, mesh=mesh, ignored_params={p for p in model.parameters() if not is_sharded(p)})
    with torch.no_grad():  # FSDP sets its units up at the root's first forward; align calls blocks directly
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False, logits_to_keep=1)


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP shard (a collective: every process calls it), or ``t`` itself."""
    return t.full_tensor() if is_sharded(t) else t


def add_lora(model, cfg: RecipeConfig) -> bool:
    """Inject peft LoRA layers (largest rank any stage asks for) in place; names keep their paths."""
    stages = [st for st in cfg.stages if st.lora_rank > 0]
    if not stages:
        return False
    from peft import LoraConfig, inject_adapter_in_model

    rank = max(st.lora_rank for st in stages)
    targets = sorted({t.strip() for st in stages for t in st.lora_targets.split(",") if t.strip()})
    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets), model)
    return True


class _CastTo(torch.nn.Module):
    """Parametrization: the module sees its float32 parameter in the compute dtype."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


def float32_trainables(model, names: set[str], dtype: torch.dtype) -> None:
    """Keep every trainable parameter in float32 in a bf16 model (mixed precision with float32 master
    weights): an AdamW step of lr ~1e-4 is below bf16's resolution of a weight ~0.03 (and of ρ ≈ 1),
    so bf16 parameters would lose most updates. Modules see them cast to ``dtype`` on each use
    (``torch.nn.utils.parametrize``; the names gain ``.parametrizations.<name>.original``); ρ is used in
    float32 by the Taylor front anyway and is simply kept float32."""
    from torch.nn.utils import parametrize

    from ..layers import GDNAttention

    for name in sorted(names):
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        p = getattr(mod, attr)
        setattr(mod, attr, torch.nn.Parameter(p.detach().float(), requires_grad=p.requires_grad))
        if not (isinstance(mod, GDNAttention) and attr == "rho"):
            parametrize.register_parametrization(mod, attr, _CastTo(dtype), unsafe=True)


def remove_casts(model) -> None:
    """Undo :func:`float32_trainables` before saving: parameters back in the model's dtype."""
    from torch.nn.utils import parametrize

    for mod in list(model.modules()):
        if parametrize.is_parametrized(mod):
            for attr in list(mod.parametrizations):
                value = getattr(mod, attr).detach().clone()  # the float32 original, cast
                parametrize.remove_parametrizations(mod, attr, leave_parametrized=False)
                setattr(mod, attr, torch.nn.Parameter(value, requires_grad=False))


def merge_lora(model) -> dict | None:
    """Fold every LoRA layer into its base ``nn.Linear`` and put the plain layer back; returns the adapter."""
    from peft.tuners.lora import LoraLayer

    adapter = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if "lora_" in n}
    if not adapter:
        return None
    for name, module in list(model.named_modules()):
        if isinstance(module, LoraLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, module.get_base_layer())
    return adapter


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------------------------------- batches


def batch_rows(num_rows: int, batch_size: int, step: int, seed: int) -> torch.Tensor:
    """Rows of global step ``step``: a fixed permutation per epoch, so resume replays exactly."""
    per_epoch = max(1, num_rows // batch_size)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    idx = perm[(i * batch_size) % num_rows:][:batch_size]
    if idx.numel() < batch_size:  # fewer rows than a batch: wrap around
        idx = torch.cat([idx, perm[: batch_size - idx.numel()]])
    return idx


# ---------------------------------------------------------------------------------------- losses


def gdn_layers(model):
    from ..layers.gdn_attention import GDNAttention
    from ..models.adapters import decoder_layers

    return {i: layer.self_attn for i, layer in enumerate(decoder_layers(model)) if isinstance(layer.self_attn, GDNAttention)}


def align_weights(layers, layer_weights: dict | None) -> dict[int, float]:
    """Each converted layer's weight in the align loss: ``layer_weights[i]``, else 1."""
    unknown = sorted(set(layer_weights or {}) - set(layers))
    if unknown:
        raise ValueError(f"layer_weights names layers {unknown}, which are not converted GDN layers "
                         f"(converted: {sorted(layers)}); use their indices")
    weights = {i: float((layer_weights or {}).get(i, 1.0)) for i in layers}
    if sum(weights.values()) <= 0:
        raise ValueError("layer_weights gives every converted layer weight 0: nothing would train")
    return weights


class _RowSquaredError(torch.autograd.Function):
    """``Σ (out − ref)²`` per row of ``(B, T, C)``, accumulated in float32; ``ref`` is a constant.

    The same value autograd gets from ``(out.float() - ref.float()).pow(2).sum((1, 2))``, in fewer passes
    over the activations (three forward, four backward), and without holding a float32 copy of the
    difference for every layer until the backward: the difference is recomputed there."""

    @staticmethod
    def forward(ctx, out, ref):
        ctx.save_for_backward(out, ref)
        return torch.linalg.vector_norm(out.float() - ref, dim=(1, 2)).square()  # not in place: fp32 out is out

    @staticmethod
    def backward(ctx, grad):
        out, ref = ctx.saved_tensors
        return (out.float() - ref).mul_(2 * grad[:, None, None]).to(out.dtype), None


def _row_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's per-row ``(Σ (out − ref)², Σ ref²)``, float32, ``(B,)`` each; the first differentiable."""
    if out.is_cuda:
        from ..ops.triton.rowsq import row_squared_errors

        sse, ref_sq = row_squared_errors(out.unsqueeze(2), [ref])
        return sse[0], ref_sq[0]
    with torch.no_grad():
        ref_sq = torch.linalg.vector_norm(ref, dim=(1, 2), dtype=torch.float32).square()
    return _RowSquaredError.apply(out, ref), ref_sq


def align_loss(run: Run, ids, pos, kind: str, layer_weights: dict | None = None,
               batched: bool = True) -> tuple[torch.Tensor, dict]:
    """Weighted mean over the converted layers of each block's (normalized) MSE to the teacher's attention
    output (``layer_weights``: ``{layer index: weight}``, others 1); and ``{layer: loss}`` as detached
    0-dim tensors — read back (``per_layer_values``) only after the backward, so no layer waits on a host
    sync while the GPU drains its queue. ``batched``: all blocks in one front and operator call where
    :func:`linearize.layers.gdn_attention.batched_attention_outputs` applies (not under FSDP), and every
    layer's squared errors in one Triton pass each way (``ops/triton/rowsq.py``) on the stacked output.
    A layer of weight 0 adds nothing to the loss and its block gets no gradient: its error is computed
    apart, without autograd (on the batched path it would otherwise share the others' operator call and
    get a zero gradient, which weight decay would act on)."""
    from ..eval import capture_attention

    layers = gdn_layers(run.student)
    weights = align_weights(layers, layer_weights)
    caps = capture_attention(run.teacher, ids, list(layers), position_ids=pos, stop_early=not run.fsdp)
    live = {i: gdn for i, gdn in layers.items() if weights[i]}
    found = _layer_errors(run, live, caps, pos, batched)
    if len(live) < len(layers):
        with torch.no_grad():
            found.update(_layer_errors(run, {i: gdn for i, gdn in layers.items() if i not in live}, caps, pos, batched))
    per_layer = {}
    total = 0.0
    for i in layers:
        sse_i, ref_sq_i = found[i]
        n = caps[i].output[0].numel()
        err = sse_i / n  # per row, so shards average exactly
        if kind == "nmse":  # over the teacher's own mean square (a constant)
            err = err / (ref_sq_i / n).clamp_min(1e-12)
        err = err.mean()
        per_layer[i] = err.detach()
        if weights[i]:
            total = total + weights[i] * err
    return total / sum(weights.values()), per_layer


def _layer_errors(run: Run, layers: dict, caps: dict, pos, batched: bool) -> dict:
    """``{layer: (Σ squared error, Σ teacher square) per row}`` of each block on the teacher's captured
    input: every block in one :func:`linearize.layers.gdn_attention.batched_attention_outputs` call and one
    Triton pass over the stacked output where that applies, else block by block."""
    from ..layers.gdn_attention import batched_attention_outputs

    if not layers:
        return {}
    refs = [caps[i].output.detach() for i in layers]
    o = None
    pe = caps[next(iter(layers))].position_embeddings
    if batched and not run.fsdp and all(caps[i].position_embeddings is pe for i in layers):
        o = batched_attention_outputs(list(layers.values()), [caps[i].hidden_states for i in layers], pe, pos)
    if o is not None:  # (B, T, layer, D)
        from ..ops.triton.rowsq import row_squared_errors

        sse, ref_sq = row_squared_errors(o, refs)
        return dict(zip(layers, zip(sse.unbind(0), ref_sq.unbind(0))))
    # layer by layer through the block's forward (not attention_output), so FSDP gathers its weights
    return {i: _row_errors(gdn(caps[i].hidden_states, caps[i].position_embeddings, position_ids=pos, pre_o_proj=True),
                           ref) for (i, gdn), ref in zip(layers.items(), refs)}


def per_layer_values(per_layer: dict) -> dict:
    """``{layer: float}`` from ``align_loss``'s tensors, in one device→host copy."""
    return dict(zip(per_layer, torch.stack(list(per_layer.values())).tolist())) if per_layer else {}


def chunked_kl(student_h, teacher_h, lm_s, lm_t, labels, T: float, chunk: int, ce_weight: float):
    """KL(teacher ‖ student) per token at temperature T (× T²), and optional CE, chunk by chunk: each chunk's
    logits go through :func:`linearize.ops.kl.kl_loss`, which keeps only their gradient for the backward."""
    from ..ops.kl import kl_loss

    s_flat, t_flat = student_h.flatten(0, 1), teacher_h.flatten(0, 1)
    y = labels.flatten()
    n = s_flat.shape[0]
    ce_w = None
    if ce_weight:  # a device scalar: no host sync for the count of real targets
        ce_w = ce_weight / (y != -100).sum().clamp_min(1).float()
    total = 0.0
    for a in range(0, n, chunk):
        ls = lm_s(s_flat[a:a + chunk])
        with torch.no_grad():
            lt = lm_t(t_flat[a:a + chunk])
        total = total + kl_loss(ls, lt, y[a:a + chunk], T, kl_weight=1.0 / n, ce_weight=ce_w)
    return total


def batch_positions(pos: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """The ``position_ids`` to give the models for a batch whose positions are ``pos`` (on the host): None
    when every row is one document from position 0 — the models' own default, with no document tables to
    build, and no host sync in transformers' mask code, which reads ``position_ids`` back to look for
    packed documents — else ``pos`` on ``device``."""
    if pos.device.type == "cpu" and torch.equal(pos, torch.arange(pos.shape[1]).expand_as(pos)):
        return None
    return pos.to(device)


def next_token_labels(ids, pos):
    """Labels for next-token prediction; no target across a document boundary (``pos`` None: every row is
    one document) or at a row end."""
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    if pos is not None:
        labels[:, :-1][pos[:, 1:] == 0] = -100
    return labels


def last_hidden(model, ids, pos) -> torch.Tensor:
    """The final (normed) hidden states, through the model's own forward — which FSDP needs — with
    logits for one position only: the LM head then runs chunk by chunk."""
    out = model(input_ids=ids, position_ids=pos, use_cache=False, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


def distill_loss(run: Run, ids, pos, st: StageConfig) -> torch.Tensor:
    with torch.no_grad():
        th = last_hidden(run.teacher, ids, pos)
    sh = last_hidden(run.student, ids, pos)
    return chunked_kl(sh, th, run.student.lm_head, run.teacher.lm_head, next_token_labels(ids, pos),
                      st.temperature, st.kl_chunk, st.ce_weight)


# ---------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(run: Run, chunk: int = 1024) -> dict:
    """Held-out perplexity of teacher and student, KL(teacher ‖ student), top-1 agreement — logits
    made ``chunk`` tokens at a time through each LM head, never for the whole batch."""
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
        kl += (lt.exp() * (lt - ls)).sum().item()
        agree += (lt.argmax(-1) == ls.argmax(-1)).sum().item()
    return {"ppl_teacher": math.exp(ce["teacher"] / max(valid, 1)), "ppl_student": math.exp(ce["student"] / max(valid, 1)),
            "kl": kl / n, "top1_agreement": agree / n}


# ---------------------------------------------------------------------------------------- checkpoints


def trainable_names(model, st: StageConfig) -> list[str]:
    keys = [k.strip() for k in st.trainable.split(",") if k.strip()]
    names = [n for n, _ in model.named_parameters() if keys == ["all"] or any(k in n for k in keys)]
    if not names:
        raise RecipeError(f"stage {st.name}: trainable={st.trainable!r} matches no parameter of the student")
    return names


def save_checkpoint(run: Run, step: int, stage_idx: int, stage_step: int, opt, sched, names_union) -> Path | None:
    """Every process calls this (FSDP gathers shards); rank 0 writes. Returns the path on rank 0."""
    params = dict(run.student.named_parameters())
    full = {n: full_tensor(params[n].detach()).cpu() for n in names_union}
    if run.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optim = get_optimizer_state_dict(run.student, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        optim = opt.state_dict()
    if world()[0] != 0:
        return None
    state = {
        "step": step, "stage": stage_idx, "stage_step": stage_step, "params": full,
        "optimizer": optim, "scheduler": sched.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
    }
    d = run.out / CKPT_DIR
    d.mkdir(exist_ok=True)
    final = d / f"step_{step:08d}.pt"
    fd, tmp = tempfile.mkstemp(prefix="partial-", suffix=".pt", dir=d)  # torch.save needs a stem
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, final)  # atomic: a kill leaves either the old set or the new file, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in sorted(d.glob("step_*.pt"))[: -run.cfg.output.keep_last]:
        old.unlink()
    return final


def latest_checkpoint(out: Path) -> Path | None:
    found = sorted((out / CKPT_DIR).glob("step_*.pt"))
    return found[-1] if found else None


def load_checkpoint(run: Run, path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    params = dict(run.student.named_parameters())
    with torch.no_grad():
        for n, t in state["params"].items():
            p = params[n]
            t = t.to(p.device, p.dtype)
            if is_sharded(p):  # this process's shard of the whole tensor
                from torch.distributed.tensor import distribute_tensor

                t = distribute_tensor(t, p.device_mesh, p.placements)
            p.copy_(t)
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return state


# ---------------------------------------------------------------------------------------- training


def make_optimizer(run: Run, st: StageConfig):
    names = trainable_names(run.student, st)
    params = dict(run.student.named_parameters())
    if not run.fsdp:  # under FSDP every stage's parameters keep requires_grad (see setup)
        run.student.requires_grad_(False)
        for n in names:
            params[n].requires_grad_(True)
    opt = torch.optim.AdamW([params[n] for n in names], lr=st.lr, weight_decay=run.cfg.optim.weight_decay)
    warm = run.cfg.optim.warmup_steps

    def lr_at(s):  # linear warm-up, then cosine to 10%
        if s < warm:
            return (s + 1) / warm
        frac = (s - warm) / max(1, st.steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_at), names


def clip_gradients(params: list, max_norm: float) -> None:
    """``clip_grad_norm_`` that also takes FSDP shards: their squared norms are summed over processes."""
    grads = [p.grad for p in params if p.grad is not None]
    if not any(is_sharded(g) for g in grads):
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    import torch.distributed as dist

    sharded = sum(g.to_local().float().pow(2).sum() for g in grads if is_sharded(g))
    dist.all_reduce(sharded)
    whole = sum((g.float().pow(2).sum() for g in grads if not is_sharded(g)), torch.zeros_like(sharded))
    coef = (max_norm / ((sharded + whole).sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        (g.to_local() if is_sharded(g) else g).mul_(coef.to(g.dtype))


def log_metrics(run: Run, record: dict) -> None:
    with open(run.out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    writer = tensorboard(run)
    for key, value in record.items():
        if isinstance(value, (int, float)) and key not in ("step", "stage_step"):
            writer.add_scalar(f"{record['stage']}/{key}" if not key.startswith("eval_") else key, value, record["step"])
    writer.flush()


_WRITERS: dict[Path, object] = {}


class _NoWriter:
    def add_scalar(self, *a, **k):
        pass

    def flush(self):
        pass


def tensorboard(run: Run):
    """A SummaryWriter in ``output.dir/tensorboard`` (a no-op where the tensorboard package is missing)."""
    if run.out not in _WRITERS:
        try:
            from torch.utils.tensorboard import SummaryWriter

            _WRITERS[run.out] = SummaryWriter(str(run.out / "tensorboard"))
        except ImportError:
            _WRITERS[run.out] = _NoWriter()
    return _WRITERS[run.out]


def truncate_metrics(out: Path, step: int) -> None:
    """After a resume from ``step``, drop records the killed run wrote past it."""
    p = out / "metrics.jsonl"
    if p.is_file():
        keep = [line for line in p.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        p.write_text("".join(line + "\n" for line in keep))


def train(run: Run, resume: bool, progress=None) -> dict:
    cfg = run.cfg
    names_union = sorted({n for st in cfg.stages for n in trainable_names(run.student, st)})
    start_stage, start_step, state = 0, 0, None
    if resume and (ckpt := latest_checkpoint(run.out)) is not None:
        state = load_checkpoint(run, ckpt)
        start_stage, start_step = state["stage"], state["stage_step"]
    if resume and world()[0] == 0:
        truncate_metrics(run.out, state["step"] if state else 0)
    barrier()
    step = 0 if state is None else state["step"]
    rank, size = world()
    last_ckpt = None
    for si, st in enumerate(cfg.stages):
        if si < start_stage:
            continue
        opt, sched, _ = make_optimizer(run, st)
        first = start_step if si == start_stage else 0
        if state is not None and si == start_stage and first < st.steps:
            if run.fsdp:
                from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

                set_optimizer_state_dict(run.student, opt, state["optimizer"], options=StateDictOptions(full_state_dict=True))
            else:
                opt.load_state_dict(state["optimizer"])
            sched.load_state_dict(state["scheduler"])
        run.student.train()
        for s in range(first, st.steps):
            t0 = time.perf_counter()
            rows = batch_rows(run.data.train_ids.shape[0], st.batch_size, step, cfg.seed)[rank::size]
            ids = run.data.train_ids[rows].to(run.device)
            pos = batch_positions(run.data.train_pos[rows], run.device)
            if st.name == "align":
                loss, per_layer = align_loss(run, ids, pos, st.loss, st.layer_weights)
            else:
                loss, per_layer = distill_loss(run, ids, pos, st), None
            run.student.zero_grad(set_to_none=True)
            loss.backward()
            loss_value = all_mean(loss.detach().clone()).item()
            if not math.isfinite(loss_value):
                where = f"last good checkpoint: {last_ckpt or latest_checkpoint(run.out) or 'none'}"
                raise TrainingError(f"loss became {loss_value} at stage {st.name} step {s}; stopped ({where})")
            for p in (p for g in opt.param_groups for p in g["params"] if p.grad is not None):
                if not is_sharded(p.grad):  # FSDP has already averaged the shards' gradients
                    all_mean(p.grad)  # data parallel: the gradient of the global batch's mean loss
            if cfg.optim.grad_clip:
                clip_gradients([p for g in opt.param_groups for p in g["params"]], cfg.optim.grad_clip)
            opt.step()
            sched.step()
            step += 1
            dt = time.perf_counter() - t0
            rec = {"step": step, "stage": st.name, "stage_step": s + 1, "loss": loss_value,
                   "lr": sched.get_last_lr()[0], "tokens_per_s": ids.numel() * size / dt}
            if per_layer is not None:
                rec["layer_loss"] = per_layer_values(per_layer)
            if (s + 1) % cfg.output.eval_every == 0 or s + 1 == st.steps:
                run.student.eval()
                rec.update({f"eval_{k}": v for k, v in evaluate(run).items()})
                run.student.train()
            if rank == 0 and ((s + 1) % cfg.output.log_every == 0 or "eval_kl" in rec):
                log_metrics(run, rec)
            if progress is not None and rank == 0:
                progress(rec, step)
            if step % cfg.output.checkpoint_every == 0 or s + 1 == st.steps:
                nxt_stage, nxt_step = (si, s + 1) if s + 1 < st.steps else (si + 1, 0)
                last_ckpt = save_checkpoint(run, step, nxt_stage, nxt_step, opt, sched, names_union) or last_ckpt
                barrier()
        start_step = 0
    run.student.eval()
    return evaluate(run)


def finish(run: Run, final_eval: dict, initial_eval: dict | None) -> Path:
    """Save the student in the convert format (LoRA merged), the loss plot and a summary."""
    from safetensors.torch import save_file

    from .. import save

    model = run.student
    if run.fsdp:  # gather the whole model (every process), save it from rank 0's unsharded copy
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        whole = get_model_state_dict(run.student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if world()[0] != 0:
            return run.out / "model"
        run.skeleton.load_state_dict(whole)
        model = run.skeleton
    remove_casts(model)
    adapter = merge_lora(model)

    def extra(folder: Path):
        (folder / "distill_summary.json").write_text(json.dumps({"initial": initial_eval, "final": final_eval}, indent=1))
        if adapter is not None and run.cfg.output.keep_adapter:
            save_file({k: v.contiguous() for k, v in adapter.items()}, folder / "lora_adapter.safetensors")

    model_dir = save(model, run.tokenizer, run.out / "model", force=True, extra=extra)
    plot_losses(run.out)
    return model_dir


def plot_losses(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = out / "metrics.jsonl"
    if not p.is_file():
        return
    recs = [json.loads(line) for line in p.read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(7, 4))
    for stage in dict.fromkeys(r["stage"] for r in recs):
        rs = [r for r in recs if r["stage"] == stage]
        ax.plot([r["step"] for r in rs], [r["loss"] for r in rs], label=f"{stage} loss")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "losses.png", dpi=110)
    plt.close(fig)


def run_recipe(cfg: RecipeConfig, resume: bool = False, progress=None) -> dict:
    """setup → evaluate at init → train → save. Returns the summary."""
    run = setup(cfg, resume)
    initial = None
    if not resume:
        run.student.eval()
        initial = evaluate(run)
        if world()[0] == 0:
            (run.out / "initial_eval.json").write_text(json.dumps(initial, indent=1))
    elif (run.out / "initial_eval.json").is_file():
        initial = json.loads((run.out / "initial_eval.json").read_text())
    final = train(run, resume, progress)
    model_dir = run.out / "model"
    if world()[0] == 0 or run.fsdp:  # FSDP: every process takes part in gathering the model
        finish(run, final, initial)
    barrier()
    return {"initial": initial, "final": final, "model": str(model_dir), "budget": budget(cfg)}
