"""Steps 4 and 5 of a save: the commit of a fully written save.

Every rank checksums its own files (and hands them to the location: a store uploads them); rank 0 gathers them with
the key records, refuses a checkpoint that is not whole (:func:`~peftckpt.checkpoint.checks.integrity.
storage_problems`), and commits it by the protocol (:func:`~peftckpt.checkpoint.location.protocol.commit`: the
manifest last, then the tracker), then applies retention. A failure says exactly what it left committed and where
the tracker points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .collectives import Collectives
from .errors import CheckpointError, CheckpointIntegrityError
from .faults import fault_point
from .location import protocol
from .location.base import Location, SaveTarget
from .location.names import iteration_dirname
from .options import SaveOptions
from .state.fingerprint import FINGERPRINT_VERSION
from .storage.checksums import checksum_files
from .storage.formats import Written, storage_format
from .storage.manifest import Manifest
from .storage.plan_memo import PlanMemo

__all__ = ["PendingCommit", "commit_checkpoint", "commit_outcome", "hand_over_files"]


@dataclass
class PendingCommit:
    """A written (or being written) checkpoint and everything its manifest records."""

    location: Location
    target: SaveTarget
    """Where the ranks write (set by the save's step 2, once it exists)."""
    options: SaveOptions
    kept: dict[str, Any]
    """This rank's records of the model tensors it saved, and of those it left out (trainable-only)."""
    excluded: dict[str, Any]
    plans: PlanMemo
    """The save's layout and plans (reused from the last save laid out the same way, or this save's own)."""
    sections: list[str]
    fingerprint: str | None
    layout: dict[str, int]
    coords: dict[str, int]
    model_config: dict[str, Any]
    adapter_config: dict[str, Any] | None
    args: dict[str, Any] = field(default_factory=dict)
    base_sums: dict[str, list[int]] = field(default_factory=dict)
    """The frozen base's per-key fingerprint sums the checkpointer knows (recorded by a full save)."""
    written: Written = field(default_factory=Written)
    """What this rank's write produced (digests, DCP metadata; an async write's future)."""
    handed_over: dict[str, Any] | None = None
    """This rank's files' records, once handed to the location (:func:`hand_over_files`)."""
    committed: bool = False
    error: BaseException | None = None
    """Why the save failed (an async save's handle raises it again)."""

    @property
    def iteration(self) -> int:
        return self.target.iteration

    @property
    def staging(self) -> Path:
        """The local directory this host's ranks write into."""
        return self.target.local

    @property
    def where(self) -> str:
        """The save location as the user named it."""
        return self.location.text

    @property
    def final(self) -> str:
        """The committed checkpoint's path or URL."""
        return self.location.describe(iteration_dirname(self.iteration))


def commit_outcome(c: PendingCommit, reached: Sequence[str]) -> str:
    """What a commit that failed after the steps in ``reached`` left committed (see ``protocol.commit``)."""
    if "tracker" in reached:
        return (f"iteration {c.iteration} was committed as {c.final} and the tracker names it; only deleting "
                "older checkpoints (keep_last_k) failed")
    # Published: renamed, or -- where a fresh iteration is written in place -- its manifest written.
    if "renamed" in reached or ("manifest_written" in reached and c.target.name == iteration_dirname(c.iteration)):
        try:
            tracked = f"names iteration {protocol.read_tracker(c.location)}"
        except CheckpointError as e:
            tracked = f"is unreadable ({e})"
        return (f"iteration {c.iteration} was committed as {c.final}, but the tracker was not moved to it: it "
                f"still {tracked}; a load of {c.where} follows the tracker")
    return ("nothing was committed (no iter_* checkpoint has its manifest): the previously committed checkpoint and "
            "the tracker are unchanged")


def _own_files(c: PendingCommit, rank: int) -> tuple[list[Path], dict[str, Any]]:
    """The files this rank wrote into the staging directory, and the records of those and of the files it streamed
    to the location (digests taken while writing where there are)."""
    local = storage_format(c.options.ckpt_format, "SaveOptions.ckpt_format").files_written_by(
        c.staging, rank, c.coords, c.layout)
    if c.written.checksums is None:
        return local, checksum_files(local, c.staging)
    return local, c.written.checksums.checksums([*local, *c.written.checksums.streamed], c.staging)


def hand_over_files(c: PendingCommit, rank: int) -> dict[str, Any]:
    """This rank's written files, checksummed and handed to the location (a store uploads those it did not
    stream already; an async save's thread calls it once its write is done, so an upload overlaps training too);
    their records."""
    if c.handed_over is None:
        files, records = _own_files(c, rank)
        c.location.upload(c.target, files, rank)
        c.handed_over = records
    return c.handed_over


def commit_checkpoint(comm: Collectives, c: PendingCommit) -> None:
    """Checksums (and uploads), whole-checkpoint check, manifest, tracker, retention (collective); committed or
    failed, the save is no longer in progress (:func:`~peftckpt.checkpoint.location.protocol.claim`)."""
    try:
        _commit(comm, c)
    finally:
        protocol.unclaim(c.location, c.target.name)
        protocol.unclaim(c.location, c.target.local.name)


def _commit(comm: Collectives, c: PendingCommit) -> None:
    error: BaseException | None = None
    mine: tuple[dict[str, Any], dict[str, Any], dict[str, Any]] = ({}, c.kept, c.excluded)
    try:
        mine = (hand_over_files(c, comm.rank), c.kept, c.excluded)
    except (OSError, CheckpointError) as e:  # e.g. staging vanished: agreed below, never a hang in the gather
        error = e
    comm.agree(error, f"committing iteration {c.iteration} to {c.where} failed")
    records = comm.gather(mine)
    reached: list[str] = []
    try:
        fault_point("before_manifest", comm.rank, c.iteration)  # inside: a failure here is agreed, never a hang
        if comm.rank == 0:
            manifest = build_manifest(c, records)
            steps = {"manifest_written": "before_rename", "renamed": "before_tracker"}

            iteration = c.iteration

            def on_step(step: str) -> None:  # called back by the location at each step it reaches
                reached.append(step)
                fault_point(steps[step], comm.rank, iteration)

            protocol.commit(c.location, c.target, manifest.to_json(), on_step=on_step)
            reached.append("tracker")
            if c.options.keep_last_k:
                protocol.apply_retention(c.location, c.options.keep_last_k, protect=[c.iteration])
    except BaseException as e:  # noqa: BLE001
        error = e
    comm.agree(error, f"committing iteration {c.iteration} to {c.where} failed",
               outcome=None if error is None else commit_outcome(c, reached))
    c.committed = True


def build_manifest(c: PendingCommit, records: list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]
                   ) -> Manifest:
    """The manifest of a fully written save (rank 0), refused if the checkpoint is not whole: every stored tensor
    tiled exactly once, and every piece a rank held stored (naming the rank if not)."""
    files: dict[str, Any] = {}
    saved_keys: dict[str, Any] = {}
    excluded_keys: dict[str, Any] = {}
    for f, k, x in records:
        files.update(f)
        saved_keys.update(k)
        excluded_keys.update(x)
    checksum = checksum_files if c.written.checksums is None else c.written.checksums.checksums
    others = [p for p in c.staging.rglob("*") if p.is_file() and p.relative_to(c.staging).as_posix() not in files]
    files.update(checksum(others, c.staging))
    c.location.upload(c.target, others, 0, keep=True)  # rank 0's other files (DCP's .metadata), kept for the checks
    stored = c.location.stored_sizes(c.target)
    problems = storage_format(c.options.ckpt_format, "SaveOptions.ckpt_format").written_problems(
        c.staging, files, saved_keys, c.plans, stored, c.written.metadata)
    if stored is not None:
        problems += [f"{c.location.describe(f'{c.target.name}/{rel}')}: uploaded with {stored.get(rel, 'no')} bytes, "
                     f"{rec['size']} were written" for rel, rec in sorted(files.items()) if stored.get(rel) != rec["size"]]
    if problems:
        raise CheckpointIntegrityError("the written checkpoint is not whole, so it is not committed:\n  "
                                       + "\n  ".join(problems))
    return Manifest(
        format=c.options.ckpt_format, iteration=c.iteration, sections=c.sections, layout=c.layout,
        model_config=c.model_config, trainable_only=c.options.trainable_only, saved_keys=saved_keys,
        excluded_keys=excluded_keys, adapter_config=c.adapter_config, base_fingerprint=c.fingerprint,
        base_sums=None if excluded_keys else ({k: [FINGERPRINT_VERSION, *v] for k, v in sorted(c.base_sums.items())
                                              if k in saved_keys} or None),
        files=files, args=c.args,
    )
