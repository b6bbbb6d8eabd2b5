"""Where a load's bytes come from: a data file read by ranges, on a local disk or as an object on a store.

The ranged DCP reader (:mod:`~peftckpt.checkpoint.storage.dcp_reader`) asks a :class:`ByteSource` for byte ranges
of one data file: first its tail (the block index, :mod:`~peftckpt.checkpoint.storage.framing`), then the ranges
of the items it needs. :class:`FileSource` answers with ``preadv`` straight into the destination's memory;
:class:`~peftckpt.checkpoint.storage.object_ranges.ObjectSource` with ranged GETs. A source is told the ranges it
will be asked for (:meth:`ByteSource.expect`) before the reads start, so a store can fetch them ahead, merged into
few requests; each read starts once its bytes are there (:func:`read_when_ready`), in whatever order they arrive.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, TypeVar

from .preads import read_exactly

__all__ = ["ByteSource", "FileSource", "merge_ranges", "read_when_ready"]

T = TypeVar("T")


class ByteSource(Protocol):
    """One data file, read by ranges."""

    name: str
    """The file as messages name it: its path, or its URL."""
    size: int
    """Its size in bytes."""
    fetches_ahead: bool
    """Whether it fetches expected ranges ahead, in parts that arrive in any order (:meth:`when_ready`)."""

    def read_into(self, views: Sequence[memoryview], offset: int) -> int:
        """Fill ``views`` with the bytes from ``offset`` on; returns the bytes read (fewer only at the end)."""
        ...

    def read(self, nbytes: int, offset: int) -> bytes:
        """``nbytes`` bytes from ``offset`` (fewer only at the end)."""
        ...

    def expect(self, ranges: Sequence[tuple[int, int]], tail: bool = False) -> None:
        """The ``[start, end)`` ranges about to be read, in the order they will be (a hint; reads outside
        them are still answered); ``tail``: the file's block index at its end will be read too, first."""
        ...

    def when_ready(self, start: int, end: int, then: Callable[[], None]) -> None:
        """Call ``then()`` once ``[start, end)`` can be read without waiting for the bytes fetched ahead (at once
        where nothing is fetched ahead), so that a reader reads what has arrived first."""
        ...

    def close(self) -> None: ...


class FileSource:
    """A local file: positional reads straight into the caller's memory (the GIL released while the kernel
    copies); nothing is fetched ahead (the page cache and the kernel's read-ahead do that)."""

    fetches_ahead = False

    def __init__(self, path: Path) -> None:
        self.name = str(path)
        self._fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size

    def read_into(self, views: Sequence[memoryview], offset: int) -> int:
        return read_exactly(self._fd, views, offset)

    def read(self, nbytes: int, offset: int) -> bytes:
        return os.pread(self._fd, nbytes, offset)

    def expect(self, ranges: Sequence[tuple[int, int]], tail: bool = False) -> None:
        pass

    def when_ready(self, start: int, end: int, then: Callable[[], None]) -> None:
        then()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:  # a source held by a long-lived reader is closed with it
        self.close()


def merge_ranges(ranges: Sequence[tuple[int, int]], gap: int, longest: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges sorted and merged where at most ``gap`` bytes apart, then cut into pieces of at most
    ``longest`` bytes: what to fetch, in as few requests as the budget of wasted bytes (the gaps) allows."""
    merged: list[list[int]] = []
    for start, end in sorted(r for r in ranges if r[1] > r[0]):
        if merged and start <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out: list[tuple[int, int]] = []
    for start, end in merged:
        pieces = -(-(end - start) // longest)
        step = -(-(end - start) // pieces)
        out.extend((s, min(s + step, end)) for s in range(start, end, step))
    return out


def read_when_ready(pool: ThreadPoolExecutor, source: ByteSource, span: tuple[int, int], read: Callable[..., T],
                    *args: Any) -> Future[T]:
    """``read(*args)`` on ``pool`` once ``source`` holds the bytes of ``span`` (:meth:`ByteSource.when_ready`; at
    once where it fetches nothing ahead): the future of its result."""
    if not source.fetches_ahead:
        return pool.submit(read, *args)
    out: Future[T] = Future()

    def done(job: Future[T]) -> None:
        error = job.exception()
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(job.result())

    def start() -> None:
        try:
            pool.submit(read, *args).add_done_callback(done)
        except RuntimeError as e:  # the pool is shut down: the load stopped on an error raised elsewhere
            out.set_exception(e)

    source.when_ready(span[0], span[1], start)
    return out
