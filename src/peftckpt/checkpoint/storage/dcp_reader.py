"""The DCP storage reader of loads: each rank reads only the bytes it needs, into the model, verifying them.

DCP's stock reader ``torch.load``\\ s every stored item it touches *whole* into fresh memory, narrows it to the
requested region and copies that into the model: a TP rank reads all of a row-sharded tensor for half of it,
and every byte is copied twice. :class:`RangedFileSystemReader` uses the block index at the end of each data
file (:mod:`~peftckpt.checkpoint.storage.framing`):

1. For each requested region it computes the byte range of the stored tensor that holds it -- the rows of a
   row-sharded piece, the span of rows a column split touches -- widened to whole verification blocks.
2. Where the region is contiguous in the file and the destination is a contiguous tensor of the stored dtype
   (the common case: a whole item, or rows of one), one ``preadv`` puts the bytes straight into the destination's
   memory, the block edges into small side buffers. Otherwise the span goes into one of a few reused buffers and
   the region is copied out of it (a column split, a dtype change; in runs of rows that fit a buffer).
3. Every block read is checked against its recorded XXH3-64 digest (a whole item's framing too); a mismatch is
   a problem naming the file and the key (:attr:`problems`), reported by the load after the read, as the
   whole-file checksums were.

Nothing read is dropped from the page cache: the other TP ranks read the same rows of a column split, and DP
replicas the same pieces, at about the same time (dropping them made the ranks read 1.25x the base from the disk).
Several reads are in flight (a small pool; ``preadv`` releases the GIL; a failed read drops those queued), reads
through a buffer among them, each holding one of the pool's buffers (:mod:`.bounce_buffers`) while it runs. Objects are read whole and go
through the safe ``torch.load(weights_only=True)`` of :class:`SafeFileSystemReader`. Files without a block index
(stock DCP's, earlier peftckpt's), items the index does not list, and a file whose index is damaged (reported,
when verifying) are read by the stock path -- or, off the local disk, by each item's recorded byte range.

Each data file is read through a :class:`~peftckpt.checkpoint.storage.byte_sources.ByteSource`: the local file
(``preadv`` as above), or -- ``sources`` given -- an object on a store read by ranged GETs, told the ranges of the
file's items first so that it fetches them ahead in few requests; each read starts once its bytes have arrived.
Reads stay inside the recorded sizes: an index entry must lie inside its file and agree with the ``.metadata``'s
item and chunk, or the stock path reads that item.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future as PoolFuture
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import xxhash
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.futures import Future

from .bounce_buffers import BounceBuffers
from .byte_sources import ByteSource, FileSource, read_when_ready
from .framing import (
    BLOCK_BYTES,
    INDEX_ALGORITHM,
    BlockIndexError,
    IndexedItem,
    ends_with_index,
    read_index,
    segment_digests,
    tensor_bytes,
)
from .safe_pickle import SafeFileSystemReader, _SafeBytesPlanner

__all__ = ["RangedFileSystemReader", "has_block_index", "load_state_dict"]

_READ_THREADS = 4
_BOUNCE_BYTES = 32 << 20
"""The reused buffer of buffered reads; a larger strided region is read in runs of rows that fit it."""


def has_block_index(path: Path) -> bool:
    """Whether data file ``path`` ends with a block index (its items are verified as they are read; a damaged
    index is reported by the read)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        return ends_with_index(fd, os.fstat(fd).st_size)
    except OSError:
        return False
    finally:
        os.close(fd)


@dataclass
class _Span:
    """Bytes of one item to read: ``[start, end)`` of its data, widened to blocks ``[first, last)``."""

    start: int
    end: int
    first: int
    last: int
    block_start: int
    block_end: int


