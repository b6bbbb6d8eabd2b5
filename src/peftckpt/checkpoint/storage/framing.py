"""How a ``torch_dist`` data file frames its items: ``torch.save``-compatible tensor records written straight
from the tensor's memory, and the block index that lets a load read and verify any part of an item.

**Records.** DCP's stock writer frames every stored tensor with ``torch.save`` (a zip holding a pickle and the
bytes), and its stock reader ``torch.load``\\ s each item's byte range. ``torch.save`` costs ~200 us of Python
per tensor however small, which made a checkpoint of many small adapter tensors cost 10x its bytes.
:func:`tensor_record` writes the same zip -- the pickle ``torch.save`` writes (byte for byte), the ``byteorder``,
``version``, ``.format_version`` and ``.storage_alignment`` records, CRC32 fields left 0 as ``torch.save`` does
with ``set_crc32_options(False)``, and the central directory -- as a cached prefix and suffix around the
tensor's own bytes. Stock ``torch.load`` and stock ``torch.distributed.checkpoint`` read it unchanged.
Records of 2 GiB and more, and dtypes without a storage class, fall back to ``torch.save`` (no zip64 here).

**Block index.** Each data file ends with an index of its items: for every item its place in the file, where
its tensor bytes start and end inside it, and XXH3-64 digests of its framing and of each :data:`BLOCK_BYTES`
block of its tensor bytes. A load reads only the blocks that hold the elements it needs -- a row-sharded piece
out of a whole stored tensor reads its rows, not the tensor -- and verifies exactly what it read. The index is
the file's tail, after the last item, so stock DCP never sees it::

    [item][item]...[item][index JSON][u64 index length][u64 XXH3-64 of the index][b"PEFTIDX1"]

The file's whole checksum in the manifest covers everything, index included (``verify`` checks it).
"""

from __future__ import annotations

import collections
import io
import json
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, cast

import torch
import xxhash

__all__ = ["BLOCK_BYTES", "INDEX_ALGORITHM", "TensorRecord", "tensor_record", "host_contiguous", "tensor_bytes", "IndexedItem",
           "block_digests", "segment_digests", "encode_index", "ends_with_index", "read_index", "BlockIndexError"]

BLOCK_BYTES = 1 << 20
"""Verification granularity of tensor bytes: a partial read reads at most one block more at each end."""
INDEX_ALGORITHM = "xxh3_64"
_MAGIC = b"PEFTIDX1"
_FOOTER = struct.Struct("<QQ8s")
_INDEX_MAX_BYTES = 256 << 20
_RECORD_MAX_BYTES = (2 << 30) - (1 << 20)
_ALIGN = 64  # where the tensor bytes start inside a record, as torch.save aligns them (mmap-able)
_ARCHIVE = "archive"


# ------------------------------------------------------------------------------------------------ records
class _StorageRef:
    """Stands for the tensor's storage in the pickle (a persistent id, as ``torch.save`` writes it)."""


_REF = _StorageRef()


class _TensorReduce:
    def __init__(self, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.size = size
        self.stride = stride

    def __reduce__(self) -> Any:
        return (torch._utils._rebuild_tensor_v2, (_REF, 0, self.size, self.stride, False, collections.OrderedDict()))


class _RecordPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, storage_type: type, numel: int) -> None:
        super().__init__(file, protocol=2)
        self._storage = ("storage", storage_type, "0", "cpu", numel)

    def persistent_id(self, obj: Any) -> Any:
        return self._storage if obj is _REF else None


def _local_header(name: bytes, at: int, size: int) -> bytes:
    """A zip local file header for a stored (uncompressed) entry whose data starts ``_ALIGN``-aligned."""
    pad = (-(at + 30 + len(name) + 4)) % _ALIGN
    extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0x0800, 0, 0, 0, 0, size, size, len(name), len(extra)) \
        + name + extra


def _central_entry(name: bytes, header_at: int, size: int) -> bytes:
    return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0x0800, 0, 0, 0, 0, size, size, len(name), 0, 0,
                       0, 0, 0, header_at) + name


@dataclass(frozen=True)
class TensorRecord:
    """A ``torch.save`` zip of one tensor as ``prefix + <its bytes> + suffix``."""

    prefix: bytes
    suffix: bytes
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)

    @cached_property
    def framing_digests(self) -> tuple[int, int]:
        """XXH3-64 of the prefix and of the suffix (the same for every tensor of this dtype and shape)."""
        return xxhash.xxh3_64_intdigest(self.prefix), xxhash.xxh3_64_intdigest(self.suffix)


