"""Checkpoint entries: a rank's pieces of one global tensor, and how to build them from parameters.

:class:`GlobalTensor` is the one tensor leaf the checkpoint library hands to
``torch.distributed.checkpoint``. It implements DCP's checkpointable protocol
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``), so DCP's default
planners save, dedupe and reshard it like a DTensor -- but a rank may hold several non-contiguous
pieces (a fused ``[gate; up]`` shard is two pieces of the canonical global tensor).
Pieces are views of the live tensors: a load writes straight into the model and optimizer.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from .layout import FusedChunks

__all__ = ["Piece", "GlobalTensor", "LazyGlobalTensor", "global_tensor_of"]


class Piece(NamedTuple):
    """A local tensor (a view into live storage) and its offset in the global tensor. (A named tuple: immutable,
    and built in a fraction of a frozen dataclass's time -- a checkpoint builds one per stored piece.)"""

    offsets: tuple[int, ...]
    tensor: torch.Tensor


class GlobalTensor:
    """This rank's pieces of one global tensor (possibly none, e.g. on a rank without it)."""

    def __init__(self, global_shape: Sequence[int], dtype: torch.dtype, pieces: Sequence[Piece],
                 requires_grad: bool = False, replicated: bool = False, frozen: bool = False):
        self.global_shape = global_shape if type(global_shape) is torch.Size else torch.Size(global_shape)
        self.dtype = dtype
        self.pieces = list(pieces)
        self.requires_grad = requires_grad
        self.replicated = replicated
        """Every rank holding it holds the whole tensor (written once, by DCP's dedup)."""
        self.frozen = frozen
        """A parameter that does not train (``requires_grad=False``): training never writes to it, so an
        async save may write it from live memory instead of a private copy (buffers and optimizer state,
        which training does update in place, are never ``frozen``)."""

    # DCP's load planner compares this with the saved global size.
    def size(self) -> torch.Size:
        return self.global_shape

    @property
    def nbytes(self) -> int:
        return self.global_shape.numel() * self.dtype.itemsize

    def snapshot(self, into: GlobalTensor | None = None) -> GlobalTensor:
        """A copy whose pieces are private, dense host-memory tensors (for a save that runs while training
        goes on). ``into`` -- an earlier snapshot of the same entry that nothing uses any more -- lends its
        buffers when its pieces match, which saves the allocation and first-touch cost of fresh memory."""
        def layout(e: GlobalTensor) -> list[tuple[Any, ...]]:
            return [(p.offsets, p.tensor.shape, p.tensor.dtype) for p in e.pieces]

        if into is not None and layout(into) == layout(self):
            buffers = [q.tensor for q in into.pieces]
        else:
            buffers = [torch.empty(p.tensor.shape, dtype=p.tensor.dtype, device="cpu", pin_memory=p.tensor.is_cuda)
                       for p in self.pieces]
        pieces = [Piece(p.offsets, buf.copy_(p.tensor)) for p, buf in zip(self.pieces, buffers)]
        return GlobalTensor(self.global_shape, self.dtype, pieces, self.requires_grad, self.replicated, self.frozen)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(p.offsets), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.shape),
                    properties=TensorProperties.create_from_tensor(p.tensor),
                    size=self.global_shape,
                ),
            )
            for i, p in enumerate(self.pieces)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.shape) for p in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.index is not None and index.index < len(self.pieces):
            p = self.pieces[index.index]
            if index.offset is None or p.offsets == index.offset:  # (a torch.Size equals the tuple of its dims)
                return p.tensor
        for p in self.pieces:
            if index.offset is None or torch.Size(p.offsets) == index.offset:
                return p.tensor
        raise ValueError(f"{index.fqn}: this rank holds no piece at offset {index.offset}")

    def __repr__(self) -> str:
        return (f"GlobalTensor(shape={list(self.global_shape)}, dtype={self.dtype}, pieces={len(self.pieces)}, "
                f"requires_grad={self.requires_grad})")


class LazyGlobalTensor(GlobalTensor):
    """A whole global tensor produced only when DCP writes it (``load()``), e.g. streamed from another file
    format: a save then holds one such tensor in memory at a time. Its one piece is a meta tensor that gives
    DCP the shape and dtype to plan with."""

    def __init__(self, global_shape: Sequence[int], dtype: torch.dtype, load: Callable[[], torch.Tensor]):
        super().__init__(global_shape, dtype, [Piece((0,) * len(global_shape),
                                                     torch.empty(global_shape, dtype=dtype, device="meta"))],
                         replicated=True, frozen=True)
        self._load = load

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        t = self._load()
        if t.shape != self.global_shape or t.dtype != self.dtype:
            raise ValueError(f"{index.fqn}: produced {t.dtype} {list(t.shape)}, announced {self.dtype} "
                             f"{list(self.global_shape)}")
        return t


