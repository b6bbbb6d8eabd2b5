"""Durable local writes: fsync of files, directories and trees, and the atomic replace of a small file; and a
written file's way to the disk begun early, while the save goes on: the kernel's write-back of each batch as it is
written (:func:`start_writeback`) and the file's fsync as soon as it is closed (:func:`start_flush`), which the
commit's own fsync of the file then joins.

Used by the commit protocol on a directory (:mod:`~peftckpt.checkpoint.location.directory`), by the framed DCP
writer, and by the exports, which write HF directories with the same guarantees.
"""

from __future__ import annotations

import ctypes
import os
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["fsync_file", "fsync_dir", "fsync_tree", "atomic_write_bytes", "start_flush", "start_writeback"]

_FSYNC_THREADS = 8
_early: dict[str, Future[None]] = {}
"""Background fsyncs started by :func:`start_flush` and not yet joined by :func:`fsync_file`, by absolute path."""
_early_lock = threading.Lock()
_early_pool: ThreadPoolExecutor | None = None


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None
"""Linux's ``sync_file_range`` through ctypes (resolved on first use; ``False`` where there is none)."""


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing bytes ``[offset, offset + nbytes)`` of ``fd`` to the disk now, without waiting
    (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, as databases do every few MiB they write): the disk works
    while the rest of the file is still being written, and the fsync that must follow finds little left to do.
    Advice only: durability still comes from that fsync, which also reports any I/O error; where the call does not
    exist this does nothing."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            call = ctypes.CDLL(None, use_errno=True).sync_file_range
            call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            call.restype = ctypes.c_int
            _sync_file_range = call
        except AttributeError:  # not Linux
            _sync_file_range = False
    if _sync_file_range and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # (the GIL is released during the call)


def start_flush(path: str | os.PathLike[str]) -> None:
    """Start making ``path`` -- a file just written and closed, that a :func:`fsync_file` (a commit's) will make
    durable later -- durable now, on a background thread: the disk writes it back while the caller goes on, and
    the later fsync finds it clean. That later :func:`fsync_file` -- in this process: an fsync error is reported
    once, to the process that fsynced -- joins this one and raises its error, so it is never dropped here."""
    global _early_pool
    key = os.path.abspath(path)
    with _early_lock:
        if _early_pool is None:
            _early_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peftckpt-flush")
        for done in [k for k, f in _early.items() if f.done() and f.exception() is None]:
            del _early[done]  # (files never committed: their saves failed, or were cleaned)
        _early[key] = _early_pool.submit(_fsync, key)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush one file's data and metadata to stable storage (after the flush :func:`start_flush` began, if any)."""
    with _early_lock:
        early = _early.pop(os.path.abspath(path), None)
    if early is not None:
        early.result()
    _fsync(path)


def _fsync(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (creations, renames, deletions inside it) to stable storage."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file and every directory under ``path`` (and ``path`` itself), children first; the files
    of a directory at once, on a few threads (the file system can then make them durable in one journal
    commit instead of one each)."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        files = [os.path.join(dirpath, name) for name in filenames]
        if len(files) > 1:
            with ThreadPoolExecutor(max_workers=min(len(files), _FSYNC_THREADS)) as pool:
                list(pool.map(fsync_file, files))
        elif files:
            fsync_file(files[0])
        fsync_dir(dirpath)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically: temp file in the same directory, fsync, rename, fsync dir.

    A reader sees either the old content or the new one, never a partial file.
    """
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
