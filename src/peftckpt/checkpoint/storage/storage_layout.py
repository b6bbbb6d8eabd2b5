"""On-disk layout of a save directory and the crash-safe commit protocol.

Layout::

    <save>/latest_checkpointed_iteration.txt   "100": the tracker, rewritten atomically after a commit
    <save>/iter_0000100/                       one committed checkpoint
    <save>/iter_0000100/metadata.json          the manifest; its presence is what "committed" means
    <save>/.staging.iter_0000100.<token>/      a save in progress (hidden, never matches ``iter_*``)
    <save>/.trash.replace.iter_0000100.<token> the previous copy of an iteration being re-saved
    <save>/.trash.retire.iter_0000090.<token>  a checkpoint being deleted by retention
    <save>/.peftckpt.lock                      the run lock (see :mod:`peftckpt.checkpoint.storage.save_lock`)

Everything here is single-process filesystem work; the orchestration calls it from the one rank that
commits. Nothing here touches ``torch.distributed``.

Why a crash never loses the last good checkpoint:

* A checkpoint is written into a staging directory, so an interrupted write leaves only a hidden
  ``.staging.*`` directory that no reader considers (:func:`list_committed` only looks at ``iter_*``
  directories that contain a manifest).
* The manifest is written last (temp file + fsync + rename) and the whole staging tree is fsynced before
  the rename to ``iter_XXXXXXX``, so a directory that is visible under its committed name always has all
  of its bytes on disk.
* The tracker is rewritten (temp + fsync + ``os.replace`` + fsync of the directory) only after the rename
  is durable; a crash before that leaves the tracker pointing at the previous, still complete checkpoint.
* Re-saving an existing iteration, see :func:`commit_staging` for the step-by-step argument.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path

from peftckpt.checkpoint.errors import CheckpointFormatError, CheckpointNotFoundError
from peftckpt.checkpoint.storage.paths import read_regular_file, url_problem

__all__ = [
    "TRACKER_FILENAME",
    "MANIFEST_FILENAME",
    "LOCK_FILENAME",
    "STAGING_PREFIX",
    "TRASH_PREFIX",
    "CheckpointFallbackWarning",
    "iteration_dirname",
    "parse_iteration_dirname",
    "fsync_file",
    "fsync_dir",
    "fsync_tree",
    "atomic_write_bytes",
    "read_tracker",
    "parse_tracker",
    "write_tracker",
    "new_staging_dir",
    "clean_stale_staging",
    "recover_interrupted_replace",
    "commit_staging",
    "list_committed",
    "resolve_checkpoint_dir",
    "apply_retention",
]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Name of the tracker file in a save directory; it holds the latest committed iteration as text."""

MANIFEST_FILENAME = "metadata.json"
"""Name of the JSON manifest inside a checkpoint directory; its presence marks the directory committed."""

LOCK_FILENAME = ".peftckpt.lock"
"""The run lock of a save directory (hidden: never an ``iter_*``, staging or trash name)."""

STAGING_PREFIX = ".staging."
"""Prefix of in-progress save directories (hidden; never parsed as a committed checkpoint)."""

TRASH_PREFIX = ".trash."
"""Prefix of directories being deleted (a replaced old copy, or a checkpoint retired by retention)."""

_REPLACE_TAG = "replace"
_RETIRE_TAG = "retire"
_ITER_DIGITS = 7
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_REPLACE_TRASH_RE = re.compile(r"^\.trash\.replace\.(iter_\d{7,})\.[^.]+$")


class CheckpointFallbackWarning(UserWarning):
    """:func:`resolve_checkpoint_dir` did not use the tracker's iteration (absent, or not committed)."""


# --------------------------------------------------------------------------------------------- names


