"""The tensor part of a data file laid out as the last save's: written with a few calls for all its items.

A save laid out like the last one (:mod:`~peftckpt.checkpoint.storage.plan_memo`) writes the same tensors in
the same order, each with the same record (dtype and shape) at the same place in its file; only their bytes and
digests change (objects -- written after the tensors -- may change size). The per-item work of a first save --
framing each tensor, joining a small one's bytes with its framing, a task on another core for a larger one's
block digests, its index record -- cost ~35 us of Python per tensor on a 2-core VM, more than a small adapter
tensor's bytes take to write. :class:`FramedLayout` keeps what it found per item and writes the next file's
tensor part as:

- **every record** as its cached framing around the tensor's own memory, all of them queued at once for the
  vectored writes (no copy of a small tensor's bytes into a joined buffer: copying a few MB through the CPU's
  cache and writing them again cost more than the kernel taking each piece once; a 64 MB image of the records,
  filled by ``torch._foreach_copy_``, was slower still -- a tensor copy costs ~5 us however small);
- **the block digests**: a small tensor's (one block, :data:`SMALL_BYTES` < ``BLOCK_BYTES``) by one call in line,
  the larger ones' on another core in a few batches;
- **the block index** as each item's cached JSON text with its digests' hex filled in.

The bytes written are those a first save writes (a test compares the files byte for byte).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch
import xxhash

from .checksums import overlap_pool
from .framing import BLOCK_BYTES, TensorRecord, block_digests, host_contiguous, tensor_bytes

__all__ = ["SMALL_BYTES", "FramedLayout", "TensorSlot"]

SMALL_BYTES = 1 << 16
"""Tensors up to this size are digested in line (one block: below :data:`~.framing.BLOCK_BYTES`); larger ones on
another core. (The per-item path also joins a small tensor's bytes and framing into one buffer.)"""
assert SMALL_BYTES < BLOCK_BYTES
_U64 = struct.Struct("<Q")
_DIGEST_BATCH_BYTES = 16 << 20
"""Larger tensors' bytes per batch of block digests handed to another core."""


class Gathering(Protocol):
    """Where the file's bytes go, in order (the DCP writer's queue of vectored writes)."""

    def write_views(self, views: Sequence[memoryview]) -> None: ...


@dataclass(frozen=True)
class TensorSlot:
    """One tensor item of the file: where its record starts and what frames it."""

    offset: int
    record: TensorRecord

    @property
    def small(self) -> bool:
        return self.record.nbytes <= SMALL_BYTES


class FramedLayout:
    """The tensor items of one data file, in file order, as a save laid out like this writes them (module
    docstring). Built from the slots a first save wrote."""

    def __init__(self, slots: Sequence[TensorSlot]) -> None:
        self.slots = list(slots)
        self._framing = [(memoryview(s.record.prefix), memoryview(s.record.suffix)) for s in self.slots]
        self._small = [i for i, s in enumerate(self.slots) if s.small and s.record.nbytes]
        """The tensors whose bytes are one block, digested in line (the others: on another core, in batches)."""
        self._large = [i for i, s in enumerate(self.slots) if not s.small]
        # The index's text of each item, around its data digests: `[offset,length,data_offset,data_length,"`
        # + the framing digest before + the data's block digests + the one after + `"]` (IndexedItem.to_json).
        self._index_head: list[str] = []
        self._index_tail: list[str] = []
        for s in self.slots:
            r = s.record
            head, tail = r.framing_digests
            self._index_head.append(f"[{s.offset},{r.length},{s.offset + len(r.prefix)},{r.nbytes},\""
                                    + _U64.pack(head).hex())
            self._index_tail.append(_U64.pack(tail).hex() + "\"]")

    @classmethod
    def matching(cls, slots: Sequence[TensorSlot]) -> FramedLayout | None:
        """A layout of ``slots``, or ``None`` where they are not one file's tensors laid end to end from its
        start (then the per-item path writes every save)."""
        at = 0
        for s in slots:
            if s.offset != at:
                return None
            at += s.record.length
        return cls(slots)

    def write(self, out: Gathering, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Write the records of ``tensors`` (this layout's items, in file order; the caller checked that
        ``out`` is at the file's start) and return each item's block index text."""
        # 1. Each tensor's bytes as they are in memory (checked to be the size its record frames).
        if len(tensors) != len(self.slots):
            raise ValueError(f"{len(tensors)} tensors for a layout of {len(self.slots)}")
        data = [self._bytes_of(i, t) for i, t in enumerate(tensors)]
        # 2. The larger tensors' block digests, taken on another core in batches while the file is written.
        batches: list[tuple[list[int], Future[list[list[int]]]]] = []
        batch: list[int] = []
        batched = 0
        for i in self._large:
            batch.append(i)
            batched += len(data[i])
            if batched >= _DIGEST_BATCH_BYTES or i == self._large[-1]:
                batches.append((batch, overlap_pool().submit(_digests_of, [data[j] for j in batch])))
                batch, batched = [], 0
        # 3. The file: every record as its framing around the tensor's own memory, queued for vectored writes.
        out.write_views([view for (prefix, suffix), own in zip(self._framing, data) for view in (prefix, own, suffix)])
        # 4. The digests, and each item's index text.
        data_hex = [""] * len(self.slots)
        digest, pack = xxhash.xxh3_64_intdigest, _U64.pack
        for i in self._small:  # (one block each: SMALL_BYTES < BLOCK_BYTES)
            data_hex[i] = pack(digest(data[i])).hex()
        for items, future in batches:
            for i, digests in zip(items, future.result()):
                data_hex[i] = _hex(digests)
        return [head + middle + tail for head, middle, tail in zip(self._index_head, data_hex, self._index_tail)]

    def _bytes_of(self, i: int, tensor: torch.Tensor) -> memoryview:
        view = tensor_bytes(host_contiguous(tensor))
        if len(view) != self.slots[i].record.nbytes:
            raise ValueError(f"tensor item {i} holds {len(view)} bytes, its layout {self.slots[i].record.nbytes}")
        return view


def _digests_of(views: Sequence[memoryview]) -> list[list[int]]:
    return [block_digests(v) for v in views]


def _hex(digests: Sequence[int]) -> str:
    return struct.pack(f"<{len(digests)}Q", *digests).hex()
