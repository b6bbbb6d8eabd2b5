"""A fingerprint of the frozen base weights that does not depend on the TP/PP/DP layout.

Each element contributes ``bits(x_i) * w(i)`` where ``i`` is its flat index in the *global* tensor and
``w`` a fixed integer hash; contributions add up in int64 with wrap-around, which is exact and
order-independent, so any sharding gives the same sum. Each piece is counted once (by the lowest rank
holding it). The per-tensor sums, names, shapes and dtypes are hashed with SHA-256.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from ..sharding.entries import GlobalTensor

__all__ = ["base_fingerprint"]

_ROWS_PER_BLOCK = 1 << 20  # elements per block: bounds the temporary index tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    int_type = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(int_type).to(torch.int64)


def _piece_sum(piece: torch.Tensor, offsets: tuple[int, ...], global_shape: torch.Size) -> int:
    if piece.numel() == 0:
        return 0
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    # flat global index of every local element, built block by block along the first dim
    bits = _bits(piece)
    if piece.ndim == 0:
        idx = torch.zeros(1, dtype=torch.int64)
    else:
        idx = torch.zeros((), dtype=torch.int64)
        for d in range(piece.ndim):
            shape = [1] * piece.ndim
            shape[d] = piece.shape[d]
            idx = idx + ((torch.arange(piece.shape[d], dtype=torch.int64) + offsets[d]) * strides[d]).view(shape)
        idx = idx.reshape(-1)
    total = 0
    for start in range(0, bits.numel(), _ROWS_PER_BLOCK):
        i = idx[start:start + _ROWS_PER_BLOCK]
        w = (i * 2654435761 + 97531) & 0x7FFFFFFF
        total += int((bits[start:start + _ROWS_PER_BLOCK] * w).sum())
    return total & 0xFFFFFFFFFFFFFFFF


def base_fingerprint(frozen: dict[str, GlobalTensor], distributed: bool) -> str:
    """Layout-independent fingerprint of the given frozen entries (collective when ``distributed``)."""
    mine = sorted((k, p.offsets) for k, e in frozen.items() for p in e.pieces)
    if distributed:
        everyone: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, mine)
        rank = dist.get_rank()
    else:
        everyone, rank = [mine], 0
    owner: dict[tuple[str, tuple[int, ...]], int] = {}
    records: dict[str, None] = {}
    for r, pieces in enumerate(everyone):
        for k, off in pieces:
            owner.setdefault((k, tuple(off)), r)
            records[k] = None
    keys = sorted(records)
    sums = torch.zeros(len(keys), dtype=torch.int64)
    position = {k: i for i, k in enumerate(keys)}
    for k, e in frozen.items():
        for p in e.pieces:
            if owner[(k, tuple(p.offsets))] == rank:
                s = _piece_sum(p.tensor, p.offsets, e.global_shape)
                sums[position[k]] += s - (1 << 64) if s >= (1 << 63) else s
    if distributed:
        dist.all_reduce(sums)
    meta: dict[str, object] = {}
    if distributed:
        shapes: list[dict[str, list[object]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(shapes, {k: [list(e.global_shape), str(e.dtype)] for k, e in frozen.items()})
        for rank_shapes in shapes:
            meta.update(rank_shapes)
    else:
        meta = {k: [list(e.global_shape), str(e.dtype)] for k, e in frozen.items()}
    payload = json.dumps([[k, meta[k], int(sums[position[k]])] for k in keys]).encode()
    return "sha256:" + hashlib.sha256(payload).hexdigest()
