"""A fingerprint of the frozen base weights that does not depend on the TP/PP/DP layout.

Each element contributes to per-tensor sums weighted by a function of its flat index ``i`` in the *global*
tensor; the sums are taken modulo 2**64 in integers, which is exact and order-independent, so any sharding
gives the same sums. Each piece is counted once (by the lowest rank holding it). The per-tensor sums,
names, shapes and value kinds are hashed with SHA-256.

The sums of each version are defined in :mod:`~peftckpt.checkpoint.state.fingerprint_sums`; versions 1-3
are still computed to check checkpoints that recorded them.

:class:`Fingerprinting` takes pieces as they become final (a base load hands it each piece right after
reading it, so hashing overlaps the reading) and sums them in a thread pool.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex

from ...sharding.entries import GlobalTensor
from .fingerprint_sums import U64, WIDTH, segment_sums

__all__ = ["FINGERPRINT_VERSION", "Fingerprinting", "base_fingerprint", "fingerprint_version", "tensor_sums"]

FINGERPRINT_VERSION = 4
"""Version of new fingerprints (see the module docstring)."""

_SEGMENT = 1 << 23
"""Elements per unit of work handed to the thread pool."""
_RUN = 1 << 13
"""Longest run summed as one row: with limbs and weights under 2**16 every row sum stays below 2**45."""


def fingerprint_version(value: str) -> int:
    """The version a recorded fingerprint was computed with."""
    for version in (4, 3, 2):
        if value.startswith(f"v{version}:"):
            return version
    return 1


def _runs(piece: torch.Tensor, offsets: tuple[int, ...], global_shape: torch.Size) -> tuple[torch.Tensor, np.ndarray]:
    """The piece as ``R`` runs of ``L`` elements, each contiguous in the global flat index: the ``(R, L)``
    tensor of its elements and the global flat index of each run's first element.

    Dims after the last one where the piece is narrower than the global tensor are whole, so one run is
    that dim's slice times everything after it; the dims before it enumerate the runs."""
    shape = tuple(piece.shape)
    ndim = len(shape)
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    k = max((d for d in range(ndim) if shape[d] != global_shape[d]), default=0)
    run = int(np.prod(shape[k:], dtype=np.int64)) if ndim else 1
    base = sum(offsets[d] * strides[d] for d in range(k, ndim))
    starts = np.full((1,) * max(k, 1), base, dtype=np.int64)
    for d in range(k):
        view = [1] * k
        view[d] = shape[d]
        starts = starts + ((np.arange(shape[d], dtype=np.int64) + offsets[d]) * strides[d]).reshape(view)
    return piece.detach().contiguous().cpu().reshape(-1, run), starts.reshape(-1)


def _short_runs(rows: torch.Tensor, starts: np.ndarray, limit: int) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
    """``rows`` as column blocks of runs at most ``limit`` long (strided views, no copies)."""
    run = rows.shape[1]
    if run <= limit and rows.shape[0] > 1:
        yield rows, starts
        return
    if rows.shape[0] == 1:  # one long run (a piece whole in all but its first dim): many rows of one
        whole = run // limit * limit
        if whole:
            yield rows[0, :whole].view(-1, limit), starts[0] + np.arange(0, whole, limit, dtype=np.int64)
        if whole < run:
            yield rows[:, whole:], starts + whole
        return
    for c in range(0, run, limit):
        yield rows[:, c:c + limit], starts + c



