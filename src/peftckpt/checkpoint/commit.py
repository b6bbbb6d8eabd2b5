"""Steps 4 and 5 of a save: the commit of a fully written staging directory.

Every rank checksums its own files; rank 0 gathers them with the key records, refuses a checkpoint that is not
whole (:func:`~peftckpt.checkpoint.checks.integrity.storage_problems`), writes the manifest, renames staging to
``iter_XXXXXXX`` and moves the tracker (:func:`~peftckpt.checkpoint.storage.storage_layout.commit_staging`), then
applies retention. A failure says exactly what it left committed and where the tracker points.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .collectives import Collectives
from .errors import CheckpointError, CheckpointIntegrityError
from .faults import fault_point
from .options import SaveOptions
from .remote import upload_own_files
from .storage import remote_layout
from .storage.checksums import ChecksummingFileSystem, checksum_files
from .storage.formats import storage_format
from .storage.manifest import Manifest
from .storage.object_store import ObjectStore, store_error
from .storage.remote_lock import RemoteLock
from .storage.save_lock import SaveDirLock
from .storage.storage_layout import apply_retention, commit_staging, read_tracker

__all__ = ["PendingCommit", "commit_checkpoint", "commit_outcome", "own_files", "upload_after_write"]


@dataclass
class PendingCommit:
    """A written (or being written) checkpoint and everything its manifest records."""

    save: Path
    staging: Path
    iteration: int
    options: SaveOptions
    kept: dict[str, Any]
    """This rank's records of the model tensors it saved, and of those it left out (trainable-only)."""
    excluded: dict[str, Any]
    planned: list[dict[str, Any]]
    """Every rank's pieces, ``{key: (global shape, [(offsets, sizes), ...])}`` per rank, as the save's plan
    check gathered them: what the commit expects to find stored."""
    sections: list[str]
    fingerprint: str | None
    layout: dict[str, int]
    coords: dict[str, int]
    model_config: dict[str, Any]
    adapter_config: dict[str, Any] | None
    args: dict[str, Any] = field(default_factory=dict)
    future: Future[Any] | None = None
    """The background write of an async save."""
    checksums: ChecksummingFileSystem | None = None
    """Digests of the DCP files, taken while they were written."""
    metadata: Any = None
    """The DCP metadata the write recorded (rank 0), checked by the commit without reading it back."""
    snapshot_taken: threading.Event | None = None
    """Set once a deferred snapshot (``SaveOptions.defer_snapshot``) is copied to host memory."""
    committed: bool = False
    error: BaseException | None = None
    """Why the save failed (an async save's handle raises it again)."""
    remote: ObjectStore | None = None
    """The object store the save goes to (``save`` and ``staging`` are then in the node-local spool)."""
    target: str = ""
    """On a store: where the ranks upload, ``iter_N`` or a re-save's staging prefix (see ``remote_layout``)."""
    uploaded: dict[str, Any] | None = None
    """On a store: this rank's uploaded files' records, once uploaded."""
    lease: SaveDirLock | RemoteLock | None = None
    """On a store, rank 0: the run's lease on the location, checked before the manifest is written."""

    @property
    def where(self) -> str:
        """The save location as the user named it (a URL on a store)."""
        return str(self.save) if self.remote is None else self.remote.url

    @property
    def final(self) -> str:
        """The committed checkpoint's path or URL."""
        name = f"iter_{self.iteration:07d}"
        return str(self.save / name) if self.remote is None else self.remote.url_of(name)


def commit_outcome(c: PendingCommit, reached: Sequence[str]) -> str:
    """What a commit that failed after the steps in ``reached`` left committed (see ``commit_staging``)."""
    final = c.final
    if "tracker" in reached:
        return (f"iteration {c.iteration} was committed as {final} and the tracker names it; only deleting "
                "older checkpoints (--keep-last-k) failed")
    if "renamed" in reached:
        try:
            tracked = f"names iteration {read_tracker(c.save) if c.remote is None else remote_layout.read_tracker(c.remote)}"
        except CheckpointError as e:
            tracked = f"is unreadable ({e})"
        return (f"iteration {c.iteration} was committed as {final}, but the tracker was not moved to it: it "
                f"still {tracked}; a load of {c.save} follows the tracker")
    return ("nothing was committed (no iter_* checkpoint has its manifest): the previously committed checkpoint and "
            "the tracker are unchanged")


def own_files(c: PendingCommit, rank: int) -> tuple[list[Path], dict[str, Any]]:
    """The files this rank wrote into staging and their records (digests taken while writing where there are)."""
    written = storage_format(c.options.ckpt_format, "SaveOptions.ckpt_format").files_written_by(
        c.staging, rank, c.coords, c.layout)
    checksum = checksum_files if c.checksums is None else c.checksums.checksums
    return written, checksum(written, c.staging)


def upload_after_write(c: PendingCommit, rank: int) -> None:
    """On a store: upload this rank's written files now (an async save's thread calls it once its write is done,
    so the upload overlaps training too)."""
    if c.remote is not None and c.uploaded is None:
        upload_own_files(c, rank, *own_files(c, rank))


