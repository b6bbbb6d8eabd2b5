"""Memory a load is about to fill, backed by transparent huge pages where the kernel offers them.

A base load writes every byte of tensors allocated moments before (a model built on the meta device, then given
empty storage): each 4 KiB page is faulted in and zeroed by the kernel as the first read lands in it. On a 7B base
at TP=2 that is 1.6 M faults per rank, and on virtual machines, where the host backs guest memory lazily, first
touches ran at 1-2 GiB/s with 4 KiB pages against ~11 GiB/s with 2 MiB pages (``bench/RESULTS.md``): the faults,
not the disk, bounded the load. Linux's ``madvise(MADV_HUGEPAGE)`` asks for 2 MiB pages for a range; with
transparent huge pages in ``madvise`` mode (the default of many distributions) nothing else asks for them.

:func:`prefer_huge_pages` gives that advice for the aligned 2 MiB runs inside each tensor's storage before it is
read into. It is advice only: memory already touched keeps its pages, the values never change, and where the
kernel has no transparent huge pages (``never``, not Linux, another device) nothing happens. Every tensor is
written whole by the load, so no huge page holds memory a 4 KiB page would have spared.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable

import torch

__all__ = ["HUGE_PAGE", "prefer_huge_pages"]

HUGE_PAGE = 2 << 20
"""The transparent huge page size of x86-64 and most arm64 kernels."""
_MADV_HUGEPAGE = 14
"""Linux's ``MADV_HUGEPAGE`` (the same number on every architecture)."""
_madvise: object = None
"""libc's ``madvise`` (resolved on first use; ``False`` where there is none or the kernel refused it)."""


def _call() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    global _madvise
    if _madvise is None:
        try:
            if not sys.platform.startswith("linux"):
                raise AttributeError
            call = ctypes.CDLL(None, use_errno=True).madvise
            call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            call.restype = ctypes.c_int
            _madvise = call
        except (AttributeError, OSError):
            _madvise = False
    return _madvise or None  # type: ignore[return-value]


def prefer_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Advise huge pages for the 2 MiB-aligned runs of the CPU storages of ``tensors`` (each storage once);
    returns the bytes advised (0 where the kernel offers none). Call it before the memory is first written."""
    call = _call()
    if call is None:
        return 0
    seen: set[int] = set()
    advised = 0
    for tensor in tensors:
        if tensor.device.type != "cpu":
            continue
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if start in seen or storage.nbytes() < 2 * HUGE_PAGE:
            continue
        seen.add(start)
        first = -(-start // HUGE_PAGE) * HUGE_PAGE
        end = (start + storage.nbytes()) // HUGE_PAGE * HUGE_PAGE
        if end - first < HUGE_PAGE:
            continue
        if call(first, end - first, _MADV_HUGEPAGE) != 0:  # EINVAL: no transparent huge pages in this kernel
            global _madvise
            _madvise = False
            return advised
        advised += end - first
    return advised
