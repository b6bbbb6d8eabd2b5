"""File checksums: computed while a save writes, recorded in the manifest, checked by loads and ``verify``.

Algorithm: XXH3-128 (the ``xxhash`` package) for new checkpoints; any hashlib name recorded by an older
manifest (``sha256``) still verifies. The checksums guard against corruption -- a truncated, flipped or
missing file -- not against tampering: whoever can rewrite a data file can rewrite the manifest beside it,
so a cryptographic hash buys nothing here, while its cost is real. Measured on this project's 2-core
development VM (256 MiB buffer): xxh3_128 ~22.8 GB/s, sha256 ~1.8 GB/s (SHA extensions), zlib.crc32 ~3.8
GB/s. At SHA-256 speed, hashing was half of a 3.9 GB full save and most of a verified load's extra time.
XXH3-128 is a 128-bit hash with excellent dispersion, so accidental collisions are out of reach.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Protocol, cast

from torch.distributed.checkpoint.filesystem import FileSystem

from peftckpt.checkpoint.errors import CheckpointFormatError
from peftckpt.checkpoint.location.names import MANIFEST_FILENAME
from peftckpt.checkpoint.storage.durable import start_writeback
from peftckpt.checkpoint.storage.manifest import CHECKSUM_ALGORITHM, CHECKSUM_ALGORITHMS, Manifest
from peftckpt.checkpoint.storage.paths import recorded_file_problem
from peftckpt.checkpoint.storage.preads import write_all

__all__ = [
    "CHECKSUM_ALGORITHM",
    "HASH_BLOCK_BYTES",
    "overlap_pool",
    "new_digest",
    "checksum_file",
    "checksum_files",
    "ChecksummingFileSystem",
    "StreamTo",
    "verify_files",
    "verify_checksums",
    "files_share",
    "is_data_file",
]

HASH_BLOCK_BYTES = 8 * 1024 * 1024
"""Read size while hashing: large enough to amortise syscalls, small enough to stay in cache."""

_MAX_HASH_THREADS = 8
_WRITE_BUFFER_BYTES = 1024 * 1024
_OVERLAP_BYTES = 4 * 1024 * 1024
"""Writes at least this large are hashed on a thread of their own while the file system copies them."""
_overlap_pool: ThreadPoolExecutor | None = None
_ordered_pool: ThreadPoolExecutor | None = None


def overlap_pool() -> ThreadPoolExecutor:
    """Threads that hash large buffers while the caller writes them (XXH3 releases the GIL)."""
    global _overlap_pool
    if _overlap_pool is None:
        _overlap_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="peftckpt-hash")
    return _overlap_pool


def _in_order_pool() -> ThreadPoolExecutor:
    """One thread that hashes gathered writes (:meth:`_HashingRaw.write_many`) in the order they were written."""
    global _ordered_pool
    if _ordered_pool is None:
        _ordered_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peftckpt-hash-in-order")
    return _ordered_pool


_XXHASH = ("xxh3_128", "xxh3_64")


class Digest(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


def new_digest(algorithm: str) -> Digest:
    """A fresh hash object: ``xxh3_128`` / ``xxh3_64`` (xxhash) or any hashlib algorithm.

    Raises :class:`CheckpointFormatError` for an algorithm this installation cannot compute."""
    if algorithm not in CHECKSUM_ALGORITHMS:  # e.g. SHAKE, whose hexdigest() needs a length
        raise CheckpointFormatError(f"unknown checksum algorithm {algorithm!r}")
    if algorithm in _XXHASH:
        try:
            import xxhash
        except ImportError:  # pragma: no cover - a dependency of the package
            raise CheckpointFormatError(f"checksum algorithm {algorithm!r} needs the xxhash package "
                                        "(pip install xxhash)") from None
        return cast(Digest, getattr(xxhash, algorithm)())
    try:
        return cast(Digest, hashlib.new(algorithm))
    except ValueError:
        raise CheckpointFormatError(f"unknown checksum algorithm {algorithm!r}") from None


def checksum_file(path: str | os.PathLike[str], algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Hex digest of a file, read in :data:`HASH_BLOCK_BYTES` blocks into one reused buffer."""
    digest = new_digest(algorithm)
    buf = bytearray(HASH_BLOCK_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            digest.update(view[:n])
    return digest.hexdigest()


def _relpath(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def checksum_files(
    paths: Iterable[str | os.PathLike[str]],
    root: str | os.PathLike[str],
    algorithm: str = CHECKSUM_ALGORITHM,
) -> dict[str, dict[str, Any]]:
    """``{relpath: {"size", "checksum"}}`` for ``paths`` (absolute, or relative to ``root``), hashed in
    parallel threads. Relative paths use ``/`` whatever the OS."""
    root_path = Path(root)
    abs_paths = sorted({p if p.is_absolute() else root_path / p for p in map(Path, paths)})
    if not abs_paths:
        return {}
    workers = max(1, min(len(abs_paths), os.cpu_count() or 1, _MAX_HASH_THREADS))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests = list(pool.map(lambda p: checksum_file(p, algorithm), abs_paths))
    return {
        _relpath(p, root_path): {"size": p.stat().st_size, "checksum": d} for p, d in zip(abs_paths, digests)
    }


# --------------------------------------------------------------------------------- while writing
class _HashingRaw(io.RawIOBase):
    """An unbuffered file that hashes every byte it writes, in order (under an ``io.BufferedWriter``,
    which turns ``torch.save``'s many small writes into a few large ones)."""

    def __init__(self, raw: io.RawIOBase, digest: Digest):
        super().__init__()
        self._raw = raw
        self.digest = digest
        self.written = 0
        self._hashing: list[Future[None]] = []
        """The batches of :meth:`write_many` being hashed, in order."""

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.settle()  # (the digest takes the bytes in order)
        view = memoryview(b).cast("B")
        if len(view) < _OVERLAP_BYTES:
            n = self._raw.write(view) or 0
            self.digest.update(view[:n])
        else:  # a tensor's bytes, straight from its memory: hashed on another core while they are written
            view = view[:_OVERLAP_BYTES * 64]
            hashed = overlap_pool().submit(self.digest.update, view)
            try:
                n = self._write_fully(view)
            finally:
                hashed.result()
        self.written += n
        return n

    def write_many(self, views: Sequence[memoryview]) -> int:
        """Write ``views`` (byte views) in order, all of them: one ``writev`` for a local file (whose write-back to
        the disk starts at once, :func:`~peftckpt.checkpoint.storage.durable.start_writeback`), one by one to a
        stream (an object's upload). They are hashed on another thread, in order, while the caller goes on:
        their memory must not change before :meth:`settle` (which closing calls)."""
        self._hashing.append(_in_order_pool().submit(_update, self.digest, views))
        if isinstance(self._raw, io.FileIO):  # (written from its start, in order: ``written`` is where these go)
            total = write_all(self._raw.fileno(), views)
            start_writeback(self._raw.fileno(), self.written, total)
        else:
            total = sum(self._write_fully(view) for view in views)
        self.written += total
        return total

    def _write_fully(self, view: memoryview) -> int:
        """All of ``view`` into the underlying file or stream (a raw write may take part of it)."""
        n = 0
        while n < len(view):
            n += self._raw.write(view[n:]) or 0
        return n

    def settle(self) -> None:
        """Wait until every byte written is hashed (raising a failed batch's error)."""
        hashing, self._hashing = self._hashing, []
        for batch in hashing:
            batch.result()

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if not self.closed:
            try:
                self.settle()
            finally:
                self._raw.close()
                super().close()


def _update(digest: Digest, views: Sequence[memoryview]) -> None:
    for view in views:
        digest.update(view)


StreamTo = Callable[[Path], io.RawIOBase]
"""Where a data file's bytes go instead of the local file at that path (a save to an object store: the object)."""


class ChecksummingFileSystem(FileSystem):
    """The file system of a DCP ``FileSystemWriter`` that checksums each file *as* it is written.

    Every byte DCP writes passes through :class:`_HashingRaw` (DCP writes each file sequentially, with no
    seeks), so no file is read back. :meth:`checksums` gives the records of :func:`checksum_files`; a file
    it did not see written, or whose size differs from what it saw, is hashed afresh from disk.

    ``stream_to``: data files (:func:`is_data_file`) are written through the stream it opens for their path
    instead of to disk (:attr:`streamed` lists them); the stream is aborted (its ``abort()``) if the write fails,
    closed (completed) if it succeeds. Other files (DCP's ``.metadata``) are local files as ever.
    """

    def __init__(self, algorithm: str = CHECKSUM_ALGORITHM, stream_to: StreamTo | None = None):
        super().__init__()
        self.algorithm = algorithm
        self.stream_to = stream_to
        self.streamed: list[Path] = []
        """The paths whose files went to :attr:`stream_to`, complete, in the order they were written."""
        self._done: dict[Path, tuple[int, str]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path).absolute()
        streamed = self.stream_to is not None and is_data_file(target.name)
        raw = self.stream_to(target) if self.stream_to is not None and streamed else io.FileIO(target, "wb")
        hashing = _HashingRaw(raw, new_digest(self.algorithm))
        stream = io.BufferedWriter(hashing, buffer_size=_WRITE_BUFFER_BYTES)
        try:
            yield cast(io.IOBase, stream)
            stream.close()  # (a streamed file is complete once closed)
        except BaseException:
            abort = getattr(raw, "abort", None)
            if abort is not None:
                abort()  # nothing of a failed streamed file appears
            with suppress(Exception):
                stream.close()
            raise
        with self._lock:
            self._done[target] = (hashing.written, hashing.digest.hexdigest())
            if streamed:
                self.streamed.append(target)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            done = self._done.pop(Path(path).absolute(), None)
            if done is not None:
                self._done[Path(new_path).absolute()] = done

    def checksums(self, paths: Iterable[str | os.PathLike[str]], root: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
        """Like :func:`checksum_files`, from the digests taken while writing where there is one."""
        root_path = Path(root).absolute()
        out: dict[str, dict[str, Any]] = {}
        rest = []
        for p in map(Path, paths):
            p = (p if p.is_absolute() else root_path / p).absolute()
            with self._lock:
                done = self._done.get(p)
            if done is not None and (p in self.streamed or done[0] == p.stat().st_size):
                out[_relpath(p, root_path)] = {"size": done[0], "checksum": done[1]}
            else:
                rest.append(p)
        out.update(checksum_files(rest, root_path, self.algorithm))
        return out


# -------------------------------------------------------------------------------------- verifying
def _files_on_disk(root: Path) -> set[str]:
    found = set()
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            found.add(_relpath(Path(dirpath) / name, root))
    return found


def is_data_file(rel: str) -> bool:
    """A DCP shard data file (``__<rank>_<n>.distcp``): the bulk of a checkpoint's bytes, read by tensor
    loads only -- unlike ``.metadata`` and the manifest, which must be intact before anything is read."""
    return rel.endswith(".distcp")


def files_share(manifest: Manifest, shard: tuple[int, int] | None) -> list[str]:
    """The recorded files that ``shard=(i, n)`` checks: every n-th one (sorted) starting at i; all for None."""
    return [rel for pos, rel in enumerate(sorted(manifest.files)) if shard is None or pos % shard[1] == shard[0]]


def _checksum_problems(root: Path, manifest: Manifest, rels: list[str]) -> dict[str, str]:
    got = checksum_files(rels, root, manifest.checksum_algorithm)
    problems = {}
    for rel in rels:
        expected = manifest.files[rel]["checksum"]
        if got[rel]["checksum"] != expected:
            problems[rel] = (
                f"{root / rel}: {manifest.checksum_algorithm} checksum mismatch: expected {expected}, "
                f"got {got[rel]['checksum']}"
            )
    return problems


def verify_files(ckpt_dir: str | os.PathLike[str], manifest: Manifest, shard: tuple[int, int] | None = None,
                 hash_if: Callable[[str], bool] | None = None) -> list[str]:
    """Check the files of ``ckpt_dir`` against ``manifest.files``; one message per bad file.

    ``shard=(i, n)`` checks only every n-th recorded file starting at i (so n ranks split the work) and
    reports unlisted files only for ``i == 0``. ``hash_if(rel)`` false: that file is checked for presence
    and size only, its checksum left to :func:`verify_checksums` (e.g. while a load reads it).

    Reported: a recorded file that is missing, a size mismatch (truncated or extended, expected vs got),
    a checksum mismatch, and a file on disk the manifest does not list (the manifest itself excepted).
    An empty list means the checkpoint's files are intact.
    """
    root = Path(ckpt_dir)
    try:
        new_digest(manifest.checksum_algorithm)
    except CheckpointFormatError as e:
        return [f"{root}: {e}"]
    problems: dict[str, str] = {}
    to_hash = []
    for rel in files_share(manifest, shard):
        rec = manifest.files[rel]
        problem = recorded_file_problem(root, rel, rec["size"])  # a symlink, FIFO or device is never opened
        if problem is not None:
            problems[rel] = problem
        elif hash_if is None or hash_if(rel):
            to_hash.append(rel)
    problems.update(_checksum_problems(root, manifest, to_hash))
    unlisted = set() if shard is not None and shard[0] != 0 else _files_on_disk(root)
    for rel in sorted(unlisted - manifest.files.keys() - {MANIFEST_FILENAME}):
        problems[rel] = f"{root / rel}: unexpected file, not listed in the manifest"
    return [problems[rel] for rel in sorted(problems)]


def verify_checksums(ckpt_dir: str | os.PathLike[str], manifest: Manifest, rels: Iterable[str]) -> list[str]:
    """The checksum half of :func:`verify_files` for recorded files ``rels`` already checked for size."""
    problems = _checksum_problems(Path(ckpt_dir), manifest, sorted(rels))
    return [problems[rel] for rel in sorted(problems)]
