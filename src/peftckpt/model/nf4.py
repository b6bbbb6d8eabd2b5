"""NF4: the 4-bit NormalFloat format of QLoRA for a frozen base's linear weights, defined on the global tensor.

A weight ``[out, in]`` is cut, row by row, into blocks of :data:`BLOCK` (64) consecutive elements. Each element is
stored as the index (4 bits, two per byte) of the nearest of the 16 NF4 values (the quantiles of a normal
distribution, scaled to ``[-1, 1]``, with an exact zero) to ``w / s``, where ``s`` is its block's absolute
maximum. The block maxima are double-quantized: the blocks of one row are split into the fewest groups of at
most :data:`GROUP_BLOCKS` (256) blocks, all of one size but the last, each group keeps one fp32 factor ``f = max / 255`` and each block an
8-bit code ``round(s / f)``. Dequantized, an element is ``NF4[code] * (scale code * f)``, computed in fp32.

Everything is defined on the global tensor and computed from exact operations (maxima, elementwise arithmetic):
a block never straddles two TP shards (a layout needs every shard's columns to be a multiple of 64), a group's
maximum over shards is an all-reduce of maxima, so the quantized and the dequantized base are bit-identical at
every layout. The format differs from bitsandbytes' in its second level (a per-group linear code of the block
maxima, where bitsandbytes quantizes their deviation from a tensor-wide mean): a tensor-wide mean would be a sum,
whose rounding depends on the order the shards add up in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["NF4_VALUES", "BLOCK", "GROUP_BLOCKS", "NF4Weight", "quantize", "empty_shard", "dequantize", "groups_of", "record",
           "stored_shapes", "shard_problem", "nf4_linear"]

NF4_VALUES = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
              0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
"""The 16 NF4 values (QLoRA, Dettmers et al. 2023), ascending; index 7 is the exact zero."""
BLOCK = 64
"""Elements per quantization block (along a row)."""
GROUP_BLOCKS = 256
"""At most this many blocks of a row share one double-quantization factor."""
SCALE_CODES = 255
"""Block maxima are coded as ``0..255`` times their group's factor."""

_VALUES = torch.tensor(NF4_VALUES, dtype=torch.float32)
_MIDPOINTS = (_VALUES[1:] + _VALUES[:-1]) / 2
_PAIRS = torch.stack([_VALUES.repeat(16), _VALUES.repeat_interleave(16)], dim=1)
"""The two values of each code byte: ``(NF4[byte & 15], NF4[byte >> 4])`` (the even column in the low nibble)."""


def record() -> dict[str, Any]:
    """What a checkpoint records of the format (a base quantized otherwise is another base)."""
    return {"method": "nf4", "block_size": BLOCK, "group_blocks": GROUP_BLOCKS, "scale_codes": SCALE_CODES}


