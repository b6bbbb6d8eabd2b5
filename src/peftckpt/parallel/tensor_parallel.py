"""Tensor parallelism with DTensor parameters and explicit, autograd-aware TP collectives.

Parameters are DTensors on the TP mesh (``Shard(dim)`` or ``Replicate()``), so optimizers, norms and
``torch.distributed.checkpoint`` see their true global shapes. The matmuls run on the local shards with
Megatron's two conjugate collectives, which keeps the math explicit and identical to one process:

* :func:`copy_to_tp` -- identity forward, all-reduce of the gradient backward (enters a TP region);
* :func:`reduce_from_tp` -- all-reduce forward, identity backward (leaves a row-parallel region).

A replicated parameter used *inside* a TP region (LoRA's A of a column-parallel layer) gets only a partial
gradient on each rank; it goes through :func:`copy_to_tp` itself so the backward sums the parts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["TensorParallel", "copy_to_tp", "reduce_from_tp", "local_tensor"]


@dataclass(frozen=True)
class TensorParallel:
    """The TP mesh of one rank (``None`` = no tensor parallelism) and how to shard parameters over it."""

    mesh: DeviceMesh | None = None

    @property
    def size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size()

    @property
    def rank(self) -> int:
        return 0 if self.mesh is None else self.mesh.get_local_rank()

    @property
    def group(self) -> dist.ProcessGroup | None:
        return None if self.mesh is None else self.mesh.get_group()

    def shard_of(self, full: torch.Tensor, dim: int | None, num_chunks: int = 1) -> torch.Tensor:
        """This rank's piece of ``full``: the whole tensor (``dim=None``) or, along ``dim``, its slice of
        each of ``num_chunks`` equal blocks, concatenated (``num_chunks=2`` for fused ``[gate; up]``)."""
        if dim is None or self.size == 1:
            return full
        blocks = full.chunk(num_chunks, dim=dim)
        return torch.cat([b.chunk(self.size, dim=dim)[self.rank] for b in blocks], dim=dim)

    def make_param(
        self, full: torch.Tensor, dim: int | None, num_chunks: int = 1, requires_grad: bool = True
    ) -> nn.Parameter:
        """A parameter holding this rank's shard of ``full`` (see :meth:`shard_of`); a DTensor when TP > 1."""
        local = self.shard_of(full, dim, num_chunks).contiguous()
        if self.mesh is None:
            return nn.Parameter(local, requires_grad=requires_grad)
        placement = Replicate() if dim is None else Shard(dim)
        dt = DTensor.from_local(local, self.mesh, [placement], run_check=False, shape=full.shape,
                                stride=full.stride())
        return nn.Parameter(dt, requires_grad=requires_grad)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (differentiable), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over TP backward. No-op without TP."""
    if tp.size == 1:
        return x
    return _CopyToTP.apply(x, tp.group)  # type: ignore[no-any-return]


def reduce_from_tp(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-reduce over TP forward; identity backward. No-op without TP."""
    if tp.size == 1:
        return x
    return _ReduceFromTP.apply(x, tp.group)  # type: ignore[no-any-return]
