"""The per-tensor sums each fingerprint version defines (see :mod:`~peftckpt.checkpoint.state.fingerprint`
for how pieces become runs and sums become a fingerprint). Their values are fixed forever: a checkpoint
records a fingerprint made of them.

Version 4 (the default; ``v4:sha256:<hex>``) reads each element as bytes -- floats of up to 32 bits: the
four bytes of their float32 bits, so a bf16 value held in bf16 or in fp32 has the same bytes (a bf16
tensor's own two bytes are the float32 bits' upper two, the lower two are zero and add nothing); other
dtypes: the eight bytes of their int64 bits -- as signed 8-bit values. The global flat index is cut into
chunks of 64 elements; a chunk's sum is ``c = sum(byte * W[position of the byte in the chunk])`` with fixed
nonzero 8-bit weights ``W`` (the 128 weights of a bf16 chunk are all different, so swapping two bytes of a
chunk changes ``c``), and the tensor's sums are ``sum(c)`` and ``sum(chunk index * c)`` mod 2**64. Chunk
sums are int8 products accumulated exactly in int32, read straight from the tensor's memory by one of two
kernels that give the same sums, chosen by the CPU: one ``torch._int_mm`` matrix product per run of whole
chunks (~20 GB/s of bf16 on two cores with int8 dot-product instructions, ~1.5 GB/s with AVX2 alone), or
the bytes widened to int32 tile by tile (~2-4 GB/s with AVX2). Partial chunks at the edges
of a piece are summed with the slice of ``W`` they cover, so any sharding gives the same sums.

Version 3 (``v3:sha256:<hex>``) split each element into 16-bit limbs (floats of up to 32 bits: the two
halves of their float32 bits; other dtypes: the four limbs of their int64 bits) and took, per limb,
``sum(v)``, ``sum(i * v)`` and ``sum(v * R[i % 256])`` for a fixed table ``R``, as float64 matrix products
per tile of runs contiguous in the global flat index (~0.5 G elements/s on one core).

Version 2 (``v2:sha256:<hex>``) summed ``bits(x_i) * w(i)`` with a hashed weight ``w`` per element and
version 1 (``sha256:<hex>``) did the same on the raw bits and recorded the dtype; versions 1-3 are still
computed to check checkpoints that recorded them (their values must never change).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import numpy as np
import torch

__all__ = ["U64", "WIDTH", "INT8_DOT_FLAGS", "chunk_kernel", "cpu_flags", "segment_sums"]

U64 = 0xFFFFFFFFFFFFFFFF
"""Sums are taken modulo 2**64."""

# Versions 1 and 2: w(i) = (i * _MULT + _ADD) & _MASK, one sum per tensor.
_MULT = 2654435761
_ADD = 97531
_MASK = 0x7FFFFFFF
_TILE = 1 << 16
"""Elements per tile: the three int64 temporaries of a tile (1.5 MiB) stay in a core's L2 cache."""
_INT_TYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# Version 3: per 16-bit limb v, sum(v), sum(i * v), sum(v * _R[i % _PERIOD]).
_PERIOD = 256
"""Divides the row length of every common model dimension (4096, 11008, 14336, ...), so the rows of a shard
share one phase and one weight matrix."""
_R = [1 + ((k * 2654435761 + 40503) * 2246822519 >> 13) % 65535 for k in range(_PERIOD)]
"""Fixed forever (a checkpoint's fingerprint depends on it): 16-bit weights, none zero."""
_TILE_V3 = 1 << 18
"""Elements converted to float64 at a time (2 MiB)."""
_LIMBS_V3 = 4

# Version 4: per chunk of _CHUNK elements, c = sum(byte * W[byte position]); sums sum(c), sum(chunk * c).
_CHUNK = 64
"""Elements per chunk: divides the row length of every common model dimension and its TP shards."""
_NONZERO = sorted((v for v in range(-128, 128) if v), key=lambda v: ((v + 128) * 2654435761 + 40503) % (1 << 32))
"""The 255 nonzero 8-bit values in a fixed order (fixed forever: a checkpoint's fingerprint depends on it)."""
_W_FLOAT = [_NONZERO[128 + (t * 2 + k) % 127] if k < 2 else _NONZERO[t * 2 + k - 2]
            for t in range(_CHUNK) for k in range(4)]
"""Weight of byte ``k`` of element ``t`` of a chunk of float32 bits at ``4 t + k`` (little-endian: bytes 2 and
3 are the upper half, a bf16's own bytes; their 128 weights are all different)."""
_W_INT = [_NONZERO[(j * 7) % 255] for j in range(8 * _CHUNK)]
"""Weight of byte ``k`` of element ``t`` of a chunk of int64 bits at ``8 t + k``."""
WIDTH = {1: 1, 2: 1, 3: 3 * _LIMBS_V3, 4: 2}
"""Sums per tensor, by version."""


