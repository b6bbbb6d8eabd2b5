"""Checkpoint storage formats behind one small protocol: ``torch_dist`` (DCP: reshardable, the default) and the
legacy ``torch`` format (one file per model-parallel rank, :mod:`~peftckpt.checkpoint.storage.legacy`).

A caller asks a format what it can do (:class:`StorageFormat`'s flags) and lets it do its part of a save (write
this rank's files; name them; check the written whole), of a load (open the checkpoint: which keys it stores,
and the read into the request, :class:`StoredCheckpoint`) and of the offline
checks (is the stored structure sound); nothing else branches on a format's name. :func:`storage_format` looks
one up, refusing an unknown name with a message that says where it came from.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from ..background import one_core
from ..checks.integrity import (
    DCP_METADATA_FILENAME,
    dcp_problems,
    files_problems,
    held_pieces,
    item_files,
    storage_problems,
    stored_structure,
    unwritten_pieces,
)
from ..errors import CheckpointError, CheckpointFormatError
from ..faults import fault_hook, fault_point
from ..gc_pause import paused_gc
from ..options import SaveOptions
from ..snapshot import host_copy
from .byte_sources import ByteSource
from .checksums import ChecksummingFileSystem, StreamTo
from .dcp_reader import RangedFileSystemReader, load_state_dict
from .dcp_writer import FramedFileSystemWriter, save_state_dict
from .huge_pages import prefer_huge_pages
from .key_listing import KeyListing, list_dcp_keys, list_legacy_keys
from .legacy import LegacyRankFile, rank_file, save_rank_file
from .manifest import TORCH, TORCH_DIST, Manifest
from .plan_memo import PlanMemo, WholeRecord
from .planners import EntryLoadPlanner, EntrySavePlanner
from .safe_pickle import load_dcp_metadata

# DCP tells every one-process load (and save) that it "assumes the intent is to load in a single process": a
# checkpointer without a process group means exactly that, so the notice says nothing to peftckpt's users.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming "
                        r"the intent is to (load|save) in a single process", category=UserWarning)

__all__ = ["StorageFormat", "StoredCheckpoint", "WriteJob", "Written", "TorchDistFormat", "LegacyTorchFormat", "FORMATS", "storage_format", "no_zip_crc32"]


@dataclass
class WriteJob:
    """Step 3 of a save on one rank: what to write, where, and with what."""

    flat: dict[str, Any]
    """This rank's ``{storage key: entry}``."""
    staging: Path
    """The directory this rank writes its files into."""
    iteration: int
    options: SaveOptions
    rank: int
    coords: Mapping[str, int]
    layout: Mapping[str, int]
    group: dist.ProcessGroup | None
    chunks: Sequence[nn.Module]
    optimizer: torch.optim.Optimizer | None
    host_buffers: dict[str, Any] = field(default_factory=dict)
    """The host buffers of the last async save, reused by the next one (updated by the write)."""
    async_group: Callable[[], dist.ProcessGroup | None] | None = None
    """The background save's own process group (created on first use)."""
    after_write: Callable[[], None] | None = None
    """Run by an async save's thread once this rank's files are written (the hand-over to the location, the
    commit)."""
    plans: PlanMemo | None = None
    """The plans of the last save laid out like this one, to reuse (or an empty memo to keep this one's in)."""
    on_snapshot: Callable[[], None] | None = None
    """Set by a save that runs in a thread of its own (a deferred snapshot): the format copies the entries to host
    memory, calls this, and writes them there and then (``async_group`` and ``after_write`` are unused)."""
    stream_to: StreamTo | None = None
    """Where data files go as they are written, instead of into ``staging`` (a store: straight into its objects);
    a format that cannot stream writes them into ``staging``, and the location uploads them."""


@dataclass
class Written:
    """What a format's write produced on one rank; an async write's thread fills it in as it goes."""

    checksums: ChecksummingFileSystem | None = None
    """Digests of the files, taken while they were written."""
    metadata: Any = None
    """The DCP metadata the write recorded (rank 0), checked by the commit without reading it back."""
    future: Future[Any] | None = None
    """The background write of an async save."""
    snapshot_taken: threading.Event | None = None
    """Set once a deferred snapshot (``SaveOptions.defer_snapshot``) is copied to host memory (or the save failed
    before it could be)."""
    release: threading.Event | None = None
    """An async write's thread starts once this is set (when every rank agreed the write began)."""


