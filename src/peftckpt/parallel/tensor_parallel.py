"""Tensor parallelism with DTensor parameters and explicit, autograd-aware TP collectives.

Parameters are DTensors on the TP mesh (``Shard(dim)`` or ``Replicate()``), so optimizers, norms and
``torch.distributed.checkpoint`` see their true global shapes. The matmuls run on the local shards with
Megatron's two conjugate collectives, which keeps the math explicit and identical to one process:

* :func:`copy_to_tp` -- identity forward, all-reduce of the gradient backward (enters a TP region);
* :func:`reduce_from_tp` -- all-reduce forward, identity backward (leaves a row-parallel region).

A replicated parameter used *inside* a TP region (LoRA's A of a column-parallel layer) gets only a partial
gradient on each rank; it goes through :func:`copy_to_tp` itself so the backward sums the parts.

Parameters can also be created without values (:meth:`TensorParallel.empty_param`, e.g. on the meta device)
and filled later from a full tensor (:meth:`TensorParallel.fill_param`): a rank then holds only its shards,
plus the one full tensor being sliced.
"""

from __future__ import annotations

from collections.abc import Sequence
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
        return self._wrap(local, full.shape, dim, requires_grad)

    def local_shape(self, shape: Sequence[int], dim: int | None, num_chunks: int = 1) -> torch.Size:
        """The shape of this rank's shard (see :meth:`shard_of`) of a tensor of global ``shape``."""
        return self.shard_of(torch.empty(tuple(shape), device="meta"), dim, num_chunks).shape

    def empty_param(
        self, shape: Sequence[int], dim: int | None, num_chunks: int = 1, *, dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None, requires_grad: bool = True,
    ) -> nn.Parameter:
        """Like :meth:`make_param` for a global tensor of ``shape``, but the shard is uninitialised (on
        ``device``; ``"meta"`` allocates nothing). Give it values with :meth:`fill_param`."""
        local = torch.empty(self.local_shape(shape, dim, num_chunks), dtype=dtype, device=device)
        return self._wrap(local, torch.Size(shape), dim, requires_grad)

    @torch.no_grad()
    def fill_param(self, param: torch.Tensor, full: torch.Tensor, dim: int | None, num_chunks: int = 1) -> None:
        """Copy this rank's shard of ``full`` into ``param`` (cast to its dtype), in place."""
        local = local_tensor(param)
        if local.is_meta:
            raise RuntimeError("cannot fill a parameter on the meta device: materialise it first (to_empty)")
        if tuple(param.shape) != tuple(full.shape):
            raise ValueError(f"full tensor has shape {list(full.shape)}, the parameter {list(param.shape)}")
        local.copy_(self.shard_of(full, dim, num_chunks))

    def wrap_local(self, local: torch.Tensor, shape: Sequence[int], dim: int | None,
                   requires_grad: bool = False) -> nn.Parameter:
        """A parameter from this rank's shard ``local`` (computed here, not sliced from a full tensor) of a global
        tensor of ``shape``, sharded along ``dim`` (``None``: every TP rank holds the same, whole tensor)."""
        return self._wrap(local.contiguous(), torch.Size(shape), dim, requires_grad)

    def _wrap(self, local: torch.Tensor, shape: torch.Size, dim: int | None, requires_grad: bool) -> nn.Parameter:
        if self.mesh is None:
            return nn.Parameter(local, requires_grad=requires_grad)
        placement = Replicate() if dim is None else Shard(dim)
        dt = DTensor.from_local(local, self.mesh, [placement], run_check=False, shape=shape,
                                stride=_contiguous_stride(shape))
        return nn.Parameter(dt, requires_grad=requires_grad)


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return tuple(stride)


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
