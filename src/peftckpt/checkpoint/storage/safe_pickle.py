"""Read DCP's pickled ``.metadata`` (and its non-tensor items) without executing code from the file.

DCP (``torch.distributed.checkpoint``) stores its global metadata as a plain pickle, and
``FileSystemReader.read_metadata`` loads it with an unrestricted ``pickle.load``: a crafted ``.metadata``
can run arbitrary code. :func:`load_dcp_metadata` uses an unpickler whose ``find_class`` admits only the
classes a real DCP metadata pickle references (found by logging ``find_class`` while loading the
``.metadata`` of a torch 2.13 single-process save of tensors of several dtypes, a channels-last tensor,
optimizer state, ints, floats, strings, tuples, bytes and an ``OrderedDict``):

* ``torch.distributed.checkpoint.metadata``: Metadata, StorageMeta, TensorStorageMetadata,
  BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex, _MEM_FORMAT_ENCODING
* ``torch.distributed.checkpoint.filesystem._StorageInfo``
* ``torch.Size``, every ``torch.<dtype>``, ``torch.serialization._get_layout`` (how layouts pickle)
* ``pathlib.PosixPath`` (``StorageMeta.checkpoint_id`` when the save was given a ``Path``) and its pure
  variants, also under ``pathlib._local`` where Python 3.13 moved them
* plus harmless containers a metadata pickle may use: ``collections.OrderedDict``, ``builtins`` set,
  frozenset, slice, complex. Nothing whose constructor allocates memory the file chooses (``bytearray(10**10)``
  is a 10 GB allocation from a few bytes of pickle), so ``bytearray`` is not admitted.

Memory and blocking: the file is read whole (a regular file only, opened non-blocking, at most
``max_bytes``) and its opcodes are scanned before unpickling: a memo index far beyond the objects built so far
(the C unpickler grows its memo table to the index: a 5-byte opcode can ask for gigabytes) or a length-prefixed
argument longer than the data left (it allocates the declared length before reading) is refused. Unpickling
then needs memory proportional to the file's size, whatever the file says.

Non-tensor ("bytes") items: torch 2.13's ``FileSystemReader.read_data`` hands their bytes to
``planner.load_bytes``, and ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(value,
weights_only=False)``: an unrestricted unpickle. (Tensor items are read with ``weights_only=True``.)
:class:`SafeFileSystemReader` therefore wraps the planner so that every bytes item is first loaded with
``torch.load(weights_only=True)`` and only the re-serialised, known-safe object reaches the planner.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import pickletools
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, cast

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from peftckpt.checkpoint.errors import CheckpointFormatError, UnsafeCheckpointError, weights_only_reason
from peftckpt.checkpoint.storage.paths import read_regular_file
from peftckpt.checkpoint.storage.readahead import ReadAhead

__all__ = ["ALLOWED_GLOBALS", "RestrictedUnpickler", "load_dcp_metadata", "SafeFileSystemReader"]

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_PATH_CLASSES = frozenset({"PosixPath", "PurePosixPath", "PureWindowsPath"})

ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, "Metadata"),
        (_DCP_METADATA, "StorageMeta"),
        (_DCP_METADATA, "TensorStorageMetadata"),
        (_DCP_METADATA, "BytesStorageMetadata"),
        (_DCP_METADATA, "ChunkStorageMetadata"),
        (_DCP_METADATA, "TensorProperties"),
        (_DCP_METADATA, "MetadataIndex"),
        (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "slice"),
        ("builtins", "complex"),
        *(("pathlib", name) for name in _PATH_CLASSES),
        *(("pathlib._local", name) for name in _PATH_CLASSES),
    }
)
"""``(module, name)`` pairs :class:`RestrictedUnpickler` resolves, besides ``torch.<dtype>``."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only :data:`ALLOWED_GLOBALS` and torch dtypes; anything else raises."""

    def __init__(self, file: IO[bytes], source: str | os.PathLike[str]) -> None:
        super().__init__(file)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        """Resolve ``module.name`` if admitted, else raise :class:`UnsafeCheckpointError`."""
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._source} refers to {module}.{name}, which is not one of the classes a DCP metadata "
            f"file may contain; refusing to load it (it could run code). Re-save the checkpoint with "
            f"peftckpt or inspect the file"
        )