class StoredCheckpoint(Protocol):
    """A committed checkpoint as one rank reads it: what it stores, and the read of a request."""

    tensor_shapes: dict[str, list[int] | None]
    """The stored tensors this rank can read, with their global shapes (``None``: the format stores local
    shards and cannot say)."""
    object_keys: set[str]
    """The stored objects (optimizer groups, RNG state, states, the caller's objects) this rank can read."""
    per_rank: bool
    """The keys are this rank's own (a file per rank), not the whole checkpoint's."""
    @property
    def unindexed(self) -> list[str]:
        """After :meth:`read`: the data files read from a store that have no block index, so the read could not
        verify them (written by stock DCP or an earlier peftckpt): the load hashes them whole."""
        ...

    def read(self, request: dict[str, Any], on_piece: Callable[[str, tuple[int, ...], torch.Tensor], None] | None = None
             ) -> list[str]:
        """Read the request in place: tensor entries into their pieces (``on_piece(key, offsets, tensor)`` is
        called with each piece once read), object keys replaced by the stored objects. Returns the damage the
        read found while verifying what it read (one message per damaged region, naming the file)."""
        ...


class StorageFormat(Protocol):
    """What the checkpointer, the commit and the offline tools ask of a format."""

    name: ClassVar[str]
    holds_states: ClassVar[bool]
    """Can hold per-rank objects such as the checkpointer's ``states``."""
    reshards: ClassVar[bool]
    """Loads at any layout (and serves as a base for ``load_pretrained`` and the offline tools)."""
    hashes_while_reading: ClassVar[bool]
    """A load can hash its data files while it reads them (else they are verified first)."""
    reads_by_range: ClassVar[bool]
    """A load reads byte ranges of the data files, through ``open``'s ``sources`` where given (else a location
    that keeps the files elsewhere fetches a local copy first)."""
    holds_trainable_only: ClassVar[bool]
    """Can hold a trainable-only checkpoint (its tensors keep ``requires_grad``, which selects them)."""
    writes_async: ClassVar[bool]
    """An async save writes it in the background (else it is written at once, the handle done)."""

    def write(self, job: WriteJob) -> Written:
        """Write this rank's files into ``job.staging`` (an async write: start a thread that will, once its
        ``release`` is set)."""
        ...

    def files_written_by(self, staging: Path, rank: int, coords: Mapping[str, int],
                         layout: Mapping[str, int]) -> list[Path]:
        """The files this rank wrote (it checksums them for the manifest)."""
        ...

    def written_problems(self, staging: Path, files: Mapping[str, Any], saved_keys: Mapping[str, Any],
                         plans: PlanMemo, stored: Mapping[str, int] | None = None, metadata: Any = None) -> list[str]:
        """Why the written staging directory is not a whole checkpoint (rank 0, before the commit): ``plans``
        holds the pieces every rank had to write (and keeps the checks of the planned entries, reused by the next
        save laid out the same way). ``stored``: the sizes of the files as uploaded to an object store (else the
        files in ``staging`` are examined); ``metadata``: what the write recorded of its files, if it kept it
        (else it is read back)."""
        ...

    def open(self, root: Path, manifest: Manifest, layout: Mapping[str, int], coords: Mapping[str, int],
             group: dist.ProcessGroup | None, verify: bool = True,
             sources: Callable[[str], ByteSource] | None = None) -> StoredCheckpoint:
        """Open the committed checkpoint ``root`` for a load by the rank at ``coords`` of ``layout`` (raises
        ``CheckpointMismatchError`` where the format cannot load at that layout). ``verify``: check what is read
        against digests recorded with it, where the format records them (else the caller hashed the files).
        ``sources``: opens a data file by name where it is not under ``root`` (formats that ``reads_by_range``)."""
        ...

    def structure_problems(self, root: Path, manifest: Manifest, stored: Mapping[str, int] | None = None
                           ) -> list[str]:
        """Offline check of the stored structure against the manifest (raises ``UnsafeCheckpointError`` for
        metadata that must not be used at all). ``stored``: the data files' sizes where they are not under
        ``root``."""
        ...

    def list_keys(self, root: Path, problems: list[str]) -> KeyListing:
        """The keys the files of ``root`` hold, read without loading a tensor (``inspect``); what stops the
        listing is added to ``problems``."""
        ...


@contextlib.contextmanager
def no_zip_crc32() -> Iterator[None]:
    """``torch.save`` without the zip CRC32 of each record, for the DCP write of a blocking save.

    DCP frames every stored tensor with ``torch.save``, whose CRC32 (miniz, ~2.5 GB/s) is a fifth to a third of
    a large save's time. The manifest's checksum of every file already covers those bytes, and ``torch.load``
    reads records without a CRC. The switch is process-wide, so it is only flipped while the caller is
    blocked in the save (an async save keeps the CRC: training, and maybe its own ``torch.save``, goes on).
    """
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


