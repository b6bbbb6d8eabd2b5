"""The JSON manifest of a checkpoint (never pickle), and the file checksums it records.

The manifest is ``<ckpt>/metadata.json``; :mod:`peftckpt.checkpoint.storage_layout` writes it last, so
its presence means "committed". It records what was saved and how (DESIGN.md §4.1) plus the size and
checksum of every other file of the checkpoint, which :func:`verify_files` checks.

Checksum algorithm: SHA-256. Measured here (one 256 MiB buffer hashed in 8 MiB blocks, best of 3, this
x86 CPU with SHA extensions, Python 3.11): sha256 1155 MiB/s, sha1 1236, blake2b 453, md5 466,
blake2s 309, zlib.crc32 2760, zlib.adler32 1886. CRC32 is ~2.4x faster but a 32-bit non-cryptographic
code (and adler32 is weak on short or sparse changes); SHA-256 is the fastest *robust* stdlib choice on
hardware with SHA extensions, detects deliberate tampering too, and is parallelised across files with a
thread pool (hashlib releases the GIL on large updates), so it runs at about disk speed.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import threading
from collections.abc import Callable, Generator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

from torch.distributed.checkpoint.filesystem import FileSystem

import peftckpt
from peftckpt.checkpoint.errors import CheckpointFormatError, CheckpointIntegrityError
from peftckpt.checkpoint.storage_layout import MANIFEST_FILENAME

__all__ = [
    "FORMAT_VERSION",
    "KNOWN_FORMATS",
    "CHECKSUM_ALGORITHM",
    "HASH_BLOCK_BYTES",
    "Manifest",
    "read_manifest",
    "checksum_file",
    "checksum_files",
    "ChecksummingFileSystem",
    "verify_files",
    "verify_checksums",
    "files_share",
    "is_data_file",
]

FORMAT_VERSION = 1
"""Newest manifest format version this library writes and reads."""

KNOWN_FORMATS = ("torch_dist", "torch")
"""Checkpoint formats: ``torch_dist`` (DCP directory) and ``torch`` (legacy per-rank ``.pt`` files)."""

CHECKSUM_ALGORITHM = "sha256"
"""hashlib name of the checksum written into new manifests (see the module docstring for why)."""

HASH_BLOCK_BYTES = 8 * 1024 * 1024
"""Read size while hashing: large enough to amortise syscalls, small enough to stay in cache."""

_MAX_HASH_THREADS = 8


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclass
class Manifest:
    """Everything a loader or ``peftckpt verify`` needs to know about a checkpoint, as JSON."""

    format: str
    """``"torch_dist"`` or ``"torch"``."""
    iteration: int
    """Training iteration of the checkpoint (0 = before the first optimizer step)."""
    sections: list[str] = field(default_factory=list)
    """State-dict sections saved (``model``, ``optimizer``, ``rng_state``, ...)."""
    layout: dict[str, int] = field(default_factory=dict)
    """Parallel layout at save time: ``tp``, ``pp``, ``dp``, ``vpp``."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """The model's configuration (JSON-serialisable)."""
    trainable_only: bool = False
    """Whether frozen model entries were left out (``--save-trainable-params-only``)."""
    saved_keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Saved model tensors: flattened DCP key -> ``{"shape": [...], "dtype": "float32", "requires_grad"}``.
    Shapes are global (layout independent)."""
    excluded_keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Frozen model tensors left out of a trainable-only save, same record shape as ``saved_keys``."""
    adapter_config: dict[str, Any] | None = None
    """The adapter (LoRA) configuration, or ``None`` for a model without adapters."""
    base_fingerprint: str | None = None
    """Layout-independent fingerprint of the frozen base weights, or ``None`` when not computed."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every other file of the checkpoint: POSIX relative path -> ``{"size": int, "checksum": str}``."""
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    """hashlib name of the algorithm behind ``files[...]["checksum"]``."""
    args: dict[str, Any] = field(default_factory=dict)
    """Free-form run arguments (JSON-serialisable)."""
    format_version: int = FORMAT_VERSION
    """Manifest format version; a newer one than :data:`FORMAT_VERSION` is refused."""
    library_version: str = peftckpt.__version__
    """peftckpt version that wrote the checkpoint."""
    created_at: str = field(default_factory=_now_iso)
    """UTC ISO-8601 time of the save."""

    def to_json(self) -> bytes:
        """Stable UTF-8 JSON (sorted keys, 2-space indent, trailing newline), with ``manifest_sha256``: the
        SHA-256 of the same JSON without that field, so a damaged manifest is detected too."""
        body = asdict(self)
        body[SELF_CHECKSUM_KEY] = _self_checksum(body)
        return (json.dumps(body, sort_keys=True, indent=2, allow_nan=False) + "\n").encode()

    @property
    def total_bytes(self) -> int:
        """Sum of the recorded file sizes."""
        return sum(int(rec["size"]) for rec in self.files.values())

    @classmethod
    def from_json(cls, data: bytes, source: Path) -> Manifest:
        """Parse and validate manifest bytes read from ``source`` (named in every error).

        Raises:
            CheckpointFormatError: malformed JSON, a missing or mistyped field, an unknown format, or a
                format version newer than this library reads.
        """
        try:
            raw = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointFormatError(f"manifest {source} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointFormatError(
                f"manifest {source} must hold a JSON object, got {type(raw).__name__}"
            )

        # Version first: a newer writer may have changed anything else.
        version = raw.get("format_version", FORMAT_VERSION)
        if not _is_int(version):
            raise CheckpointFormatError(
                f"manifest {source}: field 'format_version' must be an int, got {version!r}"
            )
        if version > FORMAT_VERSION:
            raise CheckpointFormatError(
                f"checkpoint {source} has format version {version} but this peftckpt "
                f"({peftckpt.__version__}) reads up to {FORMAT_VERSION}; upgrade peftckpt"
            )

        recorded = raw.pop(SELF_CHECKSUM_KEY, None)
        if recorded is not None and recorded != _self_checksum(raw):
            raise CheckpointIntegrityError(
                f"manifest {source} is damaged: its content does not match its {SELF_CHECKSUM_KEY} "
                f"({recorded})"
            )
        problems = []
        names = {f.name for f in fields(cls)}
        missing = sorted(names - raw.keys())
        if missing:
            problems.append(f"missing field(s) {', '.join(missing)}")
        for name, check, expected in _FIELD_CHECKS:
            if name in raw and not check(raw[name]):
                problems.append(f"field {name!r} must be {expected}, got {_short(raw[name])}")
        if "format" in raw and isinstance(raw["format"], str) and raw["format"] not in KNOWN_FORMATS:
            problems.append(f"unknown format {raw['format']!r} (known: {', '.join(KNOWN_FORMATS)})")
        for name in ("saved_keys", "excluded_keys"):
            if isinstance(raw.get(name), dict):
                problems.extend(_check_key_records(name, raw[name]))
        if isinstance(raw.get("files"), dict):
            problems.extend(_check_file_records(raw["files"]))
        if problems:
            raise CheckpointFormatError(f"manifest {source} is malformed: " + "; ".join(problems))
        return cls(**{name: raw[name] for name in names})