# --------------------------------------------------------------------------------------- accumulation
def _segments(piece: torch.Tensor, offsets: tuple[int, ...], global_shape: torch.Size,
              version: int) -> list[tuple[torch.Tensor, np.ndarray]]:
    """The piece as units of work of at most about :data:`_SEGMENT` elements: ``(runs, run starts)``."""
    rows, starts = _runs(piece, offsets, global_shape)
    parts = list(_short_runs(rows, starts, _RUN if version == 3 else _SEGMENT)) if version >= 3 else [(rows, starts)]
    out: list[tuple[torch.Tensor, np.ndarray]] = []
    for part, part_starts in parts:
        step = max(1, _SEGMENT // part.shape[1])
        out.extend((part[r:r + step], part_starts[r:r + step]) for r in range(0, part.shape[0], step))
    return out



class Fingerprinting:
    """A fingerprint being computed: :meth:`add` each piece of the given entries once its values are final
    (on any thread; this rank sums the pieces it owns in a thread pool), then :meth:`result`.

    ``known``: per-key sums already established for this version (recorded by the checkpoint the pieces are read
    from, whose bytes the read verified), offered for this rank's keys: a key every rank holding it offered is
    not summed again.

    Construction and :meth:`result` are collective over ``group`` when ``distributed``."""

    def __init__(self, frozen: dict[str, GlobalTensor], distributed: bool, version: int = FINGERPRINT_VERSION,
                 group: dist.ProcessGroup | None = None, known: Mapping[str, Sequence[int]] | None = None):
        if version not in WIDTH:
            raise ValueError(f"unknown fingerprint version {version}")
        self.version = version
        self.distributed = distributed
        self.group = group
        # this rank's non-empty pieces, the records of its keys and the sums it offers, from every rank in one gather
        offered = {k: [int(x) & U64 for x in v] for k, v in (known or {}).items() if k in frozen}
        mine = (sorted((k, p.offsets) for k, e in frozen.items() for p in e.pieces if p.tensor.numel()),
                {k: _record(e, version) for k, e in frozen.items()}, offered)
        if distributed:
            everyone: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
            rank = dist.get_rank(group)
        else:
            everyone, rank = [mine], 0
        owner: dict[tuple[str, tuple[int, ...]], int] = {}
        holders: dict[str, set[int]] = {}
        self._records: dict[str, list[object]] = {}
        for r, (pieces, records, _) in enumerate(everyone):
            for k, off in pieces:
                owner.setdefault((k, tuple(off)), r)
                holders.setdefault(k, set()).add(r)
            self._records.update(records)
        # a key's offered sums are taken where every rank holding a piece of it offered them (each rank vouches
        # for its own pieces: the same decision on every rank), else its pieces are summed
        self._known = {k: everyone[min(ranks)][2][k] for k, ranks in holders.items()
                       if all(k in everyone[r][2] for r in ranks)}
        self._mine = {key for key, r in owner.items() if r == rank and key[0] not in self._known}
        self.key_sums: dict[str, list[int]] = {}
        """Every key's sums once :meth:`result` returned (what a full save records for a later load)."""
        self._shapes = {k: e.global_shape for k, e in frozen.items()}
        self._sums: dict[str, list[int]] = {}
        self._futures: list[tuple[str, Future[list[int]]]] = []
        self.wait_s = 0.0
        # version 4's matrix products use torch's own threads: one worker keeps them from competing
        workers = 1 if version >= 4 else max(1, torch.get_num_threads())
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="peftckpt-fingerprint")

    def add(self, key: str, offsets: tuple[int, ...], tensor: torch.Tensor, wait: bool = False) -> None:
        """Count one piece of ``key`` (if this rank owns it); ``wait``: return once it is summed (the
        caller may then drop the tensor)."""
        offsets = tuple(offsets)
        if tensor.numel() == 0 or (key, offsets) not in self._mine:
            return
        self._mine.discard((key, offsets))
        futures = [self._pool.submit(segment_sums, rows, starts, self.version)
                   for rows, starts in _segments(tensor, offsets, self._shapes[key], self.version)]
        if wait:
            for f in futures:
                self._accumulate(key, f.result())
        else:
            self._futures.extend((key, f) for f in futures)

    def _accumulate(self, key: str, values: list[int]) -> None:
        total = self._sums.setdefault(key, [0] * WIDTH[self.version])
        for i, value in enumerate(values):
            total[i] = (total[i] + value) & U64

    def close(self) -> None:
        """Stop without a result (e.g. the load that fed it failed)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def result(self) -> str:
        """The fingerprint (collective when ``distributed``); every owned piece must have been added.
        :attr:`wait_s` is then how long this call took: what the fingerprint added to the work that fed it."""
        start = time.perf_counter()
        try:
            for key, future in self._futures:
                self._accumulate(key, future.result())
        finally:
            self.close()
        if self._mine:
            key, offsets = sorted(self._mine)[0]
            raise RuntimeError(f"fingerprint: piece {key} at {offsets} was never added")
        keys = sorted(self._records)
        sums = torch.zeros(len(keys), WIDTH[self.version], dtype=torch.int64)
        for i, k in enumerate(keys):
            if k in self._sums:
                sums[i] = torch.tensor([x - (1 << 64) if x >= (1 << 63) else x for x in self._sums[k]])
        if self.distributed:
            dist.all_reduce(sums, group=self.group)
        values = [self._known.get(k) or [x & U64 for x in row] for k, row in zip(keys, sums.tolist())]
        self.key_sums = dict(zip(keys, values))
        width1 = self.version < 3  # versions 1 and 2 recorded one signed sum per tensor
        payload = json.dumps([[k, self._records[k], (row[0] if row[0] < (1 << 63) else row[0] - (1 << 64))
                               if width1 else row] for k, row in zip(keys, values)]).encode()
        prefix = "" if self.version == 1 else f"v{self.version}:"
        self.wait_s = time.perf_counter() - start
        return prefix + "sha256:" + hashlib.sha256(payload).hexdigest()


def base_fingerprint(frozen: dict[str, GlobalTensor], distributed: bool, version: int = FINGERPRINT_VERSION,
                     group: dist.ProcessGroup | None = None) -> str:
    """Layout-independent fingerprint of the given frozen entries (collective when ``distributed``), computed
    as ``version`` defines it (see the module docstring).

    Resident pieces are summed together (one thread pool over all of them); pieces of a lazy entry (a meta
    tensor, produced on demand) one at a time, so a base streamed from disk is never held whole."""
    job = Fingerprinting(frozen, distributed, version, group)
    try:
        for k, e in frozen.items():
            for p in e.pieces:
                if not p.tensor.is_meta:
                    job.add(k, p.offsets, p.tensor)
        for k, e in frozen.items():
            for p in e.pieces:
                if p.tensor.is_meta:
                    job.add(k, p.offsets, e.__get_tensor_shard__(MetadataIndex(k, p.offsets)), wait=True)
    except BaseException:
        job.close()
        raise
    return job.result()


def tensor_sums(tensor: torch.Tensor, version: int = FINGERPRINT_VERSION) -> list[int]:
    """The sums ``version`` defines of one whole tensor (what :class:`Fingerprinting` sums over its pieces)."""
    total = [0] * WIDTH[version]
    if tensor.numel():
        for rows, starts in _segments(tensor, (0,) * tensor.dim(), tensor.shape, version):
            total = [(a + b) & U64 for a, b in zip(total, segment_sums(rows, starts, version))]
    return total


def _record(entry: GlobalTensor, version: int) -> list[object]:
    if version >= 3 and entry.dtype.is_floating_point:  # version 4: the same kinds as version 3
        kind = "float" if entry.dtype.itemsize <= 4 else "float64"
    else:
        kind = "floating" if version == 2 and entry.dtype.is_floating_point else str(entry.dtype)
    return [list(entry.global_shape), kind]
