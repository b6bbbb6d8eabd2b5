"""An object on a store read by ranges: the bytes a rank needs, fetched ahead in few parallel ranged GETs.

:class:`ObjectSource` is the :class:`~peftckpt.checkpoint.storage.byte_sources.ByteSource` of a data file on an
object store. Steps of a load's reads from one object:

1. The tail (the block index and its footer) comes in one ranged GET of the last :data:`TAIL_BYTES` (a second
   GET only for a larger index), kept for the reads that follow -- unless the reader said beforehand that it
   reads up to the tail anyway (step 2 with ``tail``: a rank reading whole items, e.g. a resume at the same
   layout): then the tail is the end of the last part, which is fetched first (every read waits for the index),
   and the load makes one request fewer per object, the one that every other request waited for.
2. The reader tells the source every range it will read (:meth:`ObjectSource.expect`): they are merged where
   they lie at most :data:`GAP_BYTES` apart (the bytes wasted by a merge are bounded; a resume reads one run per
   file) and cut into parts of at most :data:`PART_BYTES`, each one ranged GET.
3. Parts are fetched on the shared pool ahead of the reader, at most :data:`AHEAD_BYTES` fetched and not yet
   consumed (a part the reader is waiting for is always fetched), so a rank holds a bounded window of the
   object, never the object. They come back in any order; :meth:`ObjectSource.when_ready` lets the reader read
   each range as soon as its parts are there.
4. Each read copies its bytes out of the parts into the destination (the one copy an HTTP body allows) and
   releases a part once every expected byte of it was read. A range outside the expected ones is fetched at
   once, in parts in parallel where it is larger than one.

Nothing here verifies: the reader checks every block it reads against the block index, and names the object
by its URL (:attr:`ObjectSource.name`).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import cast

from .byte_sources import merge_ranges
from .object_store import ObjectStore

__all__ = ["ObjectSource", "TAIL_BYTES", "GAP_BYTES", "PART_BYTES", "AHEAD_BYTES"]

TAIL_BYTES = 64 << 10
"""The most of an object's tail fetched for its block index (an index of ~800 adapter items fits); a small object's
tail is 1/64 of it, at least 4 KiB, so that the guess costs at most ~2% of what a rank reads."""
GAP_BYTES = 64 << 10
"""Expected ranges at most this far apart are fetched in one GET (the gap's bytes are the price of a request)."""
PART_BYTES = 16 << 20
"""The largest ranged GET: a large run is cut into parts fetched in parallel."""
AHEAD_BYTES = 256 << 20
"""Fetched or in flight and not yet read, per object: the window a rank holds."""


@dataclass
class _Part:
    start: int
    end: int
    left: int
    """Expected bytes inside the part not yet read; released at 0."""
    data: Future[bytes] | None = field(default=None, repr=False)
    sent: bool = False
    """Its GET was started (``data`` is then ``None`` again once the part is read: released)."""


class ObjectSource:
    """The object ``rel`` of ``store`` (``size`` bytes as listed), read by ranged GETs on ``pool`` (module
    docstring). :attr:`fetched` counts the bytes its GETs returned."""

    fetches_ahead = True

    def __init__(self, store: ObjectStore, rel: str, size: int, pool: ThreadPoolExecutor) -> None:
        self.name = store.url_of(rel)
        self.size = size
        self.fetched = 0
        self.requests = 0
        self.asked = 0
        """Bytes the reads asked for (what the load needs: every range once); :attr:`fetched` / ``asked`` is the
        price of merging ranges into few requests."""
        self._store = store
        self._key = store.key(rel)
        self._pool = pool
        self._lock = threading.Lock()
        self._tail: tuple[int, bytes] | None = None
        self._parts: list[_Part] = []
        self._starts: list[int] = []
        self._next = 0
        self._held = 0

    # ------------------------------------------------------------------------------------------ fetching
    def _get(self, start: int, end: int) -> bytes:
        """One ranged GET of ``[start, end)`` (fewer bytes at the object's end)."""
        end = min(end, self.size)
        if end <= start:
            return b""
        data: bytes = self._store.fs.cat_file(self._key, start=start, end=end)
        with self._lock:
            self.fetched += len(data)
            self.requests += 1
        return data

    def _get_now(self, start: int, end: int) -> list[tuple[int, bytes]]:
        """``[start, end)`` fetched at once, in parts of at most :data:`PART_BYTES` in parallel on the pool."""
        if end - start <= PART_BYTES:
            return [(start, self._get(start, end))]
        parts = [(s, self._pool.submit(self._get, s, e)) for s, e in merge_ranges([(start, end)], 0, PART_BYTES)]
        return [(s, f.result()) for s, f in parts]

    def expect(self, ranges: Sequence[tuple[int, int]], tail: bool = False) -> None:
        """Step 2: plan the parts covering ``ranges`` and start fetching the first of them. ``tail``: the block
        index will be read first; it joins the last part where the ranges end near it and all of them fit the
        window (else step 1 fetches it on its own)."""
        below = self.size if self._tail is None else self._tail[0]  # what the kept tail holds is not fetched again
        ranges = [(max(0, s), min(e, below)) for s, e in ranges]
        folded = False
        if tail and self._tail is None and ranges:
            last = max(e for _, e in ranges)
            wanted = sum(e - s for s, e in ranges)
            if 0 < self.size - last <= max(TAIL_BYTES, wanted // 50) and wanted + self.size - last <= AHEAD_BYTES:
                ranges.append((last, self.size))
                folded = True
        with self._lock:
            self._parts = [_Part(s, e, 0) for s, e in merge_ranges(ranges, GAP_BYTES, PART_BYTES)]
            self._starts = [p.start for p in self._parts]
            for start, end in ranges:
                i = max(0, bisect.bisect_right(self._starts, start) - 1)
                while i < len(self._parts) and self._parts[i].start < end:
                    p = self._parts[i]
                    p.left += max(0, min(end, p.end) - max(start, p.start))
                    i += 1
            self._next = self._held = 0
            if folded:  # the part holding the index first: every read waits for the index (all parts fit the window)
                self._submit(self._parts[-1])
            self._admit(-1)

    def _submit(self, p: _Part) -> None:
        """Start fetching the part ``p`` (under the lock)."""
        p.data, p.sent = self._pool.submit(self._get, p.start, p.end), True
        self._held += p.end - p.start

    def _admit(self, upto: int) -> None:
        """Step 3 (under the lock): submit the parts up to ``upto``, and more while the window has room."""
        while self._next < len(self._parts) and (
                self._next <= upto or self._parts[self._next].sent or
                self._held + self._parts[self._next].end - self._parts[self._next].start <= AHEAD_BYTES):
            p = self._parts[self._next]
            if not p.sent:  # (the index's part may have gone first)
                self._submit(p)
            self._next += 1

    def when_ready(self, start: int, end: int, then: Callable[[], None]) -> None:
        """Call ``then()`` once the parts covering ``[start, end)`` are fetched (on the thread that fetched the last
        of them), or at once where a part is not in flight yet (outside the window) or none covers the range: the
        read then waits, and fetches, itself. Parts arrive in any order; a reader told this reads them as they do."""
        tail = self._tail
        split = max(start, min(end, tail[0])) if tail is not None else end  # [split, end) lies in the kept tail
        covering = self._covering(start, split) if split > start else []
        with self._lock:
            futures = [self._parts[i].data for i in covering or ()]
        if not covering or any(f is None for f in futures):
            then()
            return
        left = [len(futures)]
        guard = threading.Lock()

        def arrived(_: object) -> None:
            with guard:
                left[0] -= 1
                last = left[0] == 0
            if last:
                then()

        for f in futures:
            cast("Future[bytes]", f).add_done_callback(arrived)

    # ------------------------------------------------------------------------------------------ reading
    def read(self, nbytes: int, offset: int) -> bytes:
        """Step 1 for reads near the end (the index); otherwise :meth:`read_into` a fresh buffer."""
        end = min(offset + nbytes, self.size)
        guess = max(min(TAIL_BYTES, self.size // 64), 4 << 10)
        if self._tail is None and end > self.size - guess and self._covering(offset, end) is None:
            start = min(offset, max(0, self.size - guess))
            self._tail = (start, self._get(start, self.size))
        kept = self._in_tail(offset, end)
        if kept is not None:
            with self._lock:
                self.asked += len(kept)
            return bytes(kept)
        buf = bytearray(max(0, end - offset))
        n = self.read_into([memoryview(buf)], offset)
        return bytes(buf[:n])

    def read_into(self, views: Sequence[memoryview], offset: int) -> int:
        """Step 4: fill ``views`` from the parts covering the range (and the kept tail), or with one GET where no
        part does."""
        views = [v for v in views if len(v)]
        end = min(offset + sum(len(v) for v in views), self.size)
        tail = self._tail
        split = max(offset, min(end, tail[0])) if tail is not None else end  # [split, end) lies in the tail
        pieces: list[tuple[int, bytes | memoryview]] = []
        covering = self._covering(offset, split) if split > offset else []
        futures: list[tuple[int, Future[bytes] | None]] = []
        if covering:
            with self._lock:
                self._admit(covering[-1])
                futures = [(self._parts[i].start, self._parts[i].data) for i in covering]
        if covering is None or any(f is None for _, f in futures):  # none expected, or released (read twice)
            pieces.extend(self._get_now(offset, split))
            covering = []
        else:
            pieces.extend((start, f.result()) for start, f in futures if f is not None)
        if tail is not None and split < end:
            pieces.append(tail)
        n = _scatter(views, offset, pieces, end)
        with self._lock:
            self.asked += n
            for i in covering:
                p = self._parts[i]
                p.left -= max(0, min(split, p.end) - max(offset, p.start))
                if p.left <= 0 and p.data is not None:
                    p.data = None  # read: released
                    self._held -= p.end - p.start
            self._admit(-1)
        return n

    def _in_tail(self, start: int, end: int) -> memoryview | None:
        """``[start, end)`` out of the kept tail, if it holds all of it."""
        tail = self._tail
        if tail is None or start < tail[0] or end > tail[0] + len(tail[1]):
            return None
        return memoryview(tail[1])[start - tail[0]:end - tail[0]]

    def _covering(self, start: int, end: int) -> list[int] | None:
        """The consecutive expected parts that hold all of ``[start, end)`` and are not yet released, or ``None``."""
        with self._lock:
            i = bisect.bisect_right(self._starts, start) - 1
            if i < 0 or end <= start:
                return None
            out = []
            at = start
            while i < len(self._parts) and at < end:
                p = self._parts[i]
                if p.start > at or p.end <= at or (p.data is None and p.sent):
                    return None
                out.append(i)
                at = p.end
                i += 1
            return out if at >= end else None

    def close(self) -> None:
        """Drop what is fetched and not read (a failed or partial load); the tail is kept for the next reads."""
        with self._lock:
            for p in self._parts:
                if p.data is not None:
                    p.data.cancel()
                    p.data = None
            self._parts, self._starts, self._next, self._held = [], [], 0, 0


def _scatter(views: Sequence[memoryview], offset: int, pieces: Sequence[tuple[int, bytes | memoryview]],
             end: int) -> int:
    """Copy the bytes of ``pieces`` (``(position, data)``, consecutive) that fall in ``[offset, end)`` into the
    consecutive ``views`` starting at ``offset``; returns the bytes copied (fewer where a piece came back short:
    the object ends early)."""
    total = 0
    vi, vpos = 0, 0
    at = offset
    for start, piece in pieces:
        if start > at:  # the piece before came back short
            break
        data = memoryview(piece)
        stop = min(start + len(data), end)
        while at < stop and vi < len(views):
            take = min(stop - at, len(views[vi]) - vpos)
            views[vi][vpos:vpos + take] = data[at - start:at - start + take]
            at += take
            vpos += take
            total += take
            if vpos == len(views[vi]):
                vi, vpos = vi + 1, 0
    return total
