"""Offline integrity check of a checkpoint (no process group, no torchrun; ``peftckpt verify DIR`` is
:mod:`peftckpt.cli.verify`).

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
from peftckpt.checkpoint.errors import UnsafeCheckpointError
from peftckpt.checkpoint.location.base import Location
from peftckpt.checkpoint.location.locate import locate
from peftckpt.checkpoint.storage.checksums import verify_files
from peftckpt.checkpoint.storage.formats import storage_format
from peftckpt.checkpoint.storage.manifest import read_manifest

__all__ = ["DCP_METADATA_FILENAME", "VerifyReport", "verify_checkpoint"]

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
    copy = locate(path, "DIR").committed_copy()  # 1 (on a store: fetched, every object hashed as it arrives)
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
        found.extend(storage_format(manifest.format, f"checkpoint {copy.url}").structure_problems(copy.local,
                                                                                                  manifest))
    except UnsafeCheckpointError as exc:
        found.append(str(exc))
    report.problems = list(dict.fromkeys(copy.with_local_problems(found)))  # a missing file is found by 3 and 4
    return report