class TorchDistFormat:
    """DCP: every rank writes ``__<rank>_*.distcp`` files, rank 0 the ``.metadata``; global keys, resharding."""

    name: ClassVar[str] = TORCH_DIST
    holds_states: ClassVar[bool] = True
    reshards: ClassVar[bool] = True
    hashes_while_reading: ClassVar[bool] = True
    reads_by_range: ClassVar[bool] = True
    holds_trainable_only: ClassVar[bool] = True
    writes_async: ClassVar[bool] = True

    def write(self, job: WriteJob) -> Written:
        c = Written()
        # One item resolved, framed and written at a time (lazy entries stream; see EntrySavePlanner).
        # No fsync per file here: the location makes the whole checkpoint durable when it publishes it (a
        # directory fsyncs the staging tree at once; a store's copy is the upload), so each file is synced once.
        writer = FramedFileSystemWriter(job.staging, sync_files=False)
        # Checksum each file as it is written (overlapping I/O and hashing).
        writer.fs = c.checksums = ChecksummingFileSystem(stream_to=job.stream_to)
        planner = EntrySavePlanner(on_item=fault_hook("data", job.rank, job.iteration))
        if not job.options.async_save:
            with no_zip_crc32():  # for objects, and any tensor the framing leaves to torch.save
                c.metadata = save_state_dict(job.flat, writer, planner, job.group, job.plans)
            return c
        if job.on_snapshot is not None:  # called by the save's own thread (a deferred snapshot): copy and write here
            snapshot, check_frozen_unchanged = self._host_copy(job)
            job.on_snapshot()
            c.metadata = save_state_dict(snapshot, writer, planner, job.group, job.plans)
            check_frozen_unchanged()
            return c
        # Training is blocked only for the copy to host memory; DCP plans and writes in a thread of its own (its
        # save steps there: `dcp.async_save` would walk every entry here).
        group = None if job.async_group is None else job.async_group()
        release = c.release = threading.Event()  # the thread starts once the save call returns, not competing for the GIL
        snapshot, check_frozen_unchanged = self._host_copy(job)

        def write() -> Any:
            release.wait()
            with paused_gc():
                result = c.metadata = save_state_dict(snapshot, writer, planner, group, job.plans)
                check_frozen_unchanged()
                if job.after_write is not None:
                    job.after_write()  # the hand-over (a store uploads), then the commit
            return result

        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peftckpt-async-save", initializer=one_core)
        c.future = executor.submit(write)
        executor.shutdown(wait=False)  # its one thread ends with the save
        return c

    @staticmethod
    def _host_copy(job: WriteJob) -> tuple[dict[str, Any], Callable[[], None]]:
        """The entries to write while training goes on (:func:`~peftckpt.checkpoint.snapshot.host_copy`, its host
        buffers kept for the next save) and the check to run once they are written."""
        snapshot, buffers, check_frozen_unchanged = host_copy(job.flat, job.host_buffers)
        job.host_buffers.clear()
        job.host_buffers.update(buffers)
        return snapshot, check_frozen_unchanged

    def files_written_by(self, staging: Path, rank: int, coords: Mapping[str, int],
                         layout: Mapping[str, int]) -> list[Path]:
        return sorted(staging.glob(f"__{rank}_*"))

    def written_problems(self, staging: Path, files: Mapping[str, Any], saved_keys: Mapping[str, Any],
                         plans: PlanMemo, stored: Mapping[str, int] | None = None, metadata: Any = None) -> list[str]:
        try:
            if metadata is None:
                metadata = load_dcp_metadata(staging / DCP_METADATA_FILENAME)
            planned = plans.metadata is not None and metadata.state_dict_metadata is plans.metadata.state_dict_metadata
            sizes = {rel: record["size"] for rel, record in files.items()}
            if planned and plans.whole is not None and plans.whole.matches(metadata.storage_data, sizes, saved_keys):
                return files_problems(staging, plans.whole.files, files, stored)  # the last whole save's items
            structure = plans.structure if planned else None
            if structure is None:
                structure = stored_structure(metadata, staging)
                structure.unwritten = unwritten_pieces(metadata, held_pieces(plans.planned))
                if planned:
                    plans.structure = structure
            problems = storage_problems(staging, metadata, dict(files), dict(saved_keys), stored,
                                        structure) + list(structure.unwritten or [])
            if planned and not problems:
                plans.whole = WholeRecord(dict(metadata.storage_data), sizes,
                                          {k: dict(v) for k, v in saved_keys.items()}, item_files(metadata))
            return problems
        except CheckpointError as e:  # e.g. the staging directory was removed under the save
            return [str(e)]

    def open(self, root: Path, manifest: Manifest, layout: Mapping[str, int], coords: Mapping[str, int],
             group: dist.ProcessGroup | None, verify: bool = True,
             sources: Callable[[str], ByteSource] | None = None) -> StoredCheckpoint:
        return _DcpCheckpoint(RangedFileSystemReader(root, verify, sources), group)

    def structure_problems(self, root: Path, manifest: Manifest, stored: Mapping[str, int] | None = None
                           ) -> list[str]:
        return dcp_problems(root, manifest, stored)

    def list_keys(self, root: Path, problems: list[str]) -> KeyListing:
        return list_dcp_keys(root, problems)


