"""Offline integrity check of a checkpoint (no process group, no torchrun; ``peftckpt verify DIR`` is
:mod:`peftckpt.cli.verify`).

:func:`verify_all` checks every committed checkpoint of a save location (``peftckpt verify --all``), and
:func:`newest_intact_before` finds the checkpoint a load that met a damaged one can go back to.

Steps of :func:`verify_checkpoint`:
    1. Resolve ``DIR`` (a save directory via its tracker, or a checkpoint directory).
    2. Read and validate the JSON manifest.
    3. Check every file against the manifest's sizes and checksums, and look for unlisted files.
    4. For ``torch_dist``: load DCP's ``.metadata`` through the restricted unpickler and check that the
       checkpoint is whole (:func:`~peftckpt.checkpoint.checks.integrity.storage_problems`): every storage item in a
       listed regular file and inside it, every tensor covered exactly once, every recorded key stored with
       its recorded shape and dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from peftckpt.checkpoint.checks.integrity import DCP_METADATA_FILENAME
from peftckpt.checkpoint.checks.load_checks import EarlierCheckpoints
from peftckpt.checkpoint.errors import CheckpointError, CheckpointNotFoundError, UnsafeCheckpointError
from peftckpt.checkpoint.location import protocol
from peftckpt.checkpoint.location.base import CommittedCopy, Location
from peftckpt.checkpoint.location.locate import locate
from peftckpt.checkpoint.location.names import iteration_dirname
from peftckpt.checkpoint.storage.checksums import verify_files
from peftckpt.checkpoint.storage.formats import storage_format
from peftckpt.checkpoint.storage.manifest import read_manifest

__all__ = ["DCP_METADATA_FILENAME", "VerifyReport", "verify_checkpoint", "LocationReport", "verify_all",
           "newest_intact_before", "EARLIER_CANDIDATES"]


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`."""

    path: Path | str
    """The checkpoint directory that was checked (after resolving a save directory)."""
    iteration: int
    """Its iteration."""
    problems: list[str] = field(default_factory=list)
    """One human-readable line per problem; empty when the checkpoint is intact."""
    num_files: int = 0
    """Number of files the manifest lists."""
    total_bytes: int = 0
    """Sum of their recorded sizes."""

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (``peftckpt verify --json``)."""
        return {
            "path": str(self.path),
            "iteration": self.iteration,
            "ok": self.ok,
            "problems": list(self.problems),
            "num_files": self.num_files,
            "total_bytes": self.total_bytes,
        }


def verify_checkpoint(path: str | os.PathLike[str] | Location) -> VerifyReport:
    """Check a checkpoint offline; see the module docstring for the steps.

    Raises:
        CheckpointNotFoundError / CheckpointFormatError: ``path`` holds no committed checkpoint, or its
            manifest is unreadable (then nothing else can be checked). Damage to the checkpoint's other
            files is reported in :attr:`VerifyReport.problems`, not raised.
    """
    # 1 (on a store: the small files fetched, every object hashed as it streams -- the data objects not copied)
    copy = protocol.committed_copy(locate(path, "DIR"), data=False)
    try:
        return _verify_copy(copy)
    finally:
        copy.release()


def _verify_copy(copy: CommittedCopy) -> VerifyReport:
    """Steps 2-4 of :func:`verify_checkpoint` on the resolved checkpoint."""
    manifest = copy.manifest if copy.manifest is not None else read_manifest(copy.local)  # 2
    report = VerifyReport(path=copy.url if copy.verified else copy.local, iteration=copy.iteration,
                          num_files=len(manifest.files), total_bytes=manifest.total_bytes)
    found = []
    if manifest.iteration != copy.iteration:
        found.append(f"{copy.local}: manifest says iteration {manifest.iteration} but the directory is iteration "
                     f"{copy.iteration}")
    if not copy.verified:
        found.extend(verify_files(copy.local, manifest))  # 3
    try:  # 4
        found.extend(storage_format(manifest.format, f"checkpoint {copy.url}").structure_problems(
            copy.local, manifest, copy.listed))
    except UnsafeCheckpointError as exc:
        found.append(str(exc))
    report.problems = list(dict.fromkeys(copy.with_local_problems(found)))  # a missing file is found by 3 and 4
    return report


@dataclass
class LocationReport:
    """Outcome of :func:`verify_all`: every committed checkpoint of a save location, newest first."""

    path: str
    """The save location, as messages name it."""
    checkpoints: list[VerifyReport]
    tracker: int | None = None
    """The iteration the tracker names (``None``: no tracker, or a garbled one: see :attr:`tracker_problem`)."""
    tracker_problem: str | None = None

    @property
    def ok(self) -> bool:
        """True when every committed checkpoint is intact (and the tracker readable)."""
        return self.tracker_problem is None and all(r.ok for r in self.checkpoints)

    @property
    def newest_intact(self) -> VerifyReport | None:
        return next((r for r in self.checkpoints if r.ok), None)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (``peftckpt verify --all --json``); each checkpoint as ``verify --json`` prints it."""
        newest = self.newest_intact
        return {
            "path": self.path,
            "ok": self.ok,
            "tracker": self.tracker,
            "tracker_problem": self.tracker_problem,
            "newest_intact": None if newest is None else str(newest.path),
            "checkpoints": [r.to_dict() for r in self.checkpoints],
        }


def _verify_named(loc: Location, iteration: int) -> VerifyReport:
    """:func:`verify_checkpoint` of ``loc``'s committed ``iteration``; a checkpoint whose manifest cannot be read
    is a report with that one problem, not an error."""
    name = iteration_dirname(iteration)
    try:
        return verify_checkpoint(loc.sub(name))
    except CheckpointError as exc:
        return VerifyReport(path=loc.describe(name), iteration=iteration, problems=[str(exc)])


def verify_all(path: str | os.PathLike[str] | Location) -> LocationReport:
    """Verify every committed checkpoint of the save location ``path``, newest first (as :func:`verify_checkpoint`
    does one: every file hashed against its manifest; on a store each one fetched and deleted in turn).

    Raises:
        CheckpointNotFoundError / CheckpointFormatError: ``path`` does not exist or holds no committed checkpoint,
            or two of its names stand for one iteration.
    """
    loc = locate(path, "DIR")
    loc.check_readable()
    committed = protocol.list_committed(loc)
    if not committed:
        raise CheckpointNotFoundError(f"no committed checkpoint in {loc.text}")
    report = LocationReport(path=loc.text, checkpoints=[_verify_named(loc, it) for it in reversed(committed)])
    try:
        report.tracker = protocol.read_tracker(loc)
    except CheckpointError as exc:
        report.tracker_problem = str(exc)
    return report


EARLIER_CANDIDATES = 3
"""How many earlier checkpoints :func:`newest_intact_before` verifies at most (each one is read whole)."""


def newest_intact_before(save: Location, iteration: int, limit: int = EARLIER_CANDIDATES) -> EarlierCheckpoints:
    """The newest committed checkpoint of ``save`` before ``iteration`` whose files all verify against its
    manifest: the candidates are verified newest first, at most ``limit`` of them, stopping at the first intact
    one. Raises only what listing ``save`` raises."""
    earlier = [it for it in reversed(protocol.list_committed(save)) if it < iteration]
    found = EarlierCheckpoints(location=save.text, unchecked=max(0, len(earlier) - limit))
    for it in earlier[:limit]:
        if _verify_named(save, it).ok:
            found.intact, found.intact_iteration = str(save.ref(iteration_dirname(it))), it
            found.unchecked = 0
            break
        found.damaged.append(it)
    return found