def iteration_dirname(iteration: int) -> str:
    """Name of the directory of ``iteration``: ``iter_0000100`` (7 digits, more if needed)."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:0{_ITER_DIGITS}d}"


def parse_iteration_dirname(name: str) -> int | None:
    """Iteration encoded in a committed-checkpoint directory name, or ``None`` if ``name`` is not one."""
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------- fsync


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush one file's data and metadata to stable storage."""
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
    """fsync every file and every directory under ``path`` (and ``path`` itself), children first."""
    for dirpath, _dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
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


# ------------------------------------------------------------------------------------------- tracker


_TRACKER_RE = re.compile(rb"[ \t\r\n]*([0-9]{1,30})[ \t\r\n]*")
_TRACKER_MAX_BYTES = 64


def read_tracker(save_dir: str | os.PathLike[str]) -> int | None:
    """Iteration recorded in the tracker of ``save_dir``, or ``None`` when there is no tracker.

    A tracker holds plain ASCII decimal digits (surrounding whitespace allowed); anything else -- other
    Unicode digits such as ``٤``, bytes that are not UTF-8, a directory or FIFO in its place -- is garbled.

    Raises:
        CheckpointFormatError: the tracker exists but is garbled.
    """
    tracker = Path(save_dir) / TRACKER_FILENAME
    hint = "fix or delete it (the newest committed iter_* directory is used when it is absent)"
    try:
        data = read_regular_file(tracker, _TRACKER_MAX_BYTES)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"tracker file {tracker} is garbled: it {exc}; {hint}") from None
    return parse_tracker(data, tracker)


def parse_tracker(data: bytes, source: object) -> int:
    """The iteration in a tracker's bytes, read from ``source`` (named in the error)."""
    hint = "fix or delete it (the newest committed iter_* directory is used when it is absent)"
    match = _TRACKER_RE.fullmatch(data)
    if match is None:
        raise CheckpointFormatError(
            f"tracker file {source} is garbled: expected a non-negative iteration number in ASCII digits, "
            f"got {data[:40]!r}; {hint}"
        )
    return int(match.group(1))