SELF_CHECKSUM_KEY = "manifest_sha256"


def _self_checksum(body: Mapping[str, Any]) -> str:
    data = json.dumps({k: v for k, v in body.items() if k != SELF_CHECKSUM_KEY}, sort_keys=True,
                      allow_nan=False).encode()
    return hashlib.sha256(data).hexdigest()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_str_dict(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


_FIELD_CHECKS: tuple[tuple[str, Any, str], ...] = (
    ("format", lambda v: isinstance(v, str), "a string"),
    ("library_version", lambda v: isinstance(v, str), "a string"),
    ("iteration", lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    ("sections", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), "a list of strings"),
    ("layout", lambda v: _is_str_dict(v) and all(_is_int(x) for x in v.values()), "an object of ints"),
    ("model_config", _is_str_dict, "an object"),
    ("trainable_only", lambda v: isinstance(v, bool), "a bool"),
    ("saved_keys", _is_str_dict, "an object"),
    ("excluded_keys", _is_str_dict, "an object"),
    ("adapter_config", lambda v: v is None or _is_str_dict(v), "an object or null"),
    ("base_fingerprint", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("files", _is_str_dict, "an object"),
    ("checksum_algorithm", lambda v: isinstance(v, str), "a string"),
    ("args", _is_str_dict, "an object"),
    ("created_at", lambda v: isinstance(v, str), "a string"),
)


def _check_key_records(section: str, records: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, rec in records.items():
        ok = (
            isinstance(rec, dict)
            and isinstance(rec.get("shape"), list)
            and all(_is_int(d) and d >= 0 for d in rec["shape"])
            and isinstance(rec.get("dtype"), str)
            and isinstance(rec.get("requires_grad"), bool)
        )
        if not ok:
            problems.append(
                f"{section}[{key!r}] must be {{'shape': [int], 'dtype': str, 'requires_grad': bool}}, "
                f"got {_short(rec)}"
            )
    return problems


def _check_file_records(records: Mapping[str, Any]) -> list[str]:
    problems = []
    for rel, rec in records.items():
        ok = (
            isinstance(rec, dict)
            and _is_int(rec.get("size"))
            and rec["size"] >= 0
            and isinstance(rec.get("checksum"), str)
        )
        if not ok:
            problems.append(f"files[{rel!r}] must be {{'size': int, 'checksum': str}}, got {_short(rec)}")
        elif rel.startswith("/") or ".." in rel.split("/"):
            problems.append(f"files[{rel!r}] must be a relative path inside the checkpoint")
    return problems


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``<ckpt_dir>/metadata.json``.

    Raises:
        CheckpointFormatError: no manifest (the directory is not a committed peftckpt checkpoint) or an
            invalid one.
    """
    path = Path(ckpt_dir) / MANIFEST_FILENAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointFormatError(
            f"{ckpt_dir} is not a committed peftckpt checkpoint: it has no {MANIFEST_FILENAME}"
        ) from None
    return Manifest.from_json(data, path)


# ------------------------------------------------------------------------------------------ checksums


def checksum_file(path: str | os.PathLike[str], algorithm: str = CHECKSUM_ALGORITHM) -> str:
    """Hex digest of a file, read in :data:`HASH_BLOCK_BYTES` blocks into one reused buffer."""
    digest = hashlib.new(algorithm)
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


_PUBLISH_BYTES = 8 * 1024 * 1024
"""How much a writer buffers before it hands a new file length to the hashing thread."""


class _TailHasher:
    """Hashes a file while another thread writes it: reads up to the length the writer published (the
    bytes come back from the page cache), waits for more, stops at the final length."""

    def __init__(self, path: Path, algorithm: str):
        self.path = path
        self._digest = hashlib.new(algorithm)
        self._cond = threading.Condition()
        self._published = 0
        self._final: int | None = None
        self._hashed = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"checksum {path.name}", daemon=True)
        self._thread.start()

    def publish(self, length: int, final: bool = False) -> None:
        with self._cond:
            self._published = max(self._published, length)
            if final:
                self._final = length
            self._cond.notify()

    def _run(self) -> None:
        buf = bytearray(HASH_BLOCK_BYTES)
        view = memoryview(buf)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            self._error = e
            return
        try:
            while True:
                with self._cond:
                    while self._published <= self._hashed and self._final is None:
                        self._cond.wait()
                    target, final = self._published, self._final
                while self._hashed < target:
                    n = os.preadv(fd, [view[:min(len(buf), target - self._hashed)]], self._hashed)
                    if n == 0:
                        raise OSError(f"{self.path} is shorter than the {target} bytes written")
                    self._digest.update(view[:n])
                    self._hashed += n
                if final is not None and self._hashed >= final:
                    return
        except BaseException as e:  # noqa: BLE001 - reported by result(); the caller re-hashes
            self._error = e
        finally:
            os.close(fd)

    def result(self) -> tuple[int, str] | None:
        """``(length, hex digest)`` once the writer closed the file, or ``None`` if hashing failed."""
        self._thread.join()
        if self._error is not None or self._final is None:
            return None
        return self._final, self._digest.hexdigest()


class _PublishingStream(io.RawIOBase):
    """A write stream that tells its :class:`_TailHasher` how much of the file is on the OS side."""

    def __init__(self, raw: io.BufferedWriter, hasher: _TailHasher):
        super().__init__()
        self._raw = raw
        self._hasher = hasher
        self._unpublished = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self._raw.write(b)
        self._unpublished += n
        if self._unpublished >= _PUBLISH_BYTES:
            self.flush()
        return n

    def flush(self) -> None:
        if self._raw.closed:
            return
        self._raw.flush()
        # DCP flushes after every item; waking the hasher for each small one would only trade the GIL.
        if self._unpublished >= _PUBLISH_BYTES:
            self._unpublished = 0
            self._hasher.publish(self._raw.tell())

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        if self.closed:
            return
        try:
            self._raw.flush()
        finally:
            self._raw.close()
            super().close()


class ChecksummingFileSystem(FileSystem):
    """The file system of a DCP ``FileSystemWriter`` that checksums each file *while* it is written.

    Every ``create_stream(path, "wb")`` starts a thread that reads the file back as the writer publishes
    its length and hashes it, so serialising, writing, fsync and hashing overlap instead of following one
    another (a full save hashes at about disk speed, see the module docstring). :meth:`checksums` gives the
    records of :func:`checksum_files`; a file it did not see written in full is hashed afresh.
    """

    def __init__(self, algorithm: str = CHECKSUM_ALGORITHM):
        super().__init__()
        self.algorithm = algorithm
        self._hashers: dict[Path, _TailHasher] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path).absolute()
        with open(target, "wb") as raw:
            hasher = _TailHasher(target, self.algorithm)
            with self._lock:
                self._hashers[target] = hasher
            stream = _PublishingStream(raw, hasher)
            try:
                yield cast(io.IOBase, stream)
            finally:
                stream.close()
                try:
                    size = target.stat().st_size
                except OSError:
                    size = -1  # gone: checksums() will not trust this digest
                hasher.publish(size, final=True)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)
        with self._lock:
            hasher = self._hashers.pop(Path(path).absolute(), None)
            if hasher is not None:
                self._hashers[Path(new_path).absolute()] = hasher

    def checksums(self, paths: Iterable[str | os.PathLike[str]], root: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
        """Like :func:`checksum_files`, from the digests taken while writing where there is one."""
        root_path = Path(root)
        out: dict[str, dict[str, Any]] = {}
        rest = []
        for p in map(Path, paths):
            p = (p if p.is_absolute() else root_path / p).absolute()
            with self._lock:
                hasher = self._hashers.get(p)
            done = None if hasher is None else hasher.result()
            if done is not None and done[0] == p.stat().st_size:
                out[_relpath(p, root_path.absolute())] = {"size": done[0], "checksum": done[1]}
            else:
                rest.append(p)
        out.update(checksum_files(rest, root_path.absolute(), self.algorithm))
        return out


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
        hashlib.new(manifest.checksum_algorithm)
    except ValueError:
        return [f"{root}: manifest uses checksum algorithm {manifest.checksum_algorithm!r}, unknown here"]
    problems: dict[str, str] = {}
    to_hash = []
    for rel in files_share(manifest, shard):
        rec = manifest.files[rel]
        path = root / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems[rel] = f"{path}: missing (expected {rec['size']} bytes)"
            continue
        if size != rec["size"]:
            kind = "truncated" if size < rec["size"] else "extended"
            problems[rel] = f"{path}: size mismatch ({kind}): expected {rec['size']} bytes, got {size}"
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
