"""Read-ahead for DCP loads: the disk streams while the reader deserialises.

DCP's ``FileSystemReader`` reads one item at a time: a ``torch.load`` of its byte range (in chunks of a few
hundred KiB), then a copy into the model. From a cold page cache that alternates disk waits with CPU work.
:class:`ReadAhead` reads the same byte ranges, in the order the reader will ask for them, in large blocks
on a thread of its own -- so the reader mostly copies from the page cache -- and stays at most ``window``
bytes ahead of what the reader has consumed, so it never pushes pages out before they are used.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["ReadAhead"]

BLOCK_BYTES = 16 * 1024 * 1024
WINDOW_BYTES = 512 * 1024 * 1024


class ReadAhead:
    """Reads ``schedule`` -- ``(file, offset, length)`` in the reader's order -- ahead of the reader.

    The reader reports each item it took with :meth:`consumed`. Used as a context manager; reads fail
    silently (the reader itself reports a missing or short file).
    """

    def __init__(self, schedule: Sequence[tuple[Path, int, int]], window: int = WINDOW_BYTES,
                 block: int = BLOCK_BYTES):
        self._runs = _merge(schedule)
        self._window = window
        self._block = block
        self._cond = threading.Condition()
        self._read = 0
        self._consumed = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="peftckpt-readahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        if self._runs:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def consumed(self, nbytes: int) -> None:
        with self._cond:
            self._consumed += nbytes
            self._cond.notify()

    def _run(self) -> None:
        buf = bytearray(self._block)
        view = memoryview(buf)
        fds: dict[Path, int] = {}
        try:
            for path, offset, length in self._runs:
                if path not in fds:
                    fds[path] = os.open(path, os.O_RDONLY)
                pos, end = offset, offset + length
                while pos < end:
                    with self._cond:
                        while not self._stop and self._read - self._consumed >= self._window:
                            self._cond.wait()
                        if self._stop:
                            return
                    n = os.preadv(fds[path], [view[:min(self._block, end - pos)]], pos)  # into the page cache
                    if n <= 0:
                        break
                    pos += n
                    with self._cond:
                        self._read += n
        except OSError:
            return
        finally:
            for fd in fds.values():
                os.close(fd)


def _merge(schedule: Sequence[tuple[Path, int, int]]) -> list[tuple[Path, int, int]]:
    """Adjacent or overlapping ranges of one file, consecutive in the schedule, as one run."""
    runs: list[tuple[Path, int, int]] = []
    for path, offset, length in schedule:
        if runs and runs[-1][0] == path and runs[-1][1] <= offset <= runs[-1][1] + runs[-1][2]:
            last_path, last_offset, last_length = runs[-1]
            runs[-1] = (last_path, last_offset, max(last_length, offset + length - last_offset))
        else:
            runs.append((path, offset, length))
    return runs
