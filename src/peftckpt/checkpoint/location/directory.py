"""A save location on a (local or mounted) file system: a directory, committed into by fsync and rename.

Why a crash never loses the last good checkpoint here (the rules are :mod:`~.protocol`'s):

* A save writes into ``.staging.iter_N.<token>``, which no reader considers; the manifest is written last (temp
  file + fsync + rename) and the whole staging tree is fsynced before the rename to ``iter_N``, so a directory
  visible under its committed name always has all of its bytes on disk.
* A re-save renames the old ``iter_N`` aside to ``.trash.replace.iter_N.<token>`` before the new copy takes its
  name (POSIX ``rename`` cannot replace a non-empty directory in one step). Between the two renames the old copy
  keeps its manifest under that name: a resolve uses it (with a warning), the next save's clean renames it back.
  After the second rename the trash is garbage whatever its state.
* Retention renames a checkpoint to ``.trash.retire.*`` (one atomic step: it is no longer committed), then
  deletes it.

The functions at the end are this module's seams for code that holds a path: they wrap the path in a
:class:`Directory` and apply the protocol.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import ClassVar

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ..storage.byte_sources import FileSource
from ..storage.checksums import verify_files
from ..storage.durable import atomic_write_bytes, fsync_dir, fsync_file, fsync_tree
from ..storage.manifest import Manifest, read_manifest
from ..storage.paths import read_regular_file
from . import protocol
from .base import CommittedCopy, Held, Location, SaveTarget
from .dir_lock import acquire_save_lock
from .names import MANIFEST_FILENAME, STAGING_PREFIX, TRASH_PREFIX, iteration_dirname, parse_iteration_dirname
from .urls import local_only_problem

__all__ = ["Directory", "new_staging_dir", "commit_staging", "resolve_checkpoint_dir", "clean_stale_staging",
           "apply_retention", "list_committed", "read_tracker", "write_tracker"]


class Directory(Location):
    """A save directory or a checkpoint directory."""

    STAND_IN_PREFIX: ClassVar[str] = f"{TRASH_PREFIX}replace."
    STAND_IN_WORDS: ClassVar[str] = "previous copy"
    WRITES_IN_PLACE: ClassVar[bool] = False

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.text = str(self.path)

    def describe(self, rel: str = "") -> str:
        return str(self.path / rel) if rel else self.text

    def ref(self, rel: str = "") -> Path:
        return self.path / rel if rel else self.path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def parent(self) -> str:
        return str(self.path.parent)

    def absolute(self) -> Directory:
        return Directory(self.path.absolute())

    def sub(self, rel: str) -> Directory:
        return Directory(self.path / rel)

    # -------------------------------------------------------------------------------------- probes
    def check_readable(self) -> None:
        if not self.path.exists():
            raise CheckpointNotFoundError(f"checkpoint path {self.path} does not exist")
        if not self.path.is_dir():
            raise CheckpointFormatError(f"{self.path} is a file, not a checkpoint directory or a save directory; "
                                        "pass the directory")

    # ---------------------------------------------------------------------------------- small files
    def read_small(self, rel: str, max_bytes: int) -> bytes:
        return read_regular_file(self.path / rel, max_bytes)

    def is_file(self, rel: str) -> bool:
        return (self.path / rel).is_file()

    def byte_source(self, rel: str) -> FileSource:
        return FileSource(self.path / rel)

    def write_atomic(self, rel: str, data: bytes) -> None:
        atomic_write_bytes(self.path / rel, data)

    def replace_problem(self, rel: str) -> str | None:
        path = self.path / rel
        return "is not a regular file" if path.is_symlink() or (path.exists() and not path.is_file()) else None

    def names(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def holds_manifest(self, rel: str = "", keep: bool = False) -> bool:
        return (self.path / rel / MANIFEST_FILENAME).is_file()

    def read_manifest(self, rel: str = "") -> Manifest:
        return read_manifest(self.path / rel)

    def local_dir(self, rel: str = "") -> Path:
        return self.ref(rel)

    def size_problems(self, rel: str, manifest: Manifest) -> list[str]:
        return verify_files(self.path / rel, manifest, hash_if=lambda _rel: False)

    # ---------------------------------------------------------------------------------------- saves
    def lock(self) -> Held:
        return acquire_save_lock(self.path)

    def check_held(self) -> None:
        pass  # a flock is the process's until it ends

    def begin_save(self, iteration: int, token: str) -> SaveTarget:
        """``<save>/.staging.iter_XXXXXXX.<token>`` (and the save directory itself if needed)."""
        if not token or "." in token or "/" in token or os.sep in token:
            raise ValueError(f"staging token must be a non-empty string without '.' or '/', got {token!r}")
        name = f"{STAGING_PREFIX}{iteration_dirname(iteration)}.{token}"
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / name).mkdir(exist_ok=True)
        return SaveTarget(iteration, name, self.path / name)

    def upload(self, target: SaveTarget, files: list[Path], rank: int, keep: bool = False) -> None:
        """Written in place. A rank other than 0, which fsyncs the staging tree as it commits, makes its own files
        durable here: their writer started their fsyncs early (``durable.start_flush``), and an fsync error is
        reported only to the process that fsynced, so this rank must fail the save with it, before the commit."""
        if rank != 0:
            for path in files:
                fsync_file(path)

    def publish(self, target: SaveTarget, manifest_bytes: bytes, on_step: Callable[[str], None]) -> None:
        """Steps:
            1. Write the manifest into staging: still invisible (a crash leaves a staging directory that a later
               save cleans), so it needs no temp file and rename of its own.
            2. fsync the whole staging tree: the data files (rank 0's own waiting for the fsyncs their writer
               started early; the other ranks' already durable), DCP's metadata and the manifest at once, then
               the directory.
            3. If ``iter_N`` exists: rename it to ``.trash.replace.iter_N.<token>``.
            4. Rename staging to ``iter_N``; fsync the save directory (both renames become durable).
            5. Delete the trash of step 3.
        """
        staging = target.local
        if not staging.is_dir():
            raise CheckpointNotFoundError(f"staging directory {staging} does not exist; nothing to commit")
        if staging.parent.resolve() != self.path.resolve():
            raise ValueError(f"staging directory {staging} is not directly inside the save directory {self.path}")
        (staging / MANIFEST_FILENAME).write_bytes(manifest_bytes)  # 1.
        fsync_tree(staging)  # 2.
        on_step("manifest_written")
        final = self.path / iteration_dirname(target.iteration)
        trash: Path | None = None
        if final.exists():  # 3.
            trash = self.path / f"{self.STAND_IN_PREFIX}{final.name}.{uuid.uuid4().hex[:12]}"
            os.rename(final, trash)
        os.rename(staging, final)  # 4.
        fsync_dir(self.path)
        if trash is not None:  # 5.
            shutil.rmtree(trash, ignore_errors=True)
            fsync_dir(self.path)
        on_step("renamed")

    def retire(self, name: str) -> None:
        trash = self.path / f"{TRASH_PREFIX}retire.{name}.{uuid.uuid4().hex[:12]}"
        os.rename(self.path / name, trash)
        fsync_dir(self.path)
        shutil.rmtree(trash, ignore_errors=True)

    def remove(self, name: str) -> None:
        entry = self.path / name
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()

    def restore(self, stand_in: str, final: str) -> bool:
        if (self.path / final).exists():
            return False
        os.rename(self.path / stand_in, self.path / final)
        fsync_dir(self.path)
        return True

    def cleaned(self, changed: bool) -> None:
        if changed:
            fsync_dir(self.path)

    def known_missing(self) -> bool:
        return not self.path.exists()

    def new_output_problem(self, flag: str) -> str | None:
        if self.path.exists() and (not self.path.is_dir() or any(self.path.iterdir())):
            return f"{flag} {self.path} already exists and is not an empty directory"
        return None

    def discard(self, existed: bool) -> None:
        if not existed:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for child in self.path.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    # ---------------------------------------------------------------------------------------- loads
    def copy_committed(self, rel: str, iteration: int, data: bool = True, in_place: bool = False) -> CommittedCopy:
        ckpt = self.ref(rel)
        return CommittedCopy(ckpt, str(ckpt), iteration)


# ------------------------------------------------------------------------ seams for code holding a path
def new_staging_dir(save_dir: str | os.PathLike[str], iteration: int, token: str) -> Path:
    """Create and return ``<save>/.staging.iter_XXXXXXX.<token>`` (see :meth:`Directory.begin_save`)."""
    return Directory(save_dir).begin_save(iteration, token).local


def commit_staging(staging: Path, save_dir: str | os.PathLike[str], iteration: int, manifest_bytes: bytes,
                   update_tracker: bool = True, *, allow_tracker_rewind: bool = False,
                   on_step: Callable[[str], None] | None = None) -> Path:
    """Commit a fully written staging directory as ``<save>/iter_XXXXXXX`` (:func:`~.protocol.commit`)."""
    save = Directory(save_dir)
    name = protocol.commit(save, SaveTarget(iteration, Path(staging).name, Path(staging)), manifest_bytes,
                           update_tracker=update_tracker, allow_tracker_rewind=allow_tracker_rewind, on_step=on_step)
    return save.ref(name)


def resolve_checkpoint_dir(path: str | os.PathLike[str]) -> tuple[Path, int]:
    """The committed checkpoint directory ``path`` designates, and its iteration (:func:`~.protocol.resolve`)."""
    problem = local_only_problem(path)
    if problem is not None:
        raise CheckpointNotFoundError(f"checkpoint path {path} {problem}")
    loc = Directory(path)
    rel, iteration = protocol.resolve(loc)
    return loc.ref(rel), iteration


def clean_stale_staging(save_dir: str | os.PathLike[str], keep: Path | None = None) -> list[Path]:
    """Remove leftovers of interrupted saves (:func:`~.protocol.clean`); return the paths removed."""
    save = Directory(save_dir)
    if keep is not None and keep.parent.resolve() != save.path.resolve():
        keep = None
    return [save.ref(n) for n in protocol.clean(save, None if keep is None else keep.name)[1]]


def apply_retention(save_dir: str | os.PathLike[str], keep_last_k: int,
                    protect: Iterable[str | os.PathLike[str]] = ()) -> list[int]:
    """Delete committed checkpoints older than the newest ``keep_last_k`` (:func:`~.protocol.apply_retention`);
    ``protect``: checkpoint directories never deleted."""
    save = Directory(save_dir)
    kept = {it for p in protect if (it := parse_iteration_dirname(Path(p).name)) is not None
            and Path(p).resolve().parent == save.path.resolve()}
    return protocol.apply_retention(save, keep_last_k, kept)


def list_committed(save_dir: str | os.PathLike[str]) -> list[int]:
    """Sorted committed iterations of a save directory (:func:`~.protocol.list_committed`)."""
    return protocol.list_committed(Directory(save_dir))


def read_tracker(save_dir: str | os.PathLike[str]) -> int | None:
    """The tracker's iteration of a save directory (:func:`~.protocol.read_tracker`)."""
    return protocol.read_tracker(Directory(save_dir))


def write_tracker(save_dir: str | os.PathLike[str], iteration: int) -> None:
    """Atomically set the tracker of a save directory (:func:`~.protocol.write_tracker`)."""
    protocol.write_tracker(Directory(save_dir), iteration)