def write_tracker(save_dir: str | os.PathLike[str], iteration: int) -> None:
    """Atomically set the tracker of ``save_dir`` to ``iteration`` (temp + fsync + rename + fsync dir)."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    atomic_write_bytes(Path(save_dir) / TRACKER_FILENAME, f"{iteration}\n".encode())


# ------------------------------------------------------------------------------------------- staging


def new_staging_dir(save_dir: str | os.PathLike[str], iteration: int, token: str) -> Path:
    """Create and return ``<save>/.staging.iter_XXXXXXX.<token>`` (and ``save_dir`` itself if needed).

    ``token`` must be the same on every rank of one save (e.g. broadcast from rank 0) and unique across
    saves; it may not contain ``.`` or ``/``.
    """
    if not token or "." in token or "/" in token or os.sep in token:
        raise ValueError(f"staging token must be a non-empty string without '.' or '/', got {token!r}")
    save = Path(save_dir)
    save.mkdir(parents=True, exist_ok=True)
    staging = save / f"{STAGING_PREFIX}{iteration_dirname(iteration)}.{token}"
    staging.mkdir(exist_ok=True)
    return staging


def _has_manifest(path: Path) -> bool:
    return (path / MANIFEST_FILENAME).is_file()


def _replace_trash_for(save: Path, dirname: str) -> list[Path]:
    """Old copies of ``dirname`` left by an interrupted re-save that still hold their manifest."""
    found = []
    for entry in save.iterdir():
        match = _REPLACE_TRASH_RE.match(entry.name)
        if match and match.group(1) == dirname and entry.is_dir() and _has_manifest(entry):
            found.append(entry)
    return sorted(found)


def recover_interrupted_replace(save_dir: str | os.PathLike[str]) -> list[Path]:
    """Move back the old copy of an iteration whose re-save crashed between its two renames.

    Returns the restored ``iter_*`` paths. See :func:`commit_staging` for when this state arises.
    """
    save = Path(save_dir)
    if not save.is_dir():
        return []
    restored = []
    for entry in sorted(save.iterdir()):
        match = _REPLACE_TRASH_RE.match(entry.name)
        if not match or not entry.is_dir() or not _has_manifest(entry):
            continue
        committed = save / match.group(1)
        if committed.exists():
            continue
        os.rename(entry, committed)
        fsync_dir(save)
        restored.append(committed)
    return restored


def clean_stale_staging(save_dir: str | os.PathLike[str], keep: Path | None = None) -> list[Path]:
    """Remove leftover staging and trash directories of interrupted saves; return what was removed.

    Steps:
        1. :func:`recover_interrupted_replace`: an old copy whose committed name is vacant goes back.
        2. Delete every ``.staging.*`` directory except ``keep`` (the save in progress, if any).
        3. Delete every remaining ``.trash.*`` directory.

    Call it from the committing rank at the start of a save, before any rank writes; if the staging
    directory of the current save already exists, pass it as ``keep``.
    """
    save = Path(save_dir)
    if not save.is_dir():
        return []
    recover_interrupted_replace(save)
    keep_resolved = keep.resolve() if keep is not None else None
    removed = []
    for entry in sorted(save.iterdir()):
        if not entry.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            continue
        if keep_resolved is not None and entry.resolve() == keep_resolved:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        removed.append(entry)
    if removed:
        fsync_dir(save)
    return removed


# -------------------------------------------------------------------------------------------- commit


def commit_staging(
    staging: Path,
    save_dir: str | os.PathLike[str],
    iteration: int,
    manifest_bytes: bytes,
    update_tracker: bool = True,
    *,
    allow_tracker_rewind: bool = False,
    on_step: Callable[[str], None] | None = None,
) -> Path:
    """Commit a fully written staging directory as ``<save>/iter_XXXXXXX`` and return that path.

    Call only after every rank has finished (and fsynced) its files in ``staging``.

    Steps:
        1. Write the manifest into ``staging`` (temp + fsync + rename): from here on the staging
           directory is complete, but still invisible to readers.
        2. fsync the whole staging tree.
        3. If ``iter_XXXXXXX`` already exists: rename it to ``.trash.replace.iter_XXXXXXX.<token>``.
        4. Rename staging to ``iter_XXXXXXX``; fsync the save directory (both renames become durable).
        5. Delete the trash directory of step 3.
        6. Update the tracker (rule below).

    Crash argument for a re-save (steps 3-5): before step 3 the old copy is in place. Between 3 and 4 the
    committed name is vacant, but the old copy keeps its manifest under a ``.trash.replace.`` name:
    :func:`resolve_checkpoint_dir` still finds it there (with a warning) and the next save's
    :func:`clean_stale_staging` renames it back before deleting the unfinished staging directory. After
    step 4 the new copy is committed and the trash is garbage whatever its state (a half-deleted trash
    directory is removed by the next :func:`clean_stale_staging`). POSIX ``rename`` cannot replace a
    non-empty directory in one step, hence the two renames.

    Tracker rule: with ``update_tracker`` the tracker is written when there is none or when ``iteration``
    is >= its current value; a smaller iteration leaves it alone (the tracker keeps naming the newest
    checkpoint, e.g. when a late save of an older iteration lands) unless ``allow_tracker_rewind`` is set,
    which the caller uses when it deliberately resumed from an older iteration and wants resumption to
    follow the new branch.
    """
    save = Path(save_dir)
    staging = Path(staging)
    if not staging.is_dir():
        raise CheckpointNotFoundError(f"staging directory {staging} does not exist; nothing to commit")
    if staging.parent.resolve() != save.resolve():
        raise ValueError(f"staging directory {staging} is not directly inside the save directory {save}")

    # Before anything changes: a tracker that cannot be replaced (a directory in its place) must not be
    # found only after an existing iter_N was replaced. A garbled file is overwritten by a valid one.
    tracker = save / TRACKER_FILENAME
    if update_tracker and (tracker.is_symlink() or (tracker.exists() and not tracker.is_file())):
        raise CheckpointFormatError(f"tracker {tracker} is not a regular file, so it cannot be updated; remove "
                                    "it (nothing was committed)")
    try:
        current = read_tracker(save)
    except CheckpointFormatError:
        current = None

    atomic_write_bytes(staging / MANIFEST_FILENAME, manifest_bytes)  # 1
    fsync_tree(staging)  # 2
    if on_step is not None:
        on_step("manifest_written")

    final = save / iteration_dirname(iteration)
    trash: Path | None = None
    if final.exists():  # 3
        trash = save / f"{TRASH_PREFIX}{_REPLACE_TAG}.{final.name}.{uuid.uuid4().hex[:12]}"
        os.rename(final, trash)
    os.rename(staging, final)  # 4
    fsync_dir(save)
    if trash is not None:  # 5
        shutil.rmtree(trash, ignore_errors=True)
        fsync_dir(save)
    if on_step is not None:
        on_step("renamed")

    if update_tracker:  # 6
        if current is None or iteration >= current or allow_tracker_rewind:
            write_tracker(save, iteration)
    return final


# ------------------------------------------------------------------------------------------- readers


def list_committed(save_dir: str | os.PathLike[str]) -> list[int]:
    """Sorted iterations of ``save_dir`` whose ``iter_*`` directory holds a manifest (i.e. committed)."""
    save = Path(save_dir)
    if not save.is_dir():
        return []
    found = []
    for entry in save.iterdir():
        iteration = parse_iteration_dirname(entry.name)
        if iteration is not None and entry.is_dir() and _has_manifest(entry):
            found.append(iteration)
    return sorted(found)


def _iteration_of_direct_dir(path: Path) -> int:
    parsed = parse_iteration_dirname(path.name)
    if parsed is not None:
        return parsed
    match = _REPLACE_TRASH_RE.match(path.name)
    if match:
        parsed = parse_iteration_dirname(match.group(1))
        if parsed is not None:
            return parsed
    manifest = path / MANIFEST_FILENAME
    try:
        value = json.loads(manifest.read_bytes()).get("iteration")
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointFormatError(f"cannot read the iteration from manifest {manifest}: {exc}") from exc
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointFormatError(f"manifest {manifest} has no valid 'iteration' (got {value!r})")
    return value


def _looks_like_save_dir(path: Path) -> bool:
    for entry in path.iterdir():
        name = entry.name
        if name in (TRACKER_FILENAME, LOCK_FILENAME) or name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            return True
        if parse_iteration_dirname(name) is not None:
            return True
    return False


def resolve_checkpoint_dir(path: str | os.PathLike[str]) -> tuple[Path, int]:
    """Find the committed checkpoint that ``path`` designates; return ``(directory, iteration)``.

    ``path`` is either a checkpoint directory (holding a manifest) or a save directory. For a save
    directory the tracker's iteration is used when that directory is committed. Otherwise (no tracker, or
    it points at a missing/uncommitted directory) the newest committed ``iter_*`` directory is used and a
    :class:`CheckpointFallbackWarning` says so; if the tracker's iteration only survives as the old copy
    of an interrupted re-save (see :func:`commit_staging`), that copy is returned, also with a warning.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist, is an uncommitted ``iter_*``/staging directory,
            or is a save directory without any committed checkpoint.
        CheckpointFormatError: ``path`` exists but is neither a checkpoint nor a save directory, or its
            tracker is garbled.
    """
    problem = url_problem(path)
    if problem is not None:
        raise CheckpointNotFoundError(f"checkpoint path {path} {problem}")
    target = Path(path)
    if not target.exists():
        raise CheckpointNotFoundError(f"checkpoint path {target} does not exist")
    if not target.is_dir():
        raise CheckpointFormatError(
            f"{target} is a file, not a checkpoint directory or a save directory; pass the directory"
        )
    is_staging = target.name.startswith(STAGING_PREFIX)  # complete or not, staging is never committed
    if _has_manifest(target) and not is_staging:
        return target, _iteration_of_direct_dir(target)
    if parse_iteration_dirname(target.name) is not None or is_staging:
        why = "it is the staging directory of a save" if is_staging else f"it has no {MANIFEST_FILENAME}"
        raise CheckpointNotFoundError(
            f"{target} is not a committed checkpoint ({why}): a save was interrupted before its commit; "
            f"load the save directory {target.parent} to get the last committed one"
        )

    tracked = read_tracker(target)
    committed = list_committed(target)
    if tracked is not None:
        if tracked in committed:
            return target / iteration_dirname(tracked), tracked
        old_copies = _replace_trash_for(target, iteration_dirname(tracked))
        if old_copies:
            warnings.warn(
                f"{target}: iteration {tracked} named by {TRACKER_FILENAME} was being re-saved when the "
                f"save crashed; using its previous copy {old_copies[-1]} (the next save restores it)",
                CheckpointFallbackWarning,
                stacklevel=2,
            )
            return old_copies[-1], tracked
    if not committed:
        if tracked is not None or _looks_like_save_dir(target) or not any(target.iterdir()):
            where = "" if tracked is None else f" ({TRACKER_FILENAME} names iteration {tracked})"
            raise CheckpointNotFoundError(f"no committed checkpoint in {target}{where}")
        raise CheckpointFormatError(
            f"{target} is neither a peftckpt checkpoint (no {MANIFEST_FILENAME}) nor a save directory "
            f"(no {TRACKER_FILENAME}, no iter_* directories)"
        )
    newest = committed[-1]
    reason = (
        f"there is no {TRACKER_FILENAME}"
        if tracked is None
        else f"{TRACKER_FILENAME} names iteration {tracked}, which is not committed"
    )
    warnings.warn(
        f"{target}: {reason}; using the newest committed checkpoint, iteration {newest}",
        CheckpointFallbackWarning,
        stacklevel=2,
    )
    return target / iteration_dirname(newest), newest


# ----------------------------------------------------------------------------------------- retention


def apply_retention(
    save_dir: str | os.PathLike[str], keep_last_k: int, protect: Iterable[Path] = ()
) -> list[int]:
    """Delete committed checkpoints older than the newest ``keep_last_k``; return the deleted iterations.

    Never deleted: the newest committed checkpoint, the one the tracker names, any directory in
    ``protect`` (e.g. the checkpoint this run resumed from, or one an async save still reads), and
    staging/trash directories (those belong to :func:`clean_stale_staging`).

    A deletion first renames the directory to a ``.trash.retire.`` name (one atomic step, after which it
    is no longer committed), then removes it, so a crash mid-delete never leaves a half-deleted directory
    that still looks committed.
    """
    if keep_last_k <= 0:
        raise ValueError(f"keep_last_k must be >= 1, got {keep_last_k}")
    save = Path(save_dir)
    committed = list_committed(save)
    if not committed:
        return []
    try:
        tracked = read_tracker(save)
    except CheckpointFormatError:
        tracked = None
    protected = {Path(p).resolve() for p in protect}
    keep = set(committed[-keep_last_k:]) | {committed[-1]}
    if tracked is not None:
        keep.add(tracked)
    deleted = []
    for iteration in committed:
        ckpt = save / iteration_dirname(iteration)
        if iteration in keep or ckpt.resolve() in protected:
            continue
        trash = save / f"{TRASH_PREFIX}{_RETIRE_TAG}.{ckpt.name}.{uuid.uuid4().hex[:12]}"
        os.rename(ckpt, trash)
        fsync_dir(save)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(iteration)
    if deleted:
        fsync_dir(save)
    return deleted
