"""Processes and parallelism: the torchrun world, data parallel (``DistributedDataParallel``) and FSDP2.

``parallel: ddp`` keeps the whole student on every process; ``DistributedDataParallel`` wraps the stage's
objective (``losses.py``), so gradients are averaged while the backward still runs. ``parallel: fsdp``
shards every decoder layer of teacher and student with FSDP2 (``fully_shard``), gathering a layer's
weights only while it runs; embeddings, final norm and LM head stay whole. Each attention block is its
own unit, and the align stage reaches it through ``attention_output``, registered as an FSDP forward
method so its weights are gathered around that call too.
"""

from __future__ import annotations

import os

import torch


def world() -> tuple[int, int]:
    """``(rank, world_size)``; several under ``torchrun``, which sets the environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def is_main() -> bool:
    return world()[0] == 0


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
    """Average over processes, in place (a no-op for one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def all_true(flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on every process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return flag
    t = torch.tensor([0.0 if flag else 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item() == 0


def data_parallel(objective: torch.nn.Module, device: torch.device, fsdp: bool) -> torch.nn.Module:
    """The objective as the training step calls it: under several processes without FSDP, wrapped in
    ``DistributedDataParallel`` (gradients of the global batch's mean loss, reduced in buckets during
    the backward); otherwise itself (one process, or FSDP, which reduces its shards' gradients)."""
    import torch.distributed as dist

    if fsdp or not dist.is_initialized():
        return objective
    from torch.nn.parallel import DistributedDataParallel

    # a stage's trainable set may hold parameters its loss does not reach (align: o_proj, layers of
    # weight 0, blocks kept softmax): find_unused_parameters leaves their gradients None on every process
    return DistributedDataParallel(objective, device_ids=[device] if device.type == "cuda" else None,
                                   find_unused_parameters=True, broadcast_buffers=False)


def shard_layers(model, device: torch.device) -> None:
    """FSDP2: each decoder layer one unit, its parameters sharded over all processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from ..layers import GDNAttention
    from ..models.adapters import decoder_layers

    mesh = init_device_mesh(device.type, (world()[1],))
    for layer in decoder_layers(model):
        fully_shard(layer.self_attn, mesh=mesh)  # its own unit: the align stage calls it alone
        if isinstance(layer.self_attn, GDNAttention):
            register_fsdp_forward_method(layer.self_attn, "attention_output")
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


def all_finite(params: list, device: torch.device) -> bool:
    """Whether every parameter (its local shard under FSDP) is finite, on every process."""
    # each tensor's max |x|, NaN kept (a NaN anywhere makes it NaN, an inf inf), by foreach launches over the
    # tensors of one device and dtype (mixed ones would take a kernel each), where a check a parameter launched
    # five kernels (over two thousand a step on SmolLM2); an empty shard (FSDP: fewer rows than processes) is
    # finite, and the infinity norm refuses it
    groups: dict = {}
    for p in params:
        t = (p.to_local() if is_sharded(p) else p).detach()
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t)
    norms = [n.float() for g in groups.values() for n in torch._foreach_norm(g, float("inf"))]
    ok = bool(torch.stack(norms).isfinite().all()) if norms else True
    return all_true(ok, device)
