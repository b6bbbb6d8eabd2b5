"""The DCP storage writer of ``torch_dist`` saves: one data file per rank, tensors framed without ``torch.save``.

DCP's planning, deduplication of replicated pieces and ``.metadata`` stay DCP's own (``dcp.save`` drives this
writer). What changes is the per-item work: :class:`FramedFileSystemWriter` writes each tensor as a
``torch.save``-compatible record straight from its memory (:func:`~peftckpt.checkpoint.storage.framing.tensor_record`),
takes the block digests of its bytes on the way, and ends the file with the block index -- no per-item stream
objects, loggers or pickling, and the items' bytes written a few MiB at a time by one vectored write, from the
tensors' own memory. The file system's stream (a
:class:`~peftckpt.checkpoint.storage.checksums.ChecksummingFileSystem` in a save) still sees every byte, so the
manifest's whole-file checksum is taken while writing, as before (on another thread, in order). The written
``Metadata`` is kept (:attr:`FramedFileSystemWriter.metadata`) for the commit's whole-checkpoint check, which need
not read it back.

:func:`save_state_dict` runs DCP's save protocol (local plans, the coordinator's global plan and metadata, the
writes, ``finish``) through DCP's own collective wrapper, as ``dcp.save`` does, minus what costs per key there
and is of no use to a flat state dict of entries: a ``Stateful`` check and a logger call for every key.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from concurrent.futures import Future as ConcurrentFuture
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.utils import _DistWrapper
from torch.futures import Future

from ..checks.integrity import DCP_METADATA_FILENAME
from .checksums import overlap_pool
from .durable import start_flush
from .framed_layout import SMALL_BYTES, FramedLayout, TensorSlot
from .framing import (
    IndexedItem,
    TensorRecord,
    block_digests,
    encode_index,
    host_contiguous,
    tensor_bytes,
    tensor_record,
)
from .metadata_pickle import MetadataPickler
from .plan_memo import PlanMemo
from .planners import EntrySavePlanner

__all__ = ["FramedFileSystemWriter", "save_state_dict"]

_GATHER_BYTES = 2 << 20
_GATHER_VIEWS = 1024
"""Queued writes are written out (one ``writev``) once they reach either many bytes or many buffers. (A/B, 2-core
VM: 2 MiB took a 122 MB, 672-tensor save 8 % under the stream's buffered writes; 4 MiB and more cost a 4 MB save
~10 %.)"""


_REPEATED = "peftckpt: the write results of the last save"
"""What a rank sends the coordinator instead of write results that are the very ones of the save before."""


class _Gathering:
    """The data file's writes, queued as views (the framing, and each tensor's own memory) and written out a few
    MiB at a time by one vectored write of the stream's hashing file underneath its buffer: no copy of the bytes
    into a buffer first, one system call per batch. Counts the bytes (``tell()`` of a buffered writer costs a
    syscall's worth). The views' memory -- tensors the save holds -- must not change until :meth:`flush`."""

    def __init__(self, stream: io.IOBase) -> None:
        raw = stream.raw if isinstance(stream, io.BufferedWriter) else None
        self._write_many = getattr(raw, "write_many", None)
        self.stream = stream
        self.at = 0
        self._views: list[memoryview] = []
        self._queued = 0

    def write(self, data: bytes | memoryview) -> None:
        if self._write_many is None:  # a stream without vectored writes: as it is
            self.stream.write(data)
            self.at += len(data)
            return
        self._views.append(memoryview(data))
        self.at += len(data)
        self._queued += len(data)
        if self._queued >= _GATHER_BYTES or len(self._views) >= _GATHER_VIEWS:
            self.flush()

    def write_views(self, views: Sequence[memoryview]) -> None:
        """``write`` each of ``views`` (byte views), queued together."""
        if self._write_many is None:
            for view in views:
                self.write(view)
            return
        for start in range(0, len(views), _GATHER_VIEWS):
            part = views[start:start + _GATHER_VIEWS]
            nbytes = sum(map(len, part))
            self._views.extend(part)
            self.at += nbytes
            self._queued += nbytes
            if self._queued >= _GATHER_BYTES or len(self._views) >= _GATHER_VIEWS:
                self.flush()

    def flush(self) -> None:
        if self._views:
            assert self._write_many is not None
            self.stream.flush()  # (nothing is buffered above: every write came here)
            self._write_many(self._views)
            self._views, self._queued = [], 0


class FramedFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` writing ``__<rank>_0.distcp`` with framed records and a block index (module docstring).

    Objects (``BYTE_IO`` items) are written as DCP writes them: their ``torch.save`` bytes."""

    def __init__(self, path: str | os.PathLike[str], sync_files: bool = True) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1,
                         per_thread_copy_ahead=0)
        self.metadata: Metadata | None = None
        """The metadata ``finish`` wrote (on the coordinator)."""
        self.plans: PlanMemo | None = None
        """The save's plan memo: where its metadata holds the planned entries, they are pickled once per memo."""
        self.repeated = False
        """The last write's results are the very ones of the save before it with the same memo (every item where
        that one put it)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        name = f"{prefix}0{DEFAULT_SUFFIX}"
        results: list[WriteResult] = []
        index: list[IndexedItem | str] = []
        hashing: list[tuple[IndexedItem, ConcurrentFuture[list[int]]]] = []
        slots: list[TensorSlot] | None = []
        path = cast(Path, self.fs.concat_path(self.path, name))
        memo = self.plans
        last = memo.written if memo is not None else []
        # Tensors first, in plan order, then objects: a tensor's place in the file depends on the layout alone
        # (objects -- the optimizer's groups, the RNG state -- may change size from one save to the next), so a
        # save laid out like the last one puts every tensor where that one did, and reuses its results.
        items = sorted(plan.items, key=lambda i: i.type == WriteItemType.BYTE_IO)
        framed = memo.framed if memo is not None and memo.framed is not None and \
            len(last) >= len(memo.framed.slots) and isinstance(planner, EntrySavePlanner) and \
            not planner.streams() else None
        with self.fs.create_stream(path, "wb") as stream:
            out = _Gathering(stream)
            start = 0
            if framed is not None:  # laid out like the last save: its tensors through the layout it left
                start = len(framed.slots)
                index.extend(framed.write(out, [cast(torch.Tensor, planner.resolve_data(item)) for item in items[:start]]))
                results.extend(last[:start])
            for n in range(start, len(items)):
                item = items[n]
                at = out.at
                indexed, record = self._write_item(out, item, planner.resolve_data(item), hashing)
                indexed.offset, indexed.data_offset = at, at + indexed.data_offset
                index.append(indexed)
                if slots is not None and item.type != WriteItemType.BYTE_IO:
                    if record is None:  # a tensor left to torch.save: no layout to write through
                        slots = None
                    else:
                        slots.append(TensorSlot(at, record))
                length = out.at - at
                result = last[n] if n < len(last) else None
                if result is None or result.index is not item.index or result.size_in_bytes != length or \
                        result.storage_data.offset != at or result.storage_data.relative_path != name:
                    result = WriteResult(index=item.index, size_in_bytes=length,
                                         storage_data=_StorageInfo(name, at, length))
                results.append(result)
            for indexed, blocks in hashing:  # (taken on another core while the items were written)
                indexed.digests[1:1] = blocks.result()
            out.write(encode_index(index))
            out.flush()
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        if not self.sync_files and Path(path).absolute() not in getattr(self.fs, "streamed", ()):
            start_flush(path)  # the commit's fsync of the file, begun while the save goes on (durable.py)
        self.repeated = memo is not None and memo.wrote and len(results) == len(last) and \
            all(a is b for a, b in zip(results, last))
        if memo is not None:
            memo.written, memo.wrote = results, True
            if framed is None and slots:
                memo.framed = FramedLayout.matching(slots)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    @staticmethod
    def _write_item(out: _Gathering, item: WriteItem, data: Any,
                    hashing: list[tuple[IndexedItem, ConcurrentFuture[list[int]]]]
                    ) -> tuple[IndexedItem, TensorRecord | None]:
        """Write one item; its index record with offsets relative to the item's start, and the record that framed
        it (``None`` for an object or a tensor left to ``torch.save``). An object, and a tensor left to
        ``torch.save``, is recorded as framing only (read whole, verified by one digest). The block digests of a
        large tensor are taken on another core while the file is written: its record and their future are added
        to ``hashing`` (the block digests go between its framing digests)."""
        if item.type == WriteItemType.BYTE_IO:
            raw = memoryview(cast(io.BytesIO, data).getbuffer()).cast("B")
            out.write(raw)
            return IndexedItem(0, len(raw), len(raw), 0, [xxhash.xxh3_64_intdigest(raw), xxhash.xxh3_64_intdigest(b"")]), None
        tensor = host_contiguous(cast(torch.Tensor, data))
        record = tensor_record(tensor)
        if record is None:  # a dtype without a storage class, or a record too large for a plain zip
            buf = io.BytesIO()
            torch.save(tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor, buf)
            blob = buf.getbuffer()
            out.write(blob)
            return IndexedItem(0, len(blob), len(blob), 0, [xxhash.xxh3_64_intdigest(blob), xxhash.xxh3_64_intdigest(b"")]), None
        data_bytes = tensor_bytes(tensor)
        head, tail = record.framing_digests
        if len(data_bytes) <= SMALL_BYTES:  # one write of one short copy beats three writes
            out.write(b"".join((record.prefix, data_bytes, record.suffix)))
            return IndexedItem(0, record.length, len(record.prefix), record.nbytes,
                               [head, *block_digests(data_bytes), tail]), record
        indexed = IndexedItem(0, record.length, len(record.prefix), record.nbytes, [head, tail])
        hashing.append((indexed, overlap_pool().submit(block_digests, data_bytes)))
        out.write(record.prefix)
        out.write(data_bytes)
        out.write(record.suffix)
        return indexed, record

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's ``finish`` (the storage items and the metadata file, written to a temporary name and renamed),
        with the metadata pickled by the plan memo's :class:`MetadataPickler` where it holds the planned entries."""
        plans = self.plans
        if plans is None or plans.metadata is None or metadata.state_dict_metadata is not plans.metadata.state_dict_metadata:
            super().finish(metadata, results)
            self.metadata = metadata
            return
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {r.index: r.storage_data for written in results for r in written}
        metadata.storage_meta = self.storage_meta()
        pickler = plans.pickler
        adopted = pickler.adopt(metadata.storage_data) if pickler is not None else None
        if adopted is not None:  # every item where the last save put it
            metadata.storage_data = adopted
        else:
            pickler = plans.pickler = MetadataPickler(metadata.state_dict_metadata, metadata.storage_data)
        assert pickler is not None
        data = pickler.dumps(metadata)
        final = cast(Path, self.fs.concat_path(self.path, DCP_METADATA_FILENAME))
        temporary = cast(Path, self.fs.concat_path(self.path, f"{DCP_METADATA_FILENAME}.tmp"))
        with self.fs.create_stream(temporary, "wb") as stream:
            stream.write(data)
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        self.fs.rename(temporary, final)  # (into a fresh staging directory: nothing to replace)
        self.metadata = metadata