# ------------------------------------------------------------------------------------- versions 1, 2
def _bits(rows: torch.Tensor, version: int) -> np.ndarray:
    """The signed-int bits of ``rows`` (version 2: narrow floats as their exact float32 value first)."""
    if version >= 2 and rows.is_floating_point() and rows.element_size() < 4:
        rows = rows.float()
    return rows.view(_INT_TYPES[rows.element_size()]).numpy()


def _segment_sum_v2(rows: torch.Tensor, starts: np.ndarray, version: int) -> list[int]:
    """``sum(bits[r, j] * w(starts[r] + j))`` mod 2**64, tile by tile in uint64 (whose wrap-around is
    defined; it keeps the low 31 bits that ``w`` needs exact, and the sign-extended bits' products mod 2**64)."""
    bits = _bits(rows, version)
    nrows, run = bits.shape
    tile = min(_TILE, run)
    cols = (np.arange(tile, dtype=np.uint64) * np.uint64(_MULT)) & np.uint64(_MASK)  # reused by every tile
    mask = np.uint64(_MASK)
    x = np.empty(_TILE, dtype=np.uint64)
    w = np.empty(_TILE, dtype=np.uint64)
    heads = (starts.astype(np.uint64) * np.uint64(_MULT) + np.uint64(_ADD)) & mask
    total = 0
    if run >= _TILE:  # long runs: column tiles of one row
        for r in range(nrows):
            head = int(heads[r])
            for j in range(0, run, tile):
                n = min(tile, run - j)
                np.add(cols[:n], np.uint64((head + j * _MULT) & _MASK), out=w[:n])
                np.bitwise_and(w[:n], mask, out=w[:n])
                np.copyto(x[:n], bits[r, j:j + n], casting="unsafe")
                total += int(np.dot(x[:n], w[:n]))
    else:  # short runs: several whole rows per tile
        per = _TILE // run
        for r in range(0, nrows, per):
            m = min(per, nrows - r)
            wt = w[:m * run].reshape(m, run)
            np.add(heads[r:r + m, None], cols[None, :run], out=wt)
            np.bitwise_and(wt, mask, out=wt)
            np.copyto(x[:m * run].reshape(m, run), bits[r:r + m], casting="unsafe")
            total += int(np.dot(x[:m * run], w[:m * run]))
    return [total & U64]


# ------------------------------------------------------------------------------------------ version 3
def _limbs(tile: torch.Tensor) -> list[torch.Tensor]:
    """The 16-bit limbs of ``tile``'s elements, most significant first (a bf16 tile: only its first; the
    second, all zeros, adds nothing)."""
    if tile.dtype == torch.bfloat16:  # the high half of its float32 bits, exactly
        return [tile.view(torch.int16)]
    if tile.is_floating_point() and tile.element_size() <= 4:
        bits = tile.float().view(torch.int32)
        return [bits >> 16, bits & 0xFFFF]
    bits = tile.view(torch.int64) if tile.is_floating_point() else tile.to(torch.int64)
    return [bits >> 48, (bits >> 32) & 0xFFFF, (bits >> 16) & 0xFFFF, bits & 0xFFFF]