_SCANNED: dict[str, None] = {}
"""The XXH3-128 of the last few metadata files whose opcodes passed the scan (insertion-ordered: oldest first)."""
_SCANNED_MAX = 16
_HANDED_ON: dict[str, tuple[str, Metadata]] = {}
"""The metadata a ``hand_on`` load of :func:`load_dcp_metadata` keeps, by path: the digest of its bytes, the object."""

METADATA_MAX_BYTES = 256 << 20
"""Largest ``.metadata`` read (a 70B model's, sharded over 64 ranks with optimizer state, is tens of MB)."""

_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _scan_opcodes(data: bytes, source: str | os.PathLike[str]) -> None:
    """Refuse a pickle whose opcodes would make the C unpickler allocate memory the file chooses.

    ``pickletools.genops`` reads every argument from the in-memory bytes (a length-prefixed argument longer
    than the data left raises instead of being allocated); a memo write may only name the next free slot or
    an earlier one, as every pickler writes them."""
    puts = 0
    try:
        for opcode, arg, _pos in pickletools.genops(io.BytesIO(data)):
            if opcode.name in _MEMO_PUTS:
                if not isinstance(arg, int) or arg > puts:
                    raise CheckpointFormatError(
                        f"DCP metadata file {source} is corrupt: memo index {arg} after {puts} memo entries")
                puts += 1
            elif opcode.name == "MEMOIZE":
                puts += 1
    except CheckpointFormatError:
        raise
    except Exception as exc:  # truncated argument, unknown opcode, ...
        raise CheckpointFormatError(f"DCP metadata file {source} is corrupt: {type(exc).__name__}: {exc}") from exc


