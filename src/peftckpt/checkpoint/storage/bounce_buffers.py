"""A few reused buffers for reads that cannot land in their destination (a column split, a dtype change).

The ranged DCP reader runs such reads on its read threads, each holding one buffer while it reads a run of rows
into it, verifies it and copies the region out: reads, verification and copies of several runs overlap, and a
load holds at most ``count`` buffers, however large the model. Buffers are allocated on first use and reused.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator

import torch

__all__ = ["BounceBuffers"]


class BounceBuffers:
    """``count`` byte buffers of ``nbytes`` each; :meth:`take` lends one (waiting while all are lent)."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self._count = count
        self._made = 0
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, nbytes: int) -> Iterator[torch.Tensor]:
        """The first ``nbytes`` of a free buffer, returned when the block ends (a larger request -- a single row
        longer than a buffer -- gets fresh memory of its own)."""
        if nbytes > self.nbytes:
            yield torch.empty(nbytes, dtype=torch.uint8)
            return
        with self._lock:
            make = self._made < self._count and self._free.empty()
            self._made += make
        buffer = torch.empty(self.nbytes, dtype=torch.uint8) if make else self._free.get()
        try:
            yield buffer[:nbytes]
        finally:
            self._free.put(buffer)