def _weights(phase: int, n: int) -> torch.Tensor:
    """The ``(3, n)`` float64 weights of a run of ``n`` elements starting at a phase ``phase`` of ``_R``:
    ``1``, the position in the run, and ``_R[(phase + t) % _PERIOD]``."""
    periodic = torch.tensor(_R, dtype=torch.float64).roll(-phase).repeat(n // _PERIOD + 1)[:n]
    return torch.stack([torch.ones(n, dtype=torch.float64), torch.arange(n, dtype=torch.float64), periodic])


def _segment_sum_v3(rows: torch.Tensor, starts: np.ndarray) -> list[int]:
    """Per limb: ``sum(v)``, ``sum(i * v)`` and ``sum(v * R[i % P])`` mod 2**64 over the runs ``rows``
    starting at global flat indices ``starts`` (at most ``fingerprint._RUN`` long). Rows of a tile that start at
    different phases of ``R`` (a row length ``P`` does not divide) are summed in groups, one per phase."""
    sums = [0] * WIDTH[3]
    run = rows.shape[1]
    per = max(1, _TILE_V3 // run)
    weights: dict[int, torch.Tensor] = {}
    buffer = torch.empty(per * run, dtype=torch.float64)
    phases = starts % _PERIOD
    for r in range(0, rows.shape[0], per):
        tile_phases = phases[r:r + per]
        groups = [(int(tile_phases[0]), slice(None))] if (tile_phases == tile_phases[0]).all() else \
            [(int(p), tile_phases == p) for p in np.unique(tile_phases)]
        for phase, which in groups:
            tile = rows[r:r + per] if isinstance(which, slice) else rows[r:r + per][torch.from_numpy(which)]
            tile_starts = starts[r:r + per][which].astype(np.uint64)
            w = weights.get(phase)
            if w is None:
                w = weights[phase] = _weights(phase, run)
            for k, limb in enumerate(_limbs(tile)):
                values = buffer[:limb.numel()].view(limb.shape)
                values.copy_(limb)
                # (3, m): each entry a sum of at most _RUN products below 2**32, exact in float64
                # (uint64 arrays wrap around silently, as the sums mod 2**64 need)
                total, positional, periodic = (w @ values.t()).to(torch.int64).numpy().view(np.uint64)
                sums[3 * k] += int(total.sum(dtype=np.uint64))
                sums[3 * k + 1] += int((tile_starts * total).sum(dtype=np.uint64)) + int(positional.sum(dtype=np.uint64))
                sums[3 * k + 2] += int(periodic.sum(dtype=np.uint64))
    return [x & U64 for x in sums]


# ------------------------------------------------------------------------------------------ version 4
def _bytes_v4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` (2-D, contiguous rows) as an int8 matrix of the bytes version 4 sums, ``w`` bytes per element,
    and the ``(_CHUNK * w,)`` int8 weights of a whole chunk."""
    if rows.dtype == torch.bfloat16:
        weights = torch.tensor(_W_FLOAT, dtype=torch.int8).view(_CHUNK, 4)[:, 2:].reshape(-1)
        return _little_endian(rows.contiguous(), torch.int16).view(torch.int8), weights
    if rows.is_floating_point() and rows.element_size() <= 4:
        return _little_endian(rows.float().contiguous(), torch.int32).view(torch.int8), \
            torch.tensor(_W_FLOAT, dtype=torch.int8)
    bits = rows.contiguous().view(torch.int64) if rows.dtype == torch.float64 else rows.to(torch.int64)
    return _little_endian(bits.contiguous(), torch.int64).view(torch.int8), torch.tensor(_W_INT, dtype=torch.int8)


def _little_endian(rows: torch.Tensor, same_size: torch.dtype) -> torch.Tensor:
    """``rows`` with its bytes in little-endian order (as they are on every platform torch ships for)."""
    if sys.byteorder == "little":
        return rows
    return torch.from_numpy(rows.view(same_size).numpy().byteswap())


def _int_mm_sums(chunks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The chunk sums as one ``torch._int_mm`` product (int8 x int8 accumulated in int32): fastest where the
    CPU has int8 dot-product instructions (e.g. AVX512-VNNI), ~1-1.5 GB/s with AVX2 alone."""
    rows, count, k = chunks.shape
    return torch._int_mm(chunks.reshape(-1, k).contiguous(), weights.view(-1, 1)).view(rows, count)


def _widened_sums(chunks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The chunk sums tile by tile: the bytes widened to int32, multiplied by the weights in place and each
    chunk's products summed (vectorised elementwise ops, none converting a dtype inside a reduction, which torch
    runs ~20x slower: ~2.5x ``torch._int_mm`` where the CPU lacks int8 dot products). Reads ``chunks`` through
    its strides."""
    rows, count, k = chunks.shape
    out = torch.empty(rows, count, dtype=torch.int32)
    per_row = min(count, max(1, _TILE_BYTES // k))
    rows_per = max(1, _TILE_BYTES // k // per_row)
    products = _products(rows_per * per_row * k)
    wide = weights.to(torch.int32)
    for r in range(0, rows, rows_per):
        for c in range(0, count, per_row):
            tile = chunks[r:r + rows_per, c:c + per_row]
            held = products[:tile.numel()].view(tile.shape)
            held.copy_(tile)
            held.mul_(wide)
            torch.sum(held, 2, out=out[r:r + rows_per, c:c + per_row])
    return out


def _products(n: int) -> torch.Tensor:
    """This thread's int32 buffer of at least ``n`` elements, kept between calls (a fresh one per call would be
    paid again in page faults)."""
    held = getattr(_LOCAL, "products", None)
    if held is None or held.numel() < n:
        held = _LOCAL.products = torch.empty(n, dtype=torch.int32)
    return held


_LOCAL = threading.local()
_TILE_BYTES = 1 << 20
"""Bytes widened at a time (4 MiB of int32 products per thread): 512 KiB and 256 KiB measured ~15 % and ~40 %
slower (per-op costs)."""
_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {"widened": _widened_sums}
if hasattr(torch, "_int_mm"):
    _KERNELS["int_mm"] = _int_mm_sums
INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
"""CPU flags (``/proc/cpuinfo``) of int8 dot-product instructions, on which ``torch._int_mm`` is the faster."""
_KERNEL: list[str | None] = [None]
"""The kernel this process uses (both give the same, exact, sums), chosen on first use."""


def chunk_kernel() -> str:
    """The name of the kernel version 4 sums chunks with in this process: ``int_mm`` where the CPU has int8
    dot-product instructions (~15 GB/s of bf16 measured on two cores of a VM that likely had them, several times
    what the widened sums reach on AVX2), else ``widened`` (~2.5x ``int_mm`` with AVX2 alone). Chosen from the
    CPU's flags, not timed: the same on every run of a machine."""
    chosen = _KERNEL[0]
    if chosen is None:
        chosen = _KERNEL[0] = "int_mm" if "int_mm" in _KERNELS and cpu_flags() & INT8_DOT_FLAGS else "widened"
    return chosen


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where ``/proc/cpuinfo`` has none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _chunk_sums(chunks: torch.Tensor, weights: torch.Tensor) -> np.ndarray:
    """The ``(rows, count)`` sums ``chunks @ weights`` of an int8 ``(rows, count, k)`` view (its last dim
    contiguous) and ``(k,)`` weights, exact, as int64: int8 products accumulated in int32 (at most
    ``512 * 2**14 < 2**31``)."""
    if chunks.numel() == 0:
        return np.zeros(chunks.shape[:2], dtype=np.int64)
    name = chunk_kernel()
    try:
        sums = _KERNELS[name](chunks, weights)
    except (RuntimeError, NotImplementedError):  # int_mm refused a shape: the widened sums from now on
        _KERNEL[0] = "widened"
        sums = _widened_sums(chunks, weights)
    return sums.numpy().astype(np.int64)


def _counting(n: int) -> np.ndarray:
    """``0, 1, ..., n - 1`` as int64 (one array, grown as needed and shared)."""
    if _COUNTING[0].size < n:
        _COUNTING[0] = np.arange(max(n, 2 * _COUNTING[0].size), dtype=np.int64)
    return _COUNTING[0][:n]


_COUNTING = [np.arange(1 << 17, dtype=np.int64)]


def _segment_sum_v4(rows: torch.Tensor, starts: np.ndarray) -> list[int]:
    """``sum(c)`` and ``sum(chunk index * c)`` mod 2**64 over the runs ``rows`` starting at the global flat
    indices ``starts``. Rows are grouped by where they start within a chunk (their phase); each row is a head
    (the rest of a chunk it starts inside), whole chunks, and a tail (the start of a chunk it ends inside)."""
    data, weights = _bytes_v4(rows)
    width = weights.numel() // _CHUNK
    run = rows.shape[1]
    total = positional = 0
    phases = starts % _CHUNK
    for phase in np.unique(phases):
        which = phases == phase
        part = data if which.all() else data[torch.from_numpy(which)]
        first = starts[which] // _CHUNK  # the chunk each row starts in
        head = min((_CHUNK - int(phase)) % _CHUNK, run)
        whole = (run - head) // _CHUNK
        pieces = [(0, head, int(phase), first)]  # (first element, elements, position in chunk, chunk indices)
        if whole:
            pieces.append((head, whole * _CHUNK, 0, first + (head > 0)))
        tail = run - head - whole * _CHUNK
        if tail:
            pieces.append((head + whole * _CHUNK, tail, 0, first + (head > 0) + whole))
        for begin, count, position, chunk in pieces:
            if not count:
                continue
            block = part[:, begin * width:(begin + count) * width]
            if count >= _CHUNK:  # whole chunks: their sums; sum(index * c) row by row and column by column
                sums = _chunk_sums(block.view(len(chunk), -1, _CHUNK * width), weights)
                per_row = sums.sum(axis=1)
                per_column = sums.sum(axis=0) if len(chunk) > 1 else sums[0]
                positional += int(np.dot(per_column, _counting(per_column.size)))  # below 2**57: exact
            else:  # part of one chunk per row
                per_row = _chunk_sums(block.unsqueeze(1), weights[position * width:(position + count) * width])[:, 0]
            total += int(per_row.sum())
            # uint64 products wrap around: the sum mod 2**64
            positional += int((per_row.view(np.uint64) * chunk.view(np.uint64)).sum(dtype=np.uint64))
    return [total & U64, positional & U64]


# ------------------------------------------------------------------------------------------- dispatch
def segment_sums(rows: torch.Tensor, starts: np.ndarray, version: int) -> list[int]:
    """The sums ``version`` defines over the runs ``rows`` starting at the global flat indices ``starts``."""
    if version == 4:
        return _segment_sum_v4(rows, starts)
    return _segment_sum_v3(rows, starts) if version == 3 else _segment_sum_v2(rows, starts, version)