@lru_cache(maxsize=4096)
def _record(dtype: torch.dtype, shape: tuple[int, ...]) -> TensorRecord | None:
    storage_name = torch.storage._dtype_to_storage_type_map().get(dtype)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    if storage_name is None or nbytes >= _RECORD_MAX_BYTES:
        return None
    stride = tuple(int(s) for s in torch.empty(shape, dtype=dtype, device="meta").stride())
    pkl = io.BytesIO()
    _RecordPickler(pkl, getattr(torch, storage_name), numel).dump(_TensorReduce(shape, stride))
    small = [("data.pkl", pkl.getvalue()), (".format_version", b"1"), (".storage_alignment", str(_ALIGN).encode()),
             ("byteorder", b"little")]
    out = bytearray()
    central = bytearray()
    for name, payload in small:
        key = f"{_ARCHIVE}/{name}".encode()
        central += _central_entry(key, len(out), len(payload))
        out += _local_header(key, len(out), len(payload)) + payload
    key = f"{_ARCHIVE}/data/0".encode()
    central += _central_entry(key, len(out), nbytes)
    out += _local_header(key, len(out), nbytes)
    prefix = bytes(out)
    tail = bytearray()
    at = len(prefix) + nbytes
    key = f"{_ARCHIVE}/version".encode()
    central += _central_entry(key, at, 2)
    tail += _local_header(key, at, 2) + b"3\n"
    directory_at = at + len(tail)
    tail += central
    tail += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(small) + 2, len(small) + 2, len(central), directory_at, 0)
    return TensorRecord(prefix, bytes(tail), nbytes)


def tensor_record(tensor: torch.Tensor) -> TensorRecord | None:
    """The record framing ``tensor`` (contiguous, on the CPU), or ``None`` where ``torch.save`` must frame it."""
    return _record(tensor.dtype, tuple(tensor.shape))