class _DcpCheckpoint:
    """A DCP checkpoint opened for a (resharding) load: its metadata's keys, read with DCP's load protocol through the
    ranged reader (each rank reads the bytes of its pieces, verified by block where the files are indexed)."""

    per_rank = False

    def __init__(self, reader: RangedFileSystemReader, group: dist.ProcessGroup | None) -> None:
        self._reader = reader
        self._group = group
        stored = self._reader.read_metadata().state_dict_metadata
        self.tensor_shapes: dict[str, list[int] | None] = {
            k: list(md.size) for k, md in stored.items() if isinstance(md, TensorStorageMetadata)}
        self.object_keys = {k for k, md in stored.items() if isinstance(md, BytesStorageMetadata)}

    def read(self, request: dict[str, Any], on_piece: Callable[[str, tuple[int, ...], torch.Tensor], None] | None = None
             ) -> list[str]:
        prefer_huge_pages(p.tensor for v in request.values() for p in getattr(v, "pieces", ()))  # before 1st touch
        load_state_dict(request, self._reader, EntryLoadPlanner(on_piece), self._group)
        return self._reader.problems

    @property
    def unindexed(self) -> list[str]:
        return self._reader.unindexed


class LegacyTorchFormat:
    """Megatron's ``torch`` format: one ``mp_rank_XX[_YYY]/model_optim_rng.pt`` per model-parallel rank, loadable
    only at the layout it was saved at; data-parallel replicas write nothing."""

    name: ClassVar[str] = TORCH
    holds_states: ClassVar[bool] = False
    reshards: ClassVar[bool] = False
    hashes_while_reading: ClassVar[bool] = False
    reads_by_range: ClassVar[bool] = False
    holds_trainable_only: ClassVar[bool] = False  # saves detached tensors: requires_grad is lost
    writes_async: ClassVar[bool] = False

    def write(self, job: WriteJob) -> Written:
        fault_point("data", job.rank, job.iteration)
        save_rank_file(job.staging, job.chunks, job.optimizer, job.coords, job.layout, job.flat,
                       job.options.save_optim)
        return Written()

    def files_written_by(self, staging: Path, rank: int, coords: Mapping[str, int],
                         layout: Mapping[str, int]) -> list[Path]:
        own = rank_file(staging, coords, layout)
        return [own] if own.is_file() and coords.get("dp", 0) == 0 else []

    def written_problems(self, staging: Path, files: Mapping[str, Any], saved_keys: Mapping[str, Any],
                         plans: PlanMemo, stored: Mapping[str, int] | None = None, metadata: Any = None) -> list[str]:
        return []  # each file is one rank's whole state; the manifest's checksums cover them

    def open(self, root: Path, manifest: Manifest, layout: Mapping[str, int], coords: Mapping[str, int],
             group: dist.ProcessGroup | None, verify: bool = True,
             sources: Callable[[str], ByteSource] | None = None) -> StoredCheckpoint:
        return LegacyRankFile(root, manifest, layout, coords)

    def structure_problems(self, root: Path, manifest: Manifest, stored: Mapping[str, int] | None = None
                           ) -> list[str]:
        return []

    def list_keys(self, root: Path, problems: list[str]) -> KeyListing:
        return list_legacy_keys(root, problems)


FORMATS: dict[str, StorageFormat] = {f.name: f for f in (TorchDistFormat(), LegacyTorchFormat())}


def storage_format(name: str, where: str) -> StorageFormat:
    """The format called ``name``; ``where`` says in the error where the unknown name came from."""
    try:
        return FORMATS[name]
    except KeyError:
        raise CheckpointFormatError(f"{where}: unknown checkpoint format {name!r} (known: "
                                    f"{', '.join(FORMATS)})") from None

