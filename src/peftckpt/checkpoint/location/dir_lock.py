"""One run at a time per save directory: an advisory lock held for as long as a run saves there.

Two runs saving into one directory destroy each other's work: each save starts by removing stale staging
directories, which include the other run's save in progress, and the tracker then moves between two
histories. :func:`acquire_save_lock` takes an exclusive ``flock`` on ``<save>/.peftckpt.lock`` (a hidden
name no reader considers) and writes the holder's host, pid and start time into it, so a second run is told
who holds the directory. The kernel releases the lock when the holder's process ends, however it ends
(crash, ``kill -9``, OOM killer): a stale lock file never blocks anyone.

``flock`` belongs to an open file description, so a second ``open`` + ``flock`` by the *same* process would
conflict with itself; the locks this process holds are therefore kept in one process-wide table and shared
(reference counted) by every holder in the process -- e.g. the trainer's start-up check and the
:class:`~peftckpt.checkpoint.api.Checkpointer` that saves. On file systems without ``flock`` support the lock
is skipped with a warning rather than refusing to save.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import os
import socket
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from peftckpt.checkpoint.errors import CheckpointError
from peftckpt.checkpoint.location.names import LOCK_FILENAME

__all__ = ["LOCK_FILENAME", "SaveDirInUseError", "SaveDirLock", "acquire_save_lock"]


class SaveDirInUseError(CheckpointError):
    """Another live run holds the save directory's lock."""


@dataclass
class _Held:
    fd: int | None
    """The locked descriptor (``None`` where the file system has no ``flock``)."""
    count: int
    created: bool = False
    """The directory did not exist before this process locked it."""


# Process-wide by necessity (see the module docstring): one flock per directory and process.
_HELD: dict[str, _Held] = {}
_HELD_GUARD = threading.Lock()


class SaveDirLock:
    """A reference to this process's lock on one save directory; :meth:`release` (or ``with``) drops it."""

    def __init__(self, key: str):
        self._key: str | None = key

    @property
    def path(self) -> Path:
        assert self._key is not None, "released"
        return Path(self._key)

    def release(self) -> None:
        """Drop this reference; the lock itself is released with the last one (idempotent). A directory that
        holds nothing but the lock file then (the run saved nothing, e.g. it was refused at start) is left as
        it was found: the lock file is removed, and the directory too if this process created it."""
        key, self._key = self._key, None
        if key is None:
            return
        with _HELD_GUARD:
            held = _HELD[key]
            held.count -= 1
            if held.count == 0:
                del _HELD[key]
                try:
                    if held.fd is not None and os.listdir(key) == [LOCK_FILENAME]:
                        os.unlink(os.path.join(key, LOCK_FILENAME))  # still locked: nobody can be holding it
                        if held.created:
                            os.rmdir(key)
                except OSError:
                    pass  # something appeared meanwhile: leave it all
                if held.fd is not None:
                    os.close(held.fd)  # closing the descriptor releases the flock

    def __enter__(self) -> SaveDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_text(fd: int) -> str:
    try:
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "a process that did not record itself"


def acquire_save_lock(save_dir: str | os.PathLike[str]) -> SaveDirLock:
    """Lock ``save_dir`` (created if missing) for this process, or raise naming the holder.

    Raises:
        SaveDirInUseError: another process holds it; the message names its host, pid and start time.
        OSError: the directory cannot be created or the lock file cannot be opened (e.g. read-only).
    """
    save = Path(save_dir).absolute()
    created = not save.exists()
    save.mkdir(parents=True, exist_ok=True)
    key = os.path.realpath(save)
    with _HELD_GUARD:
        if key in _HELD:
            _HELD[key].count += 1
            return SaveDirLock(key)
        fd = os.open(os.path.join(key, LOCK_FILENAME), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _holder_text(fd)
                os.close(fd)
                raise SaveDirInUseError(
                    f"save directory {save} is in use by another run ({holder}); two runs saving into one "
                    "directory would delete each other's saves in progress. Wait for it to end, or save to "
                    "another directory") from None
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            warnings.warn(f"{save}: the file system does not support flock ({e.strerror}); concurrent runs "
                          "on this save directory cannot be detected", stacklevel=2)
            _HELD[key] = _Held(None, 1)
            return SaveDirLock(key)
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n".encode(), 0)
        _HELD[key] = _Held(fd, 1, created)
        return SaveDirLock(key)