_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` outside autograd, in host memory, contiguous (itself where it already is)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.ndim and tensor.dtype in _NUMPY_DTYPES:  # one call fewer than the byte view (a tenth of a small save)
        return memoryview(cast(Any, tensor.numpy())).cast("B") if tensor.numel() else memoryview(b"")
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, flat.view(torch.uint8).numpy())).cast("B")


# -------------------------------------------------------------------------------------------------- index
@dataclass
class IndexedItem:
    """One item of a data file as the block index records it (offsets relative to the file)."""

    offset: int
    length: int
    data_offset: int
    """Where the tensor bytes start (``offset + len(prefix)``); ``data_offset == offset`` for an object."""
    data_length: int
    digests: list[int]
    """Framing before the data, each :data:`BLOCK_BYTES` block of the data, framing after it."""

    @property
    def opaque(self) -> bool:
        """A record read whole under one digest (a ``torch.save`` framed tensor): no data bytes of its own."""
        return self.data_length == 0 and self.data_offset == self.offset + self.length

    def block_range(self, start: int, end: int) -> tuple[int, int, int, int]:
        """The data blocks covering data bytes ``[start, end)``: ``(first block, end block, their first byte,
        their end byte)`` (bytes relative to the data start)."""
        first, last = start // BLOCK_BYTES, max(start, end - 1) // BLOCK_BYTES + 1
        return first, last, first * BLOCK_BYTES, min(last * BLOCK_BYTES, self.data_length)

    def to_json(self) -> str:
        """Its entry in the index's JSON: ``[offset,length,data_offset,data_length,"<digests' hex>"]`` (each
        digest 8 little-endian bytes)."""
        return (f"[{self.offset},{self.length},{self.data_offset},{self.data_length},"
                f"\"{struct.pack(f'<{len(self.digests)}Q', *self.digests).hex()}\"]")


def block_digests(data: memoryview) -> list[int]:
    """XXH3-64 of each :data:`BLOCK_BYTES` block of ``data`` (none for no bytes)."""
    return [xxhash.xxh3_64_intdigest(data[i:i + BLOCK_BYTES]) for i in range(0, len(data), BLOCK_BYTES)]


def segment_digests(segments: Sequence[memoryview], sizes: Sequence[int]) -> list[int]:
    """XXH3-64 of consecutive pieces of ``sizes`` bytes of the concatenated ``segments``."""
    out = []
    seg, pos = 0, 0
    for size in sizes:
        if seg < len(segments) and pos + size <= len(segments[seg]):  # within one segment: one call
            out.append(xxhash.xxh3_64_intdigest(segments[seg][pos:pos + size]))
            pos += size
        else:
            h = xxhash.xxh3_64()
            left = size
            while left:
                take = min(left, len(segments[seg]) - pos)
                h.update(segments[seg][pos:pos + take])
                left -= take
                pos += take
                if pos == len(segments[seg]):
                    seg, pos = seg + 1, 0
            out.append(h.intdigest())
        if seg < len(segments) and pos == len(segments[seg]):
            seg, pos = seg + 1, 0
    return out


_INDEX_HEAD = json.dumps({"version": 1, "algorithm": INDEX_ALGORITHM, "block_bytes": BLOCK_BYTES},
                         separators=(",", ":"))[:-1] + ',"items":['


def encode_index(items: Sequence[IndexedItem | str]) -> bytes:
    """The index and footer to append to a data file, from its items (or their :meth:`IndexedItem.to_json`)."""
    body = (_INDEX_HEAD + ",".join(i if isinstance(i, str) else i.to_json() for i in items) + "]}").encode()
    return body + _FOOTER.pack(len(body), xxhash.xxh3_64_intdigest(body), _MAGIC)


class BlockIndexError(ValueError):
    """A data file's block index is present but damaged."""


Pread = Callable[[int, int], bytes]
"""``read(nbytes, offset)``: positional reads of one data file (a local file's ``os.pread``, or a ranged GET)."""


def ends_with_index(fd: int | Pread, size: int) -> bool:
    """Whether the file open as ``fd`` (or read by ``fd(nbytes, offset)``; ``size`` bytes) ends with a block index
    footer (not checked further)."""
    read = _pread(fd)
    return size >= _FOOTER.size and read(_FOOTER.size, size - _FOOTER.size)[-len(_MAGIC):] == _MAGIC


def _pread(fd: int | Pread) -> Pread:
    return fd if callable(fd) else (lambda n, offset: os.pread(fd, n, offset))


def read_index(fd: int | Pread, size: int, verify: bool) -> dict[int, IndexedItem] | None:
    """The block index of the data file open as ``fd`` (or read by ``fd(nbytes, offset)``; ``size`` bytes), by item
    offset; ``None`` when the file has none (written by stock DCP or an earlier peftckpt). Raises
    :class:`BlockIndexError` for a damaged one."""
    if size < _FOOTER.size:
        return None
    read = _pread(fd)
    footer = read(_FOOTER.size, size - _FOOTER.size)
    if len(footer) != _FOOTER.size:
        raise BlockIndexError(f"{len(footer)} bytes of its footer read, {_FOOTER.size} expected")
    length, digest, magic = _FOOTER.unpack(footer)
    if magic != _MAGIC:
        return None
    if length > min(_INDEX_MAX_BYTES, size - _FOOTER.size):
        raise BlockIndexError(f"block index of {length} bytes in a file of {size}")
    body = read(length, size - _FOOTER.size - length)
    if verify and xxhash.xxh3_64_intdigest(body) != digest:
        raise BlockIndexError(f"{INDEX_ALGORITHM} checksum mismatch of its block index")
    try:
        doc = json.loads(body)
        if doc["version"] != 1 or doc["algorithm"] != INDEX_ALGORITHM or doc["block_bytes"] != BLOCK_BYTES:
            raise ValueError(f"unknown index version {doc['version']!r}")
        out = {}
        for offset, item_length, data_offset, data_length, hexes in doc["items"]:
            raw = bytes.fromhex(hexes)
            item = IndexedItem(int(offset), int(item_length), int(data_offset), int(data_length),
                               [int.from_bytes(raw[i:i + 8], "little") for i in range(0, len(raw), 8)])
            blocks = -(-item.data_length // BLOCK_BYTES)
            if not (0 <= item.offset <= item.data_offset and item.data_offset + item.data_length
                    <= item.offset + item.length <= size - _FOOTER.size - length and len(item.digests) == blocks + 2):
                raise ValueError(f"item at offset {item.offset} lies outside its file or has {len(item.digests)} "
                                 f"digests for {blocks} blocks")
            out[item.offset] = item
        return out
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise BlockIndexError(f"malformed block index: {e}") from None
