"""The node-local cache of bases read from a store: a rerun on the same host reads its base from local disk.

A base (a full checkpoint loaded with ``load_pretrained``) does not change between the runs that fine-tune it,
and at 7B-70B it is 13-140 GB: fetching it again on every run of every host is the largest cost of training from
a store. :class:`BaseCache` keeps whole verified copies under ``<cache>/bases/<key>/``, ``key`` a digest of the
checkpoint's manifest -- which records every file's size and checksum, so equal keys mean equal bytes (a base
re-imported under the same URL gets a new key, never a stale copy).

Steps of :meth:`BaseCache.use` (the lowest rank of each host; the other ranks of the host read what it gives):
    1. Take the entry's lock, shared: an entry in use is never evicted.
    2. A complete entry (its directory exists; it is only ever renamed into place whole) is a hit: its time is
       touched and it is read like any checkpoint directory, verified block by block as it is read (local disk
       can rot too).
    3. A miss downloads every object into a fresh directory beside the entries, hashing each as it streams, and
       renames it into place (two runs filling one entry at once: the first rename wins, the other's copy is
       deleted).
    4. Entries beyond the size cap (:data:`CAP_ENV`, default :data:`DEFAULT_CAP_GB`), least recently used first,
       are deleted -- each only if no run holds it (an exclusive lock taken without waiting).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import CheckpointIntegrityError

__all__ = ["BaseCache", "CAP_ENV", "DEFAULT_CAP_GB", "CACHE_ENV", "cache_root"]

CACHE_ENV = "PEFTCKPT_CACHE_DIR"
"""Node-local directory for the spool of saves to, and the copies of loads from, an object store."""


def cache_root() -> Path:
    """``$PEFTCKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/peftckpt``, else ``~/.cache/peftckpt``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "peftckpt"


CAP_ENV = "PEFTCKPT_BASE_CACHE_GB"
"""Size cap of the base cache in GB (decimal); ``0`` keeps only the entry in use."""
DEFAULT_CAP_GB = 200.0


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


class BaseCache:
    """The base cache under ``root`` (module docstring)."""

    def __init__(self, root: Path, cap_bytes: int | None = None) -> None:
        self.root = root
        if cap_bytes is None:
            try:
                cap_bytes = int(float(os.environ.get(CAP_ENV, DEFAULT_CAP_GB)) * 1e9)
            except ValueError:
                cap_bytes = int(DEFAULT_CAP_GB * 1e9)
        self.cap_bytes = cap_bytes

    @staticmethod
    def key(manifest_bytes: bytes) -> str:
        """The entry of the checkpoint whose manifest is ``manifest_bytes``."""
        return hashlib.sha256(manifest_bytes).hexdigest()[:32]

    def entry(self, key: str) -> Path:
        return self.root / key

    @contextlib.contextmanager
    def use(self, key: str, fill: Callable[[Path], list[str]]) -> Iterator[tuple[Path, bool, list[str]]]:
        """Steps 1-4: ``(directory, hit, problems)`` while held; ``fill(into)`` downloads a miss into ``into``,
        returning its problems (then nothing is kept)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked(key, fcntl.LOCK_SH):  # 1.
            final = self.entry(key)
            if final.is_dir():  # 2.
                os.utime(final)
                yield final, True, []
                return
            staging = self.root / f".fill-{key}-{secrets.token_hex(4)}"  # 3.
            try:
                problems = fill(staging)
                if problems:
                    yield staging, False, problems
                    return
                try:
                    os.rename(staging, final)
                except OSError:  # filled meanwhile by another run: theirs is as good
                    if not final.is_dir():
                        raise
                self._evict(keep=key)  # 4.
                yield final, False, []
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    def damaged_copy_error(self, e: BaseException, local: Path, discard: bool) -> BaseException:
        """``e``, raised by a load of the entry ``local``: damage is the cached copy's (not the store's), said so,
        and the entry is deleted (``discard``: by the rank that fetched it), so that the next run fetches the base
        again."""
        if not isinstance(e, CheckpointIntegrityError):
            return e
        if discard:
            self.discard(local.name)
        if e.args and isinstance(e.args[0], str):
            e.args = (f"{e.args[0]}\n(this is the copy of the base in the host's base cache, {local}: it was deleted, "
                      "the next run fetches the base from the store again)", *e.args[1:])
        return e

    def discard(self, key: str) -> None:
        """Delete the entry ``key`` (found damaged): out of sight at once, its files deleted after."""
        gone = self.root / f".gone-{key}-{time.monotonic_ns()}"
        with contextlib.suppress(OSError):
            os.rename(self.entry(key), gone)
        shutil.rmtree(gone, ignore_errors=True)

    @contextlib.contextmanager
    def _locked(self, key: str, how: int) -> Iterator[None]:
        fd = os.open(self.root / f".{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how)
            yield
        finally:
            os.close(fd)

    def _evict(self, keep: str) -> list[str]:
        """Step 4: delete the least recently used entries (not ``keep``, not held) until the cap holds; returns
        the keys deleted."""
        entries = []
        for path in self.root.iterdir():
            if path.is_dir() and not path.name.startswith("."):
                entries.append((path.stat().st_mtime, path.name, _size(path)))
        total = sum(size for *_, size in entries)
        deleted = []
        for _, key, size in sorted(entries):
            if total <= self.cap_bytes:
                break
            if key == keep:
                continue
            fd = os.open(self.root / f".{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # in use by another run
                os.close(fd)
                continue
            try:
                self.discard(key)
                total -= size
                deleted.append(key)
            finally:
                os.close(fd)
        return deleted