def save_state_dict(state_dict: dict[str, Any], writer: FramedFileSystemWriter, planner: SavePlanner,
                    group: dist.ProcessGroup | None, memo: PlanMemo | None = None) -> Metadata | None:
    """``dcp.save(state_dict, storage_writer=writer, planner=planner, process_group=group)`` for a flat state dict
    without ``Stateful`` values: the same steps and the same collective error handling (a failure on any rank
    raises DCP's ``CheckpointException`` on every rank). Returns the metadata written (on the coordinator).

    ``memo``: the plans of a save laid out like this one, which every rank agreed to reuse (then no planning step
    runs: each rank writes its last plan, the coordinator fills in a copy of the last metadata), or an empty one
    to keep this save's plans in."""
    wrapper = _DistWrapper(group, dist.is_available() and dist.is_initialized(), 0)
    metadata: Metadata | None = None
    writer.plans = memo

    def local_step() -> SavePlan:
        planner.set_up_planner(state_dict, writer.storage_meta(), wrapper.is_coordinator)
        writer.set_up_storage_writer(wrapper.is_coordinator, rank=wrapper.rank, use_collectives=True)
        return writer.prepare_local_plan(planner.create_local_plan())

    def global_step(plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal metadata
        plans, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(plans)

    if memo is not None and memo.plan is not None:
        planner.set_up_planner(state_dict, writer.storage_meta(), wrapper.is_coordinator)
        writer.set_up_storage_writer(wrapper.is_coordinator, rank=wrapper.rank, use_collectives=True)
        plan = memo.plan
        metadata = memo.fresh_metadata() if wrapper.is_coordinator else None
    else:
        plan = wrapper.reduce_scatter("plan", local_step, global_step)
        if memo is not None:
            memo.plan, memo.metadata = plan, metadata

    def write() -> list[WriteResult] | str:
        written = writer.write_data(planner.finish_plan(plan), planner)
        written.wait()
        # The coordinator gathers every rank's results (pickled, sent, unpickled: ~10 us each): where they are the
        # ones it gathered at the save before, a token says so.
        return _REPEATED if writer.repeated else written.value()

    def finish(gathered: list[list[WriteResult] | str]) -> None:
        assert metadata is not None
        last = memo.gathered if memo is not None else []
        if any(isinstance(r, str) and (r != _REPEATED or rank >= len(last)) for rank, r in enumerate(gathered)):
            raise RuntimeError("a rank's write results were said to repeat the last save's, which the coordinator "
                               "does not hold")
        results = [last[rank] if isinstance(r, str) else r for rank, r in enumerate(gathered)]
        if memo is not None:
            memo.gathered = results
        writer.finish(metadata, results)
        # (nothing to hand back: DCP's all_reduce broadcasts what this returns, and the metadata -- kept by the
        # coordinator's writer -- pickled and sent to every rank cost ~40 ms a save at 2688 stored tensors)

    wrapper.all_reduce("write", write, finish)
    return writer.metadata