def commit_checkpoint(comm: Collectives, c: PendingCommit) -> None:
    """Checksums (and on a store, the uploads), whole-checkpoint check, manifest, rename, tracker, retention
    (collective)."""
    error: BaseException | None = None
    mine: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] = ({}, c.kept, c.excluded)
    try:
        if c.remote is None:
            mine = (own_files(c, comm.rank)[1], c.kept, c.excluded)
        else:
            upload_after_write(c, comm.rank)
            assert c.uploaded is not None
            mine = (c.uploaded, c.kept, c.excluded)
    except (OSError, CheckpointError) as e:  # e.g. staging vanished: agreed below, never a hang in the gather
        error = e
    comm.agree(error, f"committing iteration {c.iteration} to {c.where} failed")
    records = comm.gather(mine)
    fault_point("before_manifest", comm.rank, c.iteration)
    reached: list[str] = []
    try:
        if comm.rank == 0:
            manifest = build_manifest(c, records)
            steps = {"manifest_written": "before_rename", "renamed": "before_tracker"}

            def on_step(step: str) -> None:
                reached.append(step)
                fault_point(steps[step], comm.rank, c.iteration)

            if c.remote is None:
                final = commit_staging(c.staging, c.save, c.iteration, manifest.to_json(), on_step=on_step)
                reached.append("tracker")
                if c.options.keep_last_k:
                    apply_retention(c.save, c.options.keep_last_k, protect=[final])
            else:
                _commit_remote(c, c.remote, manifest, on_step)
                reached.append("tracker")
    except BaseException as e:  # noqa: BLE001
        error = e
    comm.agree(error, f"committing iteration {c.iteration} to {c.where} failed",
               outcome=None if error is None else commit_outcome(c, reached))
    c.committed = True


def _commit_remote(c: PendingCommit, store: ObjectStore, manifest: Manifest, on_step: Callable[[str], None]
                   ) -> None:
    """Rank 0's part of a commit on a store: the manifest object, the tracker, retention, the empty spool."""
    if isinstance(c.lease, RemoteLock):
        c.lease.check()  # another run took the location over: commit nothing
    try:
        remote_layout.commit(store, c.target, c.iteration, manifest.to_json(), on_step=on_step)
        if c.options.keep_last_k:
            remote_layout.apply_retention(store, c.options.keep_last_k, protect=[c.iteration])
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's failure, named once
        raise store_error(e, store.url, "the commit") from None
    shutil.rmtree(c.staging, ignore_errors=True)


def build_manifest(c: PendingCommit, records: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]
                   ) -> Manifest:
    """The manifest of a fully written staging directory (rank 0), refused if the checkpoint is not whole:
    every stored tensor tiled exactly once, and every piece a rank held stored (naming the rank if not)."""
    files: dict[str, Any] = {}
    saved_keys: dict[str, Any] = {}
    excluded_keys: dict[str, Any] = {}
    held: dict[str, list[tuple[int, list[int], list[int]]]] = {}
    for f, k, x in records:
        files.update(f)
        saved_keys.update(k)
        excluded_keys.update(x)
    for rank, planned in enumerate(c.planned):
        for key, (_, boxes) in planned.items():
            held.setdefault(key, []).extend((rank, offsets, sizes) for offsets, sizes in boxes)
    checksum = checksum_files if c.checksums is None else c.checksums.checksums
    others = [p for p in c.staging.rglob("*") if p.is_file() and p.relative_to(c.staging).as_posix() not in files]
    files.update(checksum(others, c.staging))
    stored: dict[str, int] | None = None
    if c.remote is not None:  # rank 0's own other files (DCP's .metadata), then what the store holds
        upload_own_files(c, 0, others, {}, keep=True)
        try:
            stored = c.remote.list_files(c.target)
        except Exception as e:  # noqa: BLE001
            raise store_error(e, c.remote.url_of(c.target), "the uploaded checkpoint") from None
    problems = storage_format(c.options.ckpt_format, "SaveOptions.ckpt_format").written_problems(
        c.staging, files, saved_keys, held, stored, c.metadata)
    if c.remote is not None and stored is not None:
        problems += [f"{c.remote.url_of(f'{c.target}/{rel}')}: uploaded with {stored.get(rel, 'no')} bytes, "
                     f"{rec['size']} were written" for rel, rec in sorted(files.items()) if stored.get(rel) != rec["size"]]
    if problems:
        raise CheckpointIntegrityError("the written checkpoint is not whole, so it is not committed:\n  "
                                       + "\n  ".join(problems))
    return Manifest(
        format=c.options.ckpt_format, iteration=c.iteration, sections=c.sections, layout=c.layout,
        model_config=c.model_config, trainable_only=c.options.trainable_only, saved_keys=saved_keys,
        excluded_keys=excluded_keys, adapter_config=c.adapter_config, base_fingerprint=c.fingerprint,
        files=files, args=c.args,
    )