def groups_of(columns: int) -> tuple[int, int]:
    """``(groups per row, blocks per group)`` of a weight with ``columns`` (global) columns."""
    blocks = columns // BLOCK
    groups = -(-blocks // GROUP_BLOCKS)
    return groups, -(-blocks // groups)


def stored_shapes(shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The global shapes of what a quantized weight of ``shape`` (``[out, in]``) is held as, by the suffix that
    replaces ``weight`` in its name (``weight_nf4``: codes, ``weight_scales``, ``weight_factors``)."""
    out, columns = shape
    return {"weight_nf4": (out, columns // 2), "weight_scales": (out, columns // BLOCK),
            "weight_factors": (out, groups_of(columns)[0])}


def shard_problem(columns: int, start: int, width: int) -> str | None:
    """Why a shard of columns ``[start, start + width)`` of a weight with ``columns`` columns cannot be quantized on
    its own rank (``None`` when it can): its blocks must be whole, and it either holds whole double-quantization
    groups or lies inside one (then the ranks that share the group hold the same factor)."""
    if columns % BLOCK or start % BLOCK or width % BLOCK:
        return (f"{columns} columns split at {start}..{start + width}: NF4 needs every shard's columns in whole "
                f"blocks of {BLOCK}")
    groups, per = groups_of(columns)
    first_block, end_block = start // BLOCK, (start + width) // BLOCK
    first, last = first_block // per, (end_block - 1) // per
    cut = first_block % per or (end_block % per and end_block != columns // BLOCK)
    if first != last and cut:  # touches several groups, one of them shared with another shard
        return (f"{columns} columns split at {start}..{start + width}: the shard cuts a double-quantization group "
                f"and holds others ({groups} groups of {per} blocks per row; this shard touches groups {first}..{last})")
    return None


@dataclass
class NF4Weight:
    """A shard of rows x columns of a quantized weight: ``codes`` uint8 ``[rows, cols / 2]`` (two 4-bit indices a
    byte, the even column in the low nibble), ``scales`` uint8 ``[rows, cols / 64]``, ``factors`` fp32 ``[rows,
    groups the shard touches]``; ``first_group`` is the row group of ``factors[:, 0]``, ``first_block`` the row
    block of ``scales[:, 0]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    factors: torch.Tensor
    first_block: int
    per_group: int

    @property
    def first_group(self) -> int:
        return self.first_block // self.per_group


def quantize(w: torch.Tensor, columns: int, start: int = 0,
             group_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> NF4Weight:
    """Quantize the shard ``w`` (``[rows, width]``, columns ``start..`` of a weight with ``columns`` columns).
    ``group_max`` reduces the per-group maxima over the ranks holding other columns of the same rows (an all-reduce
    of the maximum over TP for a row-parallel layer; nothing for whole rows). The shard must pass
    :func:`shard_problem`."""
    rows, width = w.shape
    problem = shard_problem(columns, start, width)
    if problem is not None:
        raise ValueError(problem)
    _, per = groups_of(columns)
    first_block = start // BLOCK
    blocks = width // BLOCK
    step = _rows_at_a_time(width)
    absmax = torch.empty(rows, blocks, device=w.device)
    for r in range(0, rows, step):  # a few rows at a time: the temporaries stay small whatever the weight
        absmax[r:r + step] = w[r:r + step].detach().float().reshape(-1, blocks, BLOCK).abs().amax(dim=-1)
    # group maxima over the row's groups this shard touches (a full group's maximum once reduced over TP)
    first = first_block // per
    local_groups = (first_block + blocks - 1) // per - first + 1
    index = ((torch.arange(blocks) + first_block) // per - first).to(absmax.device)
    gmax = torch.zeros(rows, local_groups, device=absmax.device).scatter_reduce(1, index.expand(rows, -1), absmax,
                                                                               "amax")
    if group_max is not None:
        gmax = group_max(gmax)
    factors = gmax / SCALE_CODES
    f = factors.gather(1, index.expand(rows, -1))
    scale_codes = torch.where(f > 0, torch.round(absmax / torch.where(f > 0, f, 1.0)), 0.0).clamp_(0, SCALE_CODES)
    scales = (scale_codes * f).unsqueeze(-1)
    midpoints = _MIDPOINTS.to(w.device)
    codes = torch.empty(rows, width // 2, dtype=torch.uint8, device=w.device)
    for r in range(0, rows, step):
        x = w[r:r + step].detach().float().reshape(-1, blocks, BLOCK)
        s = scales[r:r + step]
        normed = torch.where(s > 0, x / torch.where(s > 0, s, 1.0), 0.0).clamp_(-1.0, 1.0)
        idx = torch.bucketize(normed, midpoints).to(torch.uint8).reshape(-1, width)
        codes[r:r + step] = idx[:, 0::2] | (idx[:, 1::2] << 4)
    return NF4Weight(codes, scale_codes.to(torch.uint8), factors, first_block, per)


def empty_shard(rows: int, width: int, columns: int, start: int = 0,
                device: torch.device | str | None = None) -> NF4Weight:
    """An uninitialised quantized shard of the geometry :func:`quantize` gives ``w`` (``[rows, width]``, columns
    ``start..`` of ``columns``): what a load of a base stored in NF4 fills."""
    problem = shard_problem(columns, start, width)
    if problem is not None:
        raise ValueError(problem)
    _, per = groups_of(columns)
    first_block, blocks = start // BLOCK, width // BLOCK
    local_groups = (first_block + blocks - 1) // per - first_block // per + 1
    return NF4Weight(torch.empty(rows, width // 2, dtype=torch.uint8, device=device),
                     torch.empty(rows, blocks, dtype=torch.uint8, device=device),
                     torch.empty(rows, local_groups, dtype=torch.float32, device=device), first_block, per)


def _rows_at_a_time(width: int) -> int:
    """Rows quantized or dequantized at once: about 2**20 values (a few MB of temporaries)."""
    return max(1, (1 << 20) // width)


def dequantize(q: NF4Weight, dtype: torch.dtype = torch.bfloat16, rows: slice | None = None) -> torch.Tensor:
    """The shard's values (fp32 arithmetic, cast to ``dtype``); ``rows``: only those. Each code byte is looked up
    whole (its two values at once, an embedding of the 256 bytes), then scaled per block, a few rows at a time."""
    codes, scales, factors = q.codes, q.scales, q.factors
    if rows is not None:
        codes, scales, factors = codes[rows], scales[rows], factors[rows]
    n, half = codes.shape
    blocks = scales.shape[1]
    index = ((torch.arange(blocks) + q.first_block) // q.per_group - q.first_group).to(codes.device)
    pairs = _PAIRS.to(codes.device)
    out = torch.empty(n, 2 * half, dtype=dtype, device=codes.device)
    step = _rows_at_a_time(2 * half)
    for r in range(0, n, step):
        s = scales[r:r + step].float() * factors[r:r + step].gather(1, index.expand(min(step, n - r), -1))
        values = F.embedding(codes[r:r + step].int(), pairs).reshape(-1, blocks, BLOCK)
        out[r:r + step] = (values * s.unsqueeze(-1)).reshape(-1, 2 * half)
    return out


_BACKWARD_ROWS = 1024
"""Rows of a quantized weight dequantized at a time by the backward of :func:`nf4_linear`."""


class _NF4Linear(torch.autograd.Function):
    """``x @ W.T`` through a frozen NF4 weight: dequantized for the product and dropped, never saved for the
    backward, which dequantizes it again a block of rows at a time (a whole layer's weight is never held in the
    compute dtype between forward and backward, as QLoRA does). No gradient for the weight: it is frozen."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, factors: torch.Tensor,
                layout: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        ctx.q = NF4Weight(codes, scales, factors, *layout)  # frozen tensors: held, not saved for autograd
        ctx.dtype = dtype
        return F.linear(x.to(dtype), dequantize(ctx.q, dtype))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q: NF4Weight = ctx.q
        g = grads[0]
        flat = g.reshape(-1, g.shape[-1]).float()
        rows, columns = q.codes.shape[0], 2 * q.codes.shape[1]
        out = torch.zeros(flat.shape[0], columns, dtype=torch.float32, device=g.device)
        for start in range(0, rows, _BACKWARD_ROWS):
            stop = min(rows, start + _BACKWARD_ROWS)
            # the forward's values (rounded to its dtype), in fp32 for the product
            out.addmm_(flat[:, start:stop], dequantize(q, ctx.dtype, rows=slice(start, stop)).float())
        return out.reshape(*g.shape[:-1], columns).to(g.dtype), None, None, None, None, None


def nf4_linear(x: torch.Tensor, q: NF4Weight, dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, dequantize(q, dtype))`` in ``dtype``, differentiable in ``x`` (see :class:`_NF4Linear`)."""
    return _NF4Linear.apply(x, q.codes, q.scales, q.factors, (q.first_block, q.per_group), dtype)  # type: ignore[no-any-return]
