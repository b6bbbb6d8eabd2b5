"""safetensors files read and written a tensor (or a slice of one) at a time, never a whole model.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``), then the raw,
row-major bytes of every tensor (offsets relative to the end of the header). Everything needed to validate a
file -- names, dtypes, shapes, that every byte range lies inside the file -- is in the header, so a file is
checked before any tensor is read, and a slice of rows (and columns) of one tensor is read by positional reads
of its own bytes (a local file) or ranged GETs (an object on a store).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.storage.byte_sources import ByteSource, FileSource
from ..checkpoint.storage.framing import tensor_bytes
from ..json_text import parse_json

__all__ = ["DTYPES", "SafetensorsError", "TensorInfo", "SafetensorsFile", "write_safetensors"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 2**20
_BOUNCE_BYTES = 32 << 20
"""The reused buffer of a read that cannot land in its destination (a column slice, another dtype)."""


def _count(value: object) -> int:
    """A dimension or byte offset of a header: a JSON integer (``4.5``, ``true`` or ``"4"`` is malformed)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"not an integer: {value!r}")
    return value


class SafetensorsError(ValueError):
    """A safetensors file that is truncated, malformed or not what it should be (the message names it)."""


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in its file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset of its first element in the file."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SafetensorsFile:
    """One safetensors file, its header validated on open; tensors are read on demand. ``file``: a local path, or
    a :class:`~peftckpt.checkpoint.storage.byte_sources.ByteSource` (an object on a store, read by ranges)."""

    def __init__(self, file: str | os.PathLike[str] | ByteSource):
        self._source = None if isinstance(file, (str, os.PathLike)) else file
        self.name = str(file) if self._source is None else self._source.name
        """The file as messages name it (its path or URL)."""
        self.path = Path(self.name)
        self.tensors: dict[str, TensorInfo] = {}
        self._buffer: torch.Tensor | None = None
        try:
            with self._opened() as source:
                size = source.size
                prefix = source.read(8, 0)
                if len(prefix) < 8:
                    raise SafetensorsError(f"{self.name} is truncated: {size} bytes, no safetensors header")
                (length,) = struct.unpack("<Q", prefix)
                if length > min(_MAX_HEADER, size - 8):
                    raise SafetensorsError(f"{self.name} is truncated or not safetensors: its header claims "
                                           f"{length} bytes of a {size}-byte file")
                header = parse_json(source.read(length, 8))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{self.name} cannot be read as safetensors: {e}") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.name}: the safetensors header is not a JSON object")
        data_start = 8 + length
        for name, rec in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = DTYPES[rec["dtype"]]
                shape = tuple(_count(d) for d in rec["shape"])
                begin, end = (_count(x) for x in rec["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.name}: tensor {name!r} has an unsupported or malformed header "
                                       f"entry {str(rec)[:80]}") from None
            if any(d < 0 for d in shape) or end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise SafetensorsError(f"{self.name}: tensor {name!r}: {rec['dtype']} {list(shape)} does not fit "
                                       f"its {end - begin} bytes")
            if data_start + end > size:
                raise SafetensorsError(f"{self.name} is truncated: tensor {name!r} ends at byte "
                                       f"{data_start + end}, the file has {size}")
            self.tensors[name] = TensorInfo(dtype, shape, data_start + begin)

    @property
    def bytes_fetched(self) -> int | None:
        """Bytes fetched from a store by this file's reads so far (``None``: a local file)."""
        return getattr(self._source, "fetched", None)

    @contextlib.contextmanager
    def _opened(self) -> Iterator[ByteSource]:
        """The file to read: the source it was opened with, or the local file opened for this one read (a model
        read tensor by tensor holds no descriptor between reads)."""
        if self._source is not None:
            yield self._source
            return
        source = FileSource(self.path)
        try:
            yield source
        finally:
            source.close()

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """A fresh copy of ``name`` (or of its ``rows`` / ``cols`` along dims 0 / 1): only those bytes are read."""
        info = self.tensors[name]
        shape = list(info.shape)
        if rows is not None and shape:
            shape[0] = len(range(*rows.indices(shape[0])))
        if cols is not None and len(shape) > 1:
            shape[1] = len(range(*cols.indices(shape[1])))
        out = torch.empty(shape, dtype=info.dtype)
        self.read_into(name, out, rows, cols)
        return out

    def read_into(self, name: str, out: torch.Tensor, rows: slice | None = None, cols: slice | None = None) -> None:
        """:meth:`read` into ``out`` (the shape of the region): the bytes of ``rows`` go straight into ``out``'s
        memory when it is a contiguous CPU tensor of the file's dtype and the region spans whole rows; else they
        pass through a reused buffer, a run of rows at a time, and the region (``cols``) is copied out of it."""
        info = self.tensors[name]
        if out.numel() == 0:
            return
        with self._opened() as source:
            if not info.shape:  # a scalar: its few bytes
                scalar = torch.empty((), dtype=info.dtype)
                self._pread(source, tensor_bytes(scalar.reshape(1)), info.begin, name)
                out.copy_(scalar)
                return
            first, stop, _ = (rows or slice(None)).indices(info.shape[0])
            row_elems = math.prod(info.shape[1:])
            row_bytes = row_elems * info.dtype.itemsize
            whole_rows = cols is None or len(info.shape) < 2 or cols.indices(info.shape[1])[:2] == (0, info.shape[1])
            if whole_rows and out.dtype == info.dtype and out.is_cpu and out.is_contiguous():
                self._pread(source, tensor_bytes(out), info.begin + first * row_bytes, name)
                return
            per_run = max(1, min(stop - first, _BOUNCE_BYTES // max(1, row_bytes)))
            bounce = self._bounce(per_run * row_bytes)
            for at in range(first, stop, per_run):
                n = min(per_run, stop - at)
                part = bounce[:n * row_bytes].view(info.dtype)
                self._pread(source, tensor_bytes(part), info.begin + at * row_bytes, name)
                region = part.view(n, *info.shape[1:])
                if cols is not None and len(info.shape) > 1:
                    region = region[:, cols]
                out.narrow(0, at - first, n).copy_(region)

    def _bounce(self, nbytes: int) -> torch.Tensor:
        """A reused byte buffer of at least ``nbytes`` (no fresh memory faulted in for every tensor)."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(max(nbytes, _BOUNCE_BYTES), dtype=torch.uint8)
        return self._buffer

    def _pread(self, source: ByteSource, into: memoryview, offset: int, name: str) -> None:
        if source.read_into([into], offset) != len(into):
            raise SafetensorsError(f"{self.name} is truncated: the bytes of tensor {name!r} end past its end")


def write_safetensors(path: str | os.PathLike[str], specs: Mapping[str, tuple[torch.dtype, Iterable[int]]],
                      tensors: Iterator[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file whose header is known in advance (``specs``: name -> dtype, shape, in file
    order) from ``tensors``, produced one at a time in the same order; then fsync it.

    Raises:
        SafetensorsError: a produced tensor is not the one the header announced (name, dtype or shape).
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})} if metadata else {}
    offset = 0
    order = []
    for name, (dtype, shape) in specs.items():
        shape = [int(d) for d in shape]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        order.append((name, dtype, shape))
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data to 8 bytes, as the reference writer does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, dtype, shape), (got_name, tensor) in zip(order, tensors, strict=True):
            if got_name != name or tensor.dtype != dtype or list(tensor.shape) != shape:
                raise SafetensorsError(f"{path}: expected {name} {dtype} {shape}, got {got_name} {tensor.dtype} "
                                       f"{list(tensor.shape)}")
            if tensor.numel():
                f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        f.flush()
        os.fsync(f.fileno())
