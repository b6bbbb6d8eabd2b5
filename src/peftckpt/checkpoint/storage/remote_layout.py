"""The save-directory layout and crash-safe commit protocol on an object store (no rename, no fsync).

Layout (the same names as on disk, :mod:`~peftckpt.checkpoint.storage.storage_layout`)::

    <url>/latest_checkpointed_iteration.txt       the tracker object, written after a commit
    <url>/iter_0000100/...                         one checkpoint's objects
    <url>/iter_0000100/metadata.json               the manifest: its presence is what "committed" means
    <url>/.staging.iter_0000100.<token>/...        a re-save of a committed iteration, in progress

What it relies on from the store: strong read-after-write consistency for PUT, GET, LIST and DELETE (S3 has
it since 2020; so do GCS and Azure Blob), and that a PUT of one object is atomic (a reader sees the old
object or the new one, never a part). No conditional writes, no rename.

Why a crash never loses the last good checkpoint:

* Every rank uploads its files under ``iter_N/`` (a fresh iteration) or a ``.staging.`` prefix (a re-save),
  where no reader looks until the manifest is there: :func:`list_committed` only counts ``iter_*`` prefixes
  whose ``metadata.json`` exists.
* The manifest is written last, by one PUT, only after every rank's uploads were listed back with the sizes
  recorded: its appearance is the commit.
* The tracker object is rewritten only after the manifest; a crash before leaves it on the previous checkpoint.
* A re-save of a committed iteration writes the new copy, manifest included, under ``.staging.iter_N.<token>``
  first. Only then is the old copy uncommitted (its manifest deleted first), and the new objects copied into
  ``iter_N/`` server-side, manifest last. Until that copy is complete, one complete copy with its manifest
  always exists: the old one, or the staged new one, which :func:`resolve` falls back to (with a warning) and
  :func:`clean_uncommitted` finishes promoting.
* Whatever else is left by a crash (``iter_*`` or ``.staging.*`` objects without a manifest) is deleted by the
  next save's :func:`clean_uncommitted`; retention deletes a checkpoint's manifest first, so a half-deleted
  checkpoint is never taken for a committed one.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable

from peftckpt.checkpoint.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError
from peftckpt.checkpoint.storage.object_store import ObjectStore, store_error
from peftckpt.checkpoint.storage.remote_files import read_remote_manifest
from peftckpt.checkpoint.storage.storage_layout import (
    MANIFEST_FILENAME,
    STAGING_PREFIX,
    TRACKER_FILENAME,
    CheckpointFallbackWarning,
    iteration_dirname,
    parse_iteration_dirname,
    parse_tracker,
)

__all__ = ["read_tracker", "write_tracker", "list_committed", "resolve", "clean_uncommitted", "commit_target",
           "commit", "apply_retention", "is_checkpoint"]

_STAGING_RE = re.compile(r"^\.staging\.(iter_\d{7,})\.[^./]+$")


def read_tracker(store: ObjectStore) -> int | None:
    """The iteration the tracker object names, ``None`` without one (a garbled one raises, as on disk)."""
    try:
        data = store.read_bytes(TRACKER_FILENAME, 64)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise CheckpointFormatError(f"tracker {store.url_of(TRACKER_FILENAME)} is garbled: it {e}") from None
    return parse_tracker(data, store.url_of(TRACKER_FILENAME))


def write_tracker(store: ObjectStore, iteration: int) -> None:
    store.write_bytes(TRACKER_FILENAME, f"{iteration}\n".encode())


def is_checkpoint(store: ObjectStore) -> bool:
    """Whether the location itself is a committed checkpoint (holds a manifest)."""
    return store.exists(MANIFEST_FILENAME)


def _committed(store: ObjectStore, names: Iterable[str]) -> list[int]:
    found = []
    for name in names:
        iteration = parse_iteration_dirname(name)
        if iteration is not None and store.exists(f"{name}/{MANIFEST_FILENAME}"):
            found.append(iteration)
    return sorted(found)


def list_committed(store: ObjectStore) -> list[int]:
    """Iterations of the committed checkpoints of the save location, ascending."""
    return _committed(store, store.children())


def _staged_copies(store: ObjectStore, names: Iterable[str]) -> dict[str, list[str]]:
    """Complete staged re-saves (a manifest under ``.staging.iter_N.<token>``), by the ``iter_N`` they replace."""
    staged: dict[str, list[str]] = {}
    for name in names:
        match = _STAGING_RE.match(name)
        if match and store.exists(f"{name}/{MANIFEST_FILENAME}"):
            staged.setdefault(match.group(1), []).append(name)
    return staged


def resolve(store: ObjectStore) -> tuple[str, int]:
    """The committed checkpoint a load of ``store`` means: ``(relative name, iteration)``.

    ``store`` is a checkpoint (``.../iter_0000100``: name ``""``) or a save location: the tracker's iteration
    if committed, else a staged copy of it left by an interrupted re-save, else the newest committed one (both
    with a :class:`CheckpointFallbackWarning`), as :func:`~peftckpt.checkpoint.storage.storage_layout.
    resolve_checkpoint_dir` does on disk."""
    store.check_reachable()  # a missing bucket or credentials: said as such, not as "no checkpoint"
    try:
        if is_checkpoint(store):
            named = parse_iteration_dirname(store.name())
            return "", named if named is not None else read_remote_manifest(store, "")[0].iteration
        names = store.children()
        tracked = read_tracker(store)
        committed = _committed(store, names)
        if tracked is not None and tracked in committed:
            return iteration_dirname(tracked), tracked
        staged = _staged_copies(store, names)
        if tracked is not None and iteration_dirname(tracked) in staged:
            name = sorted(staged[iteration_dirname(tracked)])[-1]
            warnings.warn(f"{store.url}: iteration {tracked} was being re-saved when a save stopped; using the new "
                          f"copy staged at {store.url_of(name)}", CheckpointFallbackWarning, stacklevel=2)
            return name, tracked
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's failure, named once
        raise store_error(e, store.url, "the save location") from None
    if not committed:
        where = "" if tracked is None else f" ({TRACKER_FILENAME} names iteration {tracked})"
        raise CheckpointNotFoundError(f"no committed checkpoint in {store.url}{where}")
    newest = committed[-1]
    reason = f"there is no {TRACKER_FILENAME}" if tracked is None else \
        f"{TRACKER_FILENAME} names iteration {tracked}, which is not committed"
    warnings.warn(f"{store.url}: {reason}; using the newest committed checkpoint, iteration {newest}",
                  CheckpointFallbackWarning, stacklevel=2)
    return iteration_dirname(newest), newest


def _promote(store: ObjectStore, staged: str, final: str, on_step: Callable[[str], None] | None = None) -> None:
    """Replace ``final`` by the complete staged copy ``staged``: uncommit the old copy (manifest first), delete
    it, copy the staged objects in (manifest last), delete the staged copy."""
    if store.exists(f"{final}/{MANIFEST_FILENAME}"):
        store.delete(f"{final}/{MANIFEST_FILENAME}")
    store.delete(final)
    for name in sorted(store.list_files(staged)):
        if name != MANIFEST_FILENAME:
            store.copy(f"{staged}/{name}", f"{final}/{name}")
    if on_step is not None:
        on_step("copied")
    store.copy(f"{staged}/{MANIFEST_FILENAME}", f"{final}/{MANIFEST_FILENAME}")
    store.delete(staged)


def clean_uncommitted(store: ObjectStore) -> list[str]:
    """Before a save (one process, holding the run): finish promoting an interrupted re-save whose old copy is
    already uncommitted, then delete every ``.staging.*`` prefix and every ``iter_*`` prefix without a
    manifest. Returns the names removed or promoted."""
    names = store.children()
    done = []
    for final, staged in sorted(_staged_copies(store, names).items()):
        if not store.exists(f"{final}/{MANIFEST_FILENAME}"):
            _promote(store, sorted(staged)[-1], final)
            done.append(final)
    for name in store.children():
        if name.startswith(STAGING_PREFIX) or name.startswith(".trash.") or (
                parse_iteration_dirname(name) is not None and not store.exists(f"{name}/{MANIFEST_FILENAME}")):
            store.delete(name)
            done.append(name)
    return done


def commit_target(store: ObjectStore, iteration: int, token: str) -> str:
    """Where a save of ``iteration`` uploads: ``iter_N`` itself when it is not committed, else a staging prefix."""
    final = iteration_dirname(iteration)
    return f"{STAGING_PREFIX}{final}.{token}" if store.exists(f"{final}/{MANIFEST_FILENAME}") else final


def commit(store: ObjectStore, target: str, iteration: int, manifest_bytes: bytes, *, update_tracker: bool = True,
           allow_tracker_rewind: bool = False, on_step: Callable[[str], None] | None = None) -> str:
    """Commit the fully uploaded ``target`` as ``iter_N``; returns its URL.

    Steps:
        1. PUT the manifest into ``target``: for a fresh iteration this is the commit.
        2. For a re-save (``target`` is a staging prefix): promote it (:func:`_promote`).
        3. Move the tracker, by the rule of ``storage_layout.commit_staging``.
    """
    final = iteration_dirname(iteration)
    current = None
    if update_tracker:
        try:
            current = read_tracker(store)
        except CheckpointFormatError:
            current = None
    store.write_bytes(f"{target}/{MANIFEST_FILENAME}", manifest_bytes)  # 1
    if on_step is not None:
        on_step("manifest_written")
    if target != final:  # 2
        _promote(store, target, final)
    if on_step is not None:
        on_step("renamed")
    if update_tracker and (current is None or iteration >= current or allow_tracker_rewind):  # 3
        write_tracker(store, iteration)
    return store.url_of(final)


def apply_retention(store: ObjectStore, keep_last_k: int, protect: Iterable[int] = ()) -> list[int]:
    """Delete committed checkpoints older than the newest ``keep_last_k`` (never the newest, the tracked one or
    ``protect``); each loses its manifest first. Returns the deleted iterations."""
    committed = list_committed(store)
    try:
        tracked = read_tracker(store)
    except CheckpointFormatError:
        tracked = None
    keep = set(committed[-keep_last_k:]) | set(committed[-1:]) | set(protect) | ({tracked} - {None})
    deleted = []
    for iteration in committed:
        if iteration in keep:
            continue
        name = iteration_dirname(iteration)
        store.delete(f"{name}/{MANIFEST_FILENAME}")
        store.delete(name)
        deleted.append(iteration)
    return deleted
