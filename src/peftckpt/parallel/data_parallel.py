"""Data parallelism: gradient averaging (replicated optimizer) or FSDP2 (``--use-distributed-optimizer``),
plus the global gradient norm, which must count every element exactly once under any layout."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from .tensor_parallel import local_tensor

__all__ = ["allreduce_gradients", "shard_for_distributed_optimizer", "clip_grad_norm"]


def allreduce_gradients(params: Iterable[nn.Parameter], dp_group: dist.ProcessGroup, dp_size: int) -> None:
    """Average the local gradients of ``params`` over the data-parallel group (one coalesced all-reduce)."""
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat.div_(dp_size)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def shard_for_distributed_optimizer(chunks: Sequence[nn.Module], dp_mesh: DeviceMesh,
                                    layer_type: type[nn.Module], kept_whole: set[nn.Parameter] | None = None) -> None:
    """FSDP2 over DP: parameters, gradients and optimizer state are sharded; frozen parameters are sharded
    too (they need no gradient, so a frozen base costs 1/dp of its memory per rank), except ``kept_whole``:
    frozen parameters FSDP leaves alone (each DP rank holds them as without it), such as base weights that are
    replaced by their NF4 codes once loaded (a module FSDP manages may not swap its parameters)."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, layer_type):
                fully_shard(module, mesh=dp_mesh, ignored_params=kept_whole)
        fully_shard(chunk, mesh=dp_mesh, ignored_params=kept_whole)


def _replicas(t: torch.Tensor, ranks_per_stage: int) -> int:
    """How many ranks of one pipeline stage hold this same local piece."""
    if not isinstance(t, DTensor):
        return ranks_per_stage
    shards = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if isinstance(p, Shard))
    return ranks_per_stage // shards


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float, ranks_per_stage: int,
                   distributed: bool, device: torch.device | str = "cpu",
                   counted_elsewhere: Sequence[nn.Parameter] = ()) -> float:
    """Global L2 norm of all gradients (over TP, PP and DP); scale them down to ``max_norm`` if larger
    (``max_norm <= 0``: measure only). ``ranks_per_stage`` = ``tp * dp``; ``device``: the gradients';
    ``counted_elsewhere``: copies of a parameter another stage holds too (tied embeddings), scaled but not
    measured. Returns the norm before clipping."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    skip = {id(p) for p in counted_elsewhere}
    for p in params:
        if p.grad is None or id(p) in skip:
            continue
        g = local_tensor(p.grad)
        total += g.double().pow(2).sum() / _replicas(p.grad, ranks_per_stage)
    if distributed:
        dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm > 0 and norm > max_norm:
        coeff = max_norm / (norm + 1e-6)
        for p in params:
            if p.grad is not None:
                local_tensor(p.grad).mul_(coeff)
    return norm
