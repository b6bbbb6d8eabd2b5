"""An object on a store written as a stream: a rank's data file goes to the store as it is written, no local copy.

:class:`ObjectWriter` is the raw stream a save's data file is written through when its location is an object store
(:class:`~peftckpt.checkpoint.storage.checksums.ChecksummingFileSystem` hashes every byte on its way in). Steps of
one object:

1. Written bytes are copied into a part buffer of :data:`PART_BYTES` (the one copy: a tensor's memory may change
   once the write returns).
2. A full part is uploaded on the pool while the next one fills -- the first full part begins a multipart upload
   -- with at most :data:`PARTS_IN_FLIGHT` parts held: a writer that outruns the store waits for a part's slot,
   so a rank holds at most ``(PARTS_IN_FLIGHT + 1) * PART_BYTES`` whatever it writes. Part buffers are reused.
3. :meth:`ObjectWriter.close` uploads the last part and completes the upload: the object appears whole, at once.
   An object smaller than one part is one PUT. Every :data:`PARTS_BEFORE_GROWING` parts the part size doubles,
   so that S3's 10,000 parts hold any rank's file (2,000 parts each of 16, 32, 64, 128 and 256 MiB: 968 GiB).
4. :meth:`ObjectWriter.abort` (any failure of a write, of a part, of the completion) abandons the upload: its parts
   are deleted and nothing appears; so is a writer dropped unclosed. A process killed mid-upload leaves an
   unfinished upload that no reader ever sees; the next run's first save aborts it
   (:mod:`~peftckpt.checkpoint.location.store_writes`).

A failure of the store is raised as one :class:`~peftckpt.checkpoint.errors.CheckpointError` naming the object's URL.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointError
from .object_store import ObjectStore, store_error

__all__ = ["ObjectWriter", "PART_BYTES", "PARTS_IN_FLIGHT", "PARTS_BEFORE_GROWING", "upload_pool"]

PART_BYTES = 16 << 20
"""The size of every part but the last (S3's smallest part is 5 MiB)."""
PARTS_IN_FLIGHT = 4
"""Parts uploading at once, per object being written: a rank holds at most one more part buffer than this."""
PARTS_BEFORE_GROWING = 2000
"""Parts of one size before the part size doubles (five sizes fill S3's 10,000 parts)."""

_POOL: ThreadPoolExecutor | None = None
_POOL_GUARD = threading.Lock()


def upload_pool() -> ThreadPoolExecutor:
    """The pool every part upload of this process runs on, made once (a save writes one object at a time)."""
    global _POOL
    with _POOL_GUARD:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=PARTS_IN_FLIGHT, thread_name_prefix="peftckpt-put")
        return _POOL