def load_dcp_metadata(path: str | os.PathLike[str], max_bytes: int | None = None, hand_on: bool = False,
                      handed: bool = False) -> Metadata:
    """Load a DCP ``.metadata`` pickle through :class:`RestrictedUnpickler`.

    The file must be a regular file of at most ``max_bytes`` (default :data:`METADATA_MAX_BYTES`); its
    opcodes are scanned first (see the module docstring). ``hand_on``: the metadata is kept for the next call
    with ``handed`` that reads the same bytes from the same path (a load's integrity check, then its reader: one
    unpickling, not two); it is handed on once, so each load still unpickles its checkpoint's metadata.

    Raises:
        UnsafeCheckpointError: the pickle refers to a class outside the admitted set.
        CheckpointFormatError: the file is missing, not a regular file, too large, not a valid pickle, or
            holds no DCP ``Metadata``.
    """
    try:
        data = read_regular_file(Path(path), METADATA_MAX_BYTES if max_bytes is None else max_bytes)
    except FileNotFoundError:
        raise CheckpointFormatError(f"DCP metadata file {path} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"DCP metadata file {path} cannot be read: {exc}") from exc
    key = xxhash.xxh3_128_hexdigest(data)
    kept = _HANDED_ON.pop(str(path), None) if handed else None
    if kept is not None and kept[0] == key:
        return kept[1]
    if key not in _SCANNED:  # the same bytes scanned before need no second scan (a load reads .metadata 2-3 times)
        _scan_opcodes(data, path)
    try:
        obj = RestrictedUnpickler(io.BytesIO(data), path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as exc:  # any unpickling failure of a corrupt file: EOF, bad opcode, bad args
        raise CheckpointFormatError(
            f"DCP metadata file {path} is corrupt: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(obj, Metadata):
        raise CheckpointFormatError(
            f"DCP metadata file {path} holds a {type(obj).__name__}, expected "
            f"torch.distributed.checkpoint.metadata.Metadata"
        )
    if len(_SCANNED) >= _SCANNED_MAX:
        _SCANNED.pop(next(iter(_SCANNED)))
    _SCANNED[key] = None
    if hand_on:
        _HANDED_ON.clear()  # one at a time: a kept one that nobody took is dropped here
        _HANDED_ON[str(path)] = (key, obj)
    return obj


class _SafeBytesPlanner:
    """Proxy of a ``LoadPlanner`` whose ``load_bytes`` only ever sees weights_only-loaded objects."""

    def __init__(self, planner: LoadPlanner, reader: SafeFileSystemReader,
                 on_item: Callable[[ReadItem], None] | None = None) -> None:
        self._planner = planner
        self._reader = reader
        self._on_item = on_item
        """Called as the reader hands each item over (read-ahead progress)."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if self._on_item is not None:
            self._on_item(read_item)
        return self._planner.resolve_tensor(read_item)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if self._on_item is not None:
            self._on_item(read_item)
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            where = self._reader.describe_item(read_item)
            reason = weights_only_reason(str(exc))
            raise UnsafeCheckpointError(
                f"non-tensor item {where} cannot be loaded with torch.load(weights_only=True), so it is "
                f"refused (it could run code): {reason}"
            ) from exc
        set_object = getattr(self._planner, "set_object", None)
        if set_object is not None:  # a planner of ours takes the object as loaded (planners.EntryLoadPlanner)
            set_object(read_item, obj)
            return
        # A stock planner unpickles without restriction; hand it our own serialisation of a safe object.
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        self._planner.load_bytes(read_item, safe)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that never unpickles without restriction.

    * ``read_metadata`` goes through :func:`load_dcp_metadata` (and, like the base class, fills in
      ``storage_meta`` and its ``load_id``).
    * ``read_data`` loads non-tensor items with ``torch.load(weights_only=True)`` before the planner
      sees them; tensors are already loaded that way by the base class.
    """

    _metadata_read: tuple[tuple[str, str], Metadata] | None = None
    """The last metadata read, by path and load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Read ``.metadata`` (or ``__<rank>.metadata`` when ``rank`` is given) safely; asked again within the
        same load (the checkpoint opened, then DCP's load), the same metadata, not a second unpickling."""
        path = self._get_metadata_path(kwargs.get("rank"))
        key = (str(path), self.load_id)
        if self._metadata_read is not None and self._metadata_read[0] == key:
            return self._metadata_read[1]
        metadata = load_dcp_metadata(path, handed=True)
        stored = getattr(metadata, "storage_meta", None)
        metadata.storage_meta = StorageMeta() if stored is None else copy.copy(stored)  # this reader's own
        cast(StorageMeta, metadata.storage_meta).load_id = self.load_id
        self._metadata_read = (key, metadata)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Base ``read_data`` with bytes items checked by ``torch.load(weights_only=True)``, and the byte
        ranges it reads fetched ahead of it (:class:`~peftckpt.checkpoint.storage.readahead.ReadAhead`)."""
        # The base class reads file by file (in order of first appearance in the plan), items in plan order.
        per_file: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append((info.offset, info.length))
        schedule = [(Path(str(self.fs.concat_path(self.path, rel))), offset, length)
                    for rel, ranges in per_file.items() for offset, length in ranges]
        with ReadAhead(schedule) as ahead:
            def on_item(item: ReadItem) -> None:
                ahead.consumed(self.storage_data[item.storage_index].length)

            return super().read_data(plan, cast(LoadPlanner, _SafeBytesPlanner(planner, self, on_item)))

    def describe_item(self, read_item: ReadItem) -> str:
        """``'<fqn>' in <file>`` for error messages."""
        fqn = read_item.storage_index.fqn
        info = self.storage_data.get(read_item.storage_index)
        rel = getattr(info, "relative_path", "?")
        return f"{fqn!r} in {Path(str(self.path)) / rel}"