def _local_view(t: torch.Tensor) -> torch.Tensor:
    return (t._local_tensor if isinstance(t, DTensor) else t).detach()  # shares storage with the live tensor


_OFFSETS: dict[tuple[Any, ...], tuple[Any, tuple[int, ...]]] = {}
"""This rank's global offset of a DTensor's shard, by (global shape, id of its mesh, placements), with a weak
reference to the mesh: the same at every save, and DTensor's computation of it was a fifth of a TP rank's save of
a few thousand adapter tensors."""
_OFFSETS_MAX = 1 << 16


def _global_offset(shape: torch.Size, mesh: Any, placements: tuple[Any, ...]) -> tuple[int, ...]:
    key = (shape, id(mesh), placements)
    held = _OFFSETS.get(key)
    if held is not None and held[0]() is mesh:
        return held[1]
    _, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    if len(_OFFSETS) >= _OFFSETS_MAX:
        _OFFSETS.clear()
    _OFFSETS[key] = (weakref.ref(mesh), tuple(offsets))  # (a mesh's id is reused only once it is gone)
    return tuple(offsets)


def global_tensor_of(t: torch.Tensor, fused: FusedChunks | None = None,
                     requires_grad: bool | None = None) -> GlobalTensor:
    """Describe a plain tensor (replicated), a DTensor (its shard), or a block-wise TP-sharded fused
    parameter (see :mod:`peftckpt.sharding.layout`) as a :class:`GlobalTensor` in canonical layout."""
    rg = bool(t.requires_grad if requires_grad is None else requires_grad)
    kind = type(t)
    if kind is torch.Tensor or kind is nn.Parameter:  # the usual case, told by type (a checkpoint wraps thousands)
        # (a plain tensor outside autograd -- optimizer state -- is its own view: detaching it costs half the entry)
        local = t if kind is torch.Tensor and not t.requires_grad else t.detach()
        return GlobalTensor(t.shape, t.dtype, [Piece((0,) * t.ndim, local)], rg, replicated=True,
                            frozen=kind is nn.Parameter and not t.requires_grad)
    frozen = isinstance(t, nn.Parameter) and not t.requires_grad
    if not isinstance(t, DTensor):
        return GlobalTensor(t.shape, t.dtype, [Piece((0,) * t.ndim, _local_view(t))], rg, replicated=True,
                            frozen=frozen)
    if any(p.is_partial() for p in t.placements):
        raise ValueError("cannot checkpoint a DTensor with Partial placement")
    local = _local_view(t)
    offsets = _global_offset(t.shape, t.device_mesh, t.placements)
    replicated = not any(isinstance(p, Shard) for p in t.placements)
    if fused is None or fused.num_chunks == 1 or replicated:
        return GlobalTensor(t.shape, t.dtype, [Piece(tuple(offsets), local)], rg, replicated, frozen)
    # DTensor's (interleaved) global layout along `dim`: each TP rank's block [c_0 | c_1 | ...] of its slice
    # of every chunk. This rank holds rows [lo, lo + n) of it -- a whole TP block, or with FSDP over DP on
    # top (2-D) part of one -- whose rows x of chunk c sit at canonical c * (G / k) + t * (block) + ... .
    k, dim = fused.num_chunks, fused.dim
    total = t.shape[dim]
    tp = math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements)
                   if type(p) is Shard and p.dim == dim)  # not FSDP's _StridedShard: the TP split itself
    span = total // tp
    block = span // k
    tp_rank, start = divmod(offsets[dim], span)
    pieces = []
    x, stop = start, start + local.shape[dim]
    while x < stop:
        c = x // block
        end = min(stop, (c + 1) * block)
        off = list(offsets)
        off[dim] = c * (total // k) + tp_rank * block + (x - c * block)
        pieces.append(Piece(tuple(off), local.narrow(dim, x - start, end - x)))
        x = end
    return GlobalTensor(t.shape, t.dtype, pieces, rg, replicated=False, frozen=frozen)