class ObjectWriter(io.RawIOBase):
    """The object ``rel`` of ``store``, written as a stream (module docstring). ``on_done`` is called once the
    object is complete, ``on_abandoned`` if an abort could not abort its upload. A failure of the store is raised
    as one :class:`~peftckpt.checkpoint.errors.CheckpointError` naming the object's URL. :attr:`written` counts
    the bytes written, :attr:`requests` the PUTs and POSTs made."""

    def __init__(self, store: ObjectStore, rel: str, pool: ThreadPoolExecutor | None = None,
                 part_bytes: int | None = None, on_done: Callable[[], None] | None = None,
                 on_abandoned: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.name = store.url_of(rel)
        self.written = 0
        self.requests = 0
        self._store = store
        self._rel = rel
        self._pool = pool or upload_pool()
        part_bytes = part_bytes or PART_BYTES
        self._on_done = on_done
        self._on_abandoned = on_abandoned
        self._buf = bytearray(part_bytes)
        self._filled = 0
        self._free: list[bytearray] = []
        self._upload_id: str | None = None
        self._parts: list[Future[str]] = []
        self._slots = threading.BoundedSemaphore(PARTS_IN_FLIGHT)
        self._lock = threading.Lock()
        self._aborted = False

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:  # 1.
        if self._aborted:
            raise ValueError(f"{self.name}: write to an abandoned upload")
        view = memoryview(b).cast("B")
        at = 0
        with self._failing():
            while at < len(view):
                n = min(len(view) - at, len(self._buf) - self._filled)
                self._buf[self._filled:self._filled + n] = view[at:at + n]
                self._filled += n
                at += n
                if self._filled == len(self._buf):
                    self._send_part()
        self.written += len(view)
        return len(view)

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - the store's failure, named once
            raise store_error(e, self.name, "the upload") from None

    def _send_part(self, last: bool = False) -> None:  # 2.
        """Upload the filled part buffer on the pool (starting the upload first); unless ``last``, go on in a
        free buffer (a part's is freed once it is sent)."""
        if self._upload_id is None:
            self._upload_id = self._store.start_upload(self._rel)
            self.requests += 1
        failed = next((f for f in self._parts if f.done() and f.exception() is not None), None)
        if failed is not None:
            failed.result()  # a part's failure, raised here, in the writing thread
        self._slots.acquire()  # at most PARTS_IN_FLIGHT parts held (a slot is released when a part is sent)
        data, number = self._buf, len(self._parts) + 1
        self._parts.append(self._pool.submit(_upload_part, self._store, self._rel, self._upload_id, number, data,
                                             self._filled, self._free, self._lock, self._slots))
        self.requests += 1
        self._buf, self._filled = bytearray(), 0
        if last:
            return
        size = len(data) * 2 if len(self._parts) % PARTS_BEFORE_GROWING == 0 else len(data)
        with self._lock:
            free = self._free.pop() if self._free else None
        self._buf = free if free is not None and len(free) == size else bytearray(size)

    def close(self) -> None:  # 3.
        if self.closed:
            return
        try:
            if not self._aborted:
                with self._failing():
                    self._complete()
        except BaseException:
            self.abort()
            raise
        finally:
            super().close()
        if self._on_done is not None and not self._aborted:
            self._on_done()

    def _complete(self) -> None:
        if self._upload_id is None:  # smaller than a part: one PUT
            self._store.write_bytes(self._rel, memoryview(self._buf)[:self._filled].tobytes())
            self.requests += 1
        else:
            if self._filled:
                self._send_part(last=True)
            etags = [f.result() for f in self._parts]
            self._store.finish_upload(self._rel, self._upload_id, etags)
            self.requests += 1
            self._upload_id = None  # complete: nothing left to abort
        self._buf = bytearray()
        self._free.clear()

    def __del__(self) -> None:
        """A writer dropped unclosed is abandoned, never completed (``IOBase`` would close it: an object cut short
        would appear whole)."""
        if not self.closed:
            with contextlib.suppress(Exception):
                self.abort()
        super().__del__()

    def abort(self) -> None:  # 4.
        """Abandon the object: wait for the parts in flight, then abort the upload (best effort: a store that
        cannot be reached leaves an unfinished upload, which no reader sees and the next save's clean aborts)."""
        if self._aborted:
            return
        self._aborted = True
        for f in self._parts:
            f.exception()  # waited for, whatever its outcome
        if self._upload_id is not None:
            try:
                self._store.abort_upload(self._rel, self._upload_id)
            except Exception:  # noqa: BLE001 - the failure being raised is the one to report
                if self._on_abandoned is not None:
                    self._on_abandoned()
        self._buf = bytearray()
        self._free.clear()


def _upload_part(store: ObjectStore, rel: str, upload_id: str, number: int, data: bytearray, n: int,
                 free: list[bytearray], lock: threading.Lock, slots: threading.BoundedSemaphore) -> str:
    """Upload part ``number`` (the first ``n`` bytes of ``data``), then free its buffer and its slot; its ETag.
    (A function, not a method: a part in flight holds no reference to its writer, so a writer dropped unclosed is
    abandoned at once.)"""
    try:
        etag = store.upload_part(rel, upload_id, number, data if n == len(data) else data[:n])
        with lock:
            free.append(data)
        return etag
    finally:
        slots.release()