class RangedFileSystemReader(SafeFileSystemReader):
    """``SafeFileSystemReader`` reading requested regions in place, verified by block (module docstring)."""

    def __init__(self, path: str | os.PathLike[str], verify: bool = True,
                 sources: Callable[[str], ByteSource] | None = None) -> None:
        super().__init__(path)
        self.verify = verify
        self._sources = sources
        """Opens a data file (by its name in the checkpoint) elsewhere than under ``path``: on an object store."""
        self.problems: list[str] = []
        """Damage found while reading: one message per damaged file region."""
        self.bytes_read = 0
        """Bytes this reader read from data files by ranges (the stock path's reads not included)."""
        self.unindexed: list[str] = []
        """Data files (names) opened through ``sources`` without a block index: not verified by the reads."""
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, list[int]]] = {}
        self._lock = threading.Lock()
        self._buffers = BounceBuffers(_READ_THREADS, _BOUNCE_BYTES)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._chunks = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for chunk in md.chunks:
                    self._chunks[(fqn, tuple(chunk.offsets))] = (md.properties.dtype, list(chunk.sizes))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        safe = cast(LoadPlanner, _SafeBytesPlanner(planner, self))
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        stock: list[ReadItem] = []
        with ThreadPoolExecutor(max_workers=_READ_THREADS, thread_name_prefix="peftckpt-read") as pool:
            for rel, items in per_file.items():
                source = self._open(rel)
                try:
                    stock += self._read_file(rel, source, items, planner, safe, pool)
                except BaseException:  # the reads still queued are dropped (each would fetch its range afresh)
                    pool.shutdown(cancel_futures=True)
                    raise
                finally:
                    source.close()
        if stock:
            super().read_data(replace(plan, items=stock), planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open(self, rel: str) -> ByteSource:
        return FileSource(Path(str(self.fs.concat_path(self.path, rel)))) if self._sources is None else \
            self._sources(rel)

    def _read_file(self, rel: str, source: ByteSource, items: list[ReadItem], planner: LoadPlanner,
                   safe: LoadPlanner, pool: ThreadPoolExecutor) -> list[ReadItem]:
        """Read ``items`` of the data file ``rel``; returns those left to the stock reader (a local file's items
        its index does not list)."""
        items = sorted(items, key=lambda i: self.storage_data[i.storage_index].offset)
        whole = self._whole_records(items) if self._sources is not None else None
        if whole is not None:  # known before the index: planned with it (one request fewer on a store)
            source.expect(whole, tail=True)
        damaged = len(self.problems)
        index = self._index(source)
        if index is None and self._sources is not None and self.verify and len(self.problems) == damaged:
            self.unindexed.append(rel)
        entries = [self._entry(index, item) for item in items]
        spans = whole or [(0, 0)] * len(items)  # what each read covers (a store's; a local file reads on demand)
        if self._sources is not None and whole is None:
            spans = [self._range(item, entry) for item, entry in zip(items, entries)]
            source.expect(spans)
        stock: list[ReadItem] = []
        jobs: list[tuple[ReadItem, PoolFuture[Any]]] = []
        for item, entry, span in zip(items, entries, spans):
            if entry is None and self._sources is None:
                stock.append(item)
            elif entry is None:  # not indexed, on a store: the item's stored bytes, loaded safely
                info = cast(_StorageInfo, self.storage_data[item.storage_index])
                if info.transform_descriptors:
                    raise ValueError(f"{source.name}: {item.storage_index.fqn!r} is stored with transforms "
                                     f"{list(info.transform_descriptors)}, which are read from local files only")
                self._load_record(item, self._read_exact(source, item, info.offset, info.length), planner, safe)
            elif item.type == LoadItemType.BYTE_IO:
                jobs.append((item, read_when_ready(pool, source, span, self._read_whole, source, item, entry)))
            elif entry.opaque:
                # a tensor torch.save framed (too large, or an unusual dtype): whole, one at a time
                self._load_record(item, self._read_whole(source, item, entry), planner, safe)
            else:
                target = planner.resolve_tensor(item).detach()  # straight into it, or through a bounce buffer
                jobs.append((item, read_when_ready(pool, source, span, self._read_tensor, source, item, entry, target)))
        items_of = {job: item for item, job in jobs}
        # The planner is told on this thread: in order, or from a store (parts arrive in any order) as reads finish.
        for job in as_completed(items_of) if source.fetches_ahead else items_of:
            item = items_of[job]
            value = job.result()
            if value is None:  # damaged (reported): nothing of it is parsed
                continue
            if item.type == LoadItemType.BYTE_IO:
                safe.load_bytes(item, value)
            else:
                planner.commit_tensor(item, value)
        return stock

    def _load_record(self, item: ReadItem, blob: io.BytesIO | None, planner: LoadPlanner, safe: LoadPlanner
                     ) -> None:
        """Hand the planner an item read whole: an object (loaded safely), or a ``torch.save`` record narrowed to
        the requested region (``blob`` ``None``: damaged, reported)."""
        if blob is None:
            return
        if item.type == LoadItemType.BYTE_IO:
            safe.load_bytes(item, blob)
            return
        stored = torch.load(blob, map_location="cpu", weights_only=True)
        target = planner.resolve_tensor(item).detach()
        target.copy_(narrow_tensor_by_index(stored, item.storage_offsets, item.lengths))
        planner.commit_tensor(item, target)

    # ------------------------------------------------------------------------------------------- lookup
    def _index(self, source: ByteSource) -> dict[int, IndexedItem] | None:
        try:
            return read_index(source.read, source.size, self.verify)
        except BlockIndexError as e:
            if self.verify:
                self.problems.append(f"{source.name}: {e}")
            return None

    def _entry(self, index: dict[int, IndexedItem] | None, item: ReadItem) -> IndexedItem | None:
        """The index entry of ``item`` if it agrees with the ``.metadata`` (else the stock path reads it)."""
        if index is None:
            return None
        info = cast(_StorageInfo, self.storage_data[item.storage_index])
        entry = index.get(info.offset)
        if entry is None or entry.length != info.length or info.transform_descriptors:
            return None
        if item.type == LoadItemType.BYTE_IO or entry.opaque:  # read whole, one digest (a torch.save record)
            return entry if entry.opaque else None
        chunk = self._chunks.get((item.storage_index.fqn, tuple(item.storage_index.offset or ())))
        if chunk is None or math.prod(chunk[1]) * chunk[0].itemsize != entry.data_length:
            return None
        return entry

    # --------------------------------------------------------------------------------------------- reads
    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def _check(self, path: str, what: str, entry: IndexedItem, positions: Sequence[int], got: Sequence[int]) -> None:
        for pos, digest in zip(positions, got):
            expected = entry.digests[pos]
            if digest != expected:
                part = "framing" if pos in (0, len(entry.digests) - 1) else f"block {pos - 1}"
                self.problems.append(f"{path}: {INDEX_ALGORITHM} checksum mismatch in the bytes of {what} "
                                     f"({part} of the item at offset {entry.offset}): expected {expected:016x}, "
                                     f"got {digest:016x}")

    def _read_exact(self, source: ByteSource, item: ReadItem, offset: int, length: int) -> io.BytesIO:
        """``length`` bytes of ``item`` at ``offset``, all of them or ``EOFError``."""
        data = bytearray(length)
        n = source.read_into([memoryview(data)], offset)
        self._count(n)
        if n != length:
            raise EOFError(f"{source.name}: {length} bytes of {item.storage_index.fqn!r} expected, {n} read")
        return io.BytesIO(data)

    def _read_whole(self, source: ByteSource, item: ReadItem, entry: IndexedItem) -> io.BytesIO | None:
        """An item read whole (an object, or a tensor ``torch.save`` framed); ``None`` if it fails its digest."""
        blob = self._read_exact(source, item, entry.offset, entry.length)
        if self.verify:
            before = len(self.problems)
            self._check(source.name, repr(item.storage_index.fqn), entry, [0],
                        [xxhash.xxh3_64_intdigest(blob.getbuffer())])
            if len(self.problems) > before:
                return None
        return blob

    def _whole_records(self, items: list[ReadItem]) -> list[tuple[int, int]] | None:
        """The stored records of ``items`` if each is read whole (what :meth:`_range` then answers, known from
        the ``.metadata`` alone), else ``None``: a slice's range needs the block index."""
        out = []
        for item in items:
            if item.type != LoadItemType.BYTE_IO:
                chunk = self._chunks.get((item.storage_index.fqn, tuple(item.storage_index.offset or ())))
                if chunk is None or any(item.storage_offsets) or list(item.lengths) != chunk[1]:
                    return None
            info = cast(_StorageInfo, self.storage_data[item.storage_index])
            out.append((info.offset, info.offset + info.length))
        return out

    def _range(self, item: ReadItem, entry: IndexedItem | None) -> tuple[int, int]:
        """The ``[start, end)`` of the file that reading ``item`` covers (what a source is told to expect)."""
        if entry is None:
            info = cast(_StorageInfo, self.storage_data[item.storage_index])
            return info.offset, info.offset + info.length
        if item.type == LoadItemType.BYTE_IO or entry.opaque:
            return entry.offset, entry.offset + entry.length
        dtype, sizes = self._chunks[(item.storage_index.fqn, tuple(item.storage_index.offset or ()))]
        span = self._span(entry, item, dtype, sizes)[0]
        if span.start == 0 and span.end == entry.data_length:
            return entry.offset, entry.offset + entry.length
        return entry.data_offset + span.block_start, entry.data_offset + span.block_end

    def _span(self, entry: IndexedItem, item: ReadItem, dtype: torch.dtype, sizes: list[int]) -> tuple[_Span, bool]:
        """The data bytes holding the requested region, and whether the region is exactly those bytes."""
        offsets, lengths = list(item.storage_offsets), list(item.lengths)
        strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
        itemsize = dtype.itemsize
        first_elem = sum(o * s for o, s in zip(offsets, strides))
        last_elem = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides)) if math.prod(lengths) else first_elem - 1
        start, end = first_elem * itemsize, (last_elem + 1) * itemsize
        contiguous = end - start == math.prod(lengths) * itemsize
        first, last, block_start, block_end = entry.block_range(start, end)
        return _Span(start, end, first, last, block_start, block_end), contiguous

    def _read_tensor(self, source: ByteSource, item: ReadItem, entry: IndexedItem, target: torch.Tensor
                     ) -> torch.Tensor:
        dtype, sizes = self._chunks[(item.storage_index.fqn, tuple(item.storage_index.offset or ()))]
        span, contiguous = self._span(entry, item, dtype, sizes)
        rows = item.lengths[0] if item.lengths else 1
        # straight into the destination's memory (step 2 of the module docstring), or through a buffer
        direct = contiguous and target.dtype == dtype and target.is_cpu and target.is_contiguous()
        if not direct and rows > 1 and span.end - span.start > _BOUNCE_BYTES:
            # A large region through a buffer (a column split, a dtype change): in runs of rows that fit one
            per_run = max(1, rows * _BOUNCE_BYTES // (span.end - span.start))
            for first in range(0, rows, per_run):
                n = min(per_run, rows - first)
                offsets = [item.storage_offsets[0] + first, *item.storage_offsets[1:]]
                part = replace(item, storage_offsets=torch.Size(offsets),
                               lengths=torch.Size([n, *item.lengths[1:]]))
                self._read_tensor(source, part, entry, target.narrow(0, first, n))
            return target

        whole = span.start == 0 and span.end == entry.data_length
        if list(target.shape) != list(item.lengths):
            raise ValueError(f"{item.storage_index.fqn!r}: destination {list(target.shape)}, "
                             f"region {list(item.lengths)}")
        head_len = entry.data_offset - entry.offset if whole else span.start - span.block_start
        tail_len = entry.offset + entry.length - entry.data_offset - entry.data_length if whole else (
            span.block_end - span.end)
        at = entry.offset if whole else entry.data_offset + span.block_start
        head, tail = memoryview(bytearray(head_len)), memoryview(bytearray(tail_len))
        with contextlib.nullcontext() if direct else self._buffers.take(span.end - span.start) as bounce:
            body = tensor_bytes(target if bounce is None else bounce)  # the destination's memory, or the bounce's
            expected = head_len + len(body) + tail_len
            n = source.read_into([head, body, tail], at)
            self._count(n)
            if n != expected:
                raise EOFError(f"{source.name}: {expected} bytes of {item.storage_index.fqn!r} at offset {at} "
                               f"expected, {n} read")
            if self.verify:
                self._verify(source.name, item, entry, span, whole, [head, body, tail])
            if bounce is not None:
                typed = bounce.view(dtype) if bounce.numel() else torch.empty(0, dtype=dtype)
                strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
                region = typed.as_strided(list(item.lengths), strides, typed.storage_offset()) if typed.numel() \
                    else typed.reshape(list(item.lengths))
                target.copy_(region)
        return target

    def _verify(self, path: str, item: ReadItem, entry: IndexedItem, span: _Span, whole: bool,
                segments: list[memoryview]) -> None:
        blocks = list(range(span.first, span.last))
        sizes = [min(BLOCK_BYTES, entry.data_length - b * BLOCK_BYTES) for b in blocks]
        positions = [b + 1 for b in blocks]
        if whole:
            sizes = [len(segments[0]), *sizes, len(segments[2])]
            positions = [0, *positions, len(entry.digests) - 1]
        self._check(path, repr(item.storage_index.fqn), entry, positions,
                    segment_digests([s for s in segments if len(s)], sizes))


def load_state_dict(state_dict: dict[str, Any], reader: RangedFileSystemReader, planner: LoadPlanner,
                    group: dist.ProcessGroup | None) -> None:
    """``dcp.load(state_dict, storage_reader=reader, planner=planner, process_group=group)`` for a flat state dict
    of entries (no ``Stateful`` values): DCP's own load protocol and collective error handling, keys in sorted
    order as ``dcp.load`` takes them, minus the ``Stateful`` check it makes of every key, twice (a runtime protocol
    check, slow in Python: dropping it took 10-20 ms off a 122 MB, ~700-entry trainable-only load). Objects read
    replace their values in ``state_dict``, as with ``dcp.load``."""
    no_dist = not (dist.is_available() and dist.is_initialized())
    ordered = {k: state_dict[k] for k in sorted(state_dict)}
    _load_state_dict(ordered, storage_reader=reader, process_group=group, no_dist=no_dist, planner=planner)
    state_dict.update(ordered)
