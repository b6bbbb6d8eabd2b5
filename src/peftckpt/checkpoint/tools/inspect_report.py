"""The records of ``peftckpt inspect``'s report and their JSON form (``--json``), which follows
``inspect_schema.json`` next to this module (:data:`SCHEMA_PATH`), versioned by :data:`SCHEMA_VERSION`. The
report is collected by :mod:`~peftckpt.checkpoint.tools.inspect`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..storage.key_listing import KeyRecord

__all__ = ["SCHEMA_VERSION", "SCHEMA_PATH", "COMMITTED", "UNCOMMITTED", "CORRUPTED", "KeyRecord", "SizeSummary",
           "CheckpointReport", "DirEntry", "SaveDirReport", "InspectReport"]

SCHEMA_VERSION = 1
"""Version of the ``--json`` document; bumped on any incompatible change of ``inspect_schema.json``."""

SCHEMA_PATH = resources.files("peftckpt.checkpoint.tools").joinpath("inspect_schema.json")
"""The JSON Schema of the ``--json`` document (package data)."""

COMMITTED = "committed"
UNCOMMITTED = "uncommitted"
CORRUPTED = "corrupted"


@dataclass
class SizeSummary:
    """Byte counts of one checkpoint."""

    model_bytes: int = 0
    """The full model: saved plus excluded model tensors (without a readable manifest: the saved ones)."""
    saved_model_bytes: int = 0
    """Model tensors present in the files."""
    trainable_bytes: int | None = None
    """Model tensors with ``requires_grad`` at save (adapters); ``None`` without a manifest."""
    frozen_bytes: int | None = None
    """Model tensors without ``requires_grad`` (saved or not); ``None`` without a manifest."""
    optimizer_bytes: int = 0
    """Optimizer tensors, plus the stored size of its objects (``param_groups``)."""
    other_bytes: int = 0
    """Everything else that is saved (RNG state, iteration, scheduler, ...)."""
    disk_bytes: int = 0
    """Sum of the sizes of every file under the directory, manifest included."""
    num_files: int = 0
    """Number of files under the directory."""
    manifest_bytes: int | None = None
    """Sum of the file sizes the manifest records; ``None`` without a manifest."""

    @property
    def trainable_fraction(self) -> float | None:
        """``trainable_bytes / model_bytes`` (``None`` when either is unknown or zero)."""
        if self.trainable_bytes is None or not self.model_bytes:
            return None
        return self.trainable_bytes / self.model_bytes

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        fraction = self.trainable_fraction
        return {
            "model_bytes": self.model_bytes, "saved_model_bytes": self.saved_model_bytes,
            "trainable_bytes": self.trainable_bytes, "frozen_bytes": self.frozen_bytes,
            "trainable_fraction": None if fraction is None else round(fraction, 6),
            "optimizer_bytes": self.optimizer_bytes, "other_bytes": self.other_bytes,
            "disk_bytes": self.disk_bytes, "num_files": self.num_files, "manifest_bytes": self.manifest_bytes,
        }


@dataclass
class CheckpointReport:
    """What :func:`~peftckpt.checkpoint.tools.inspect.inspect_checkpoint` found in one checkpoint directory."""

    path: Path | str
    """The directory (or, for a verified copy of a checkpoint on a store, its URL)."""
    state: str = COMMITTED
    reasons: list[str] = field(default_factory=list)
    """Why it is not loadable (uncommitted) or what is damaged (corrupted), one line each."""
    format: str | None = None
    format_version: int | None = None
    library_version: str | None = None
    created_at: str | None = None
    iteration: int | None = None
    layout: dict[str, int] | None = None
    trainable_only: bool | None = None
    base_fingerprint: str | None = None
    model_config: dict[str, Any] | None = None
    adapter_config: dict[str, Any] | None = None
    sections: list[str] = field(default_factory=list)
    checksums_verified: bool = False
    """True when every file was re-read and its checksum compared (a load's check)."""
    refused: list[dict[str, str]] = field(default_factory=list)
    """``{"file", "message"}`` of each pickle the restricted unpickler (or weights_only) refused."""
    notes: list[str] = field(default_factory=list)
    keys: dict[str, KeyRecord] = field(default_factory=dict)
    sizes: SizeSummary = field(default_factory=SizeSummary)

    @property
    def loadable(self) -> bool:
        """Whether a load would accept this checkpoint (as far as its files go)."""
        return self.state == COMMITTED

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "path": str(self.path), "state": self.state, "loadable": self.loadable,
            "reasons": list(self.reasons), "format": self.format, "format_version": self.format_version,
            "library_version": self.library_version, "created_at": self.created_at,
            "iteration": self.iteration, "layout": self.layout, "trainable_only": self.trainable_only,
            "base_fingerprint": self.base_fingerprint, "model_config": self.model_config,
            "adapter_config": self.adapter_config, "sections": list(self.sections),
            "checksums_verified": self.checksums_verified, "refused": list(self.refused),
            "notes": list(self.notes), "keys": {k: v.to_dict() for k, v in sorted(self.keys.items())},
            "sizes": self.sizes.to_dict(),
        }


@dataclass
class DirEntry:
    """One ``iter_*``, staging or trash directory of a save directory (or prefix of a save location on a store)."""

    name: str
    path: Path | str
    kind: str
    """``"checkpoint"`` (``iter_*``), ``"staging"`` or ``"trash"``."""
    iteration: int | None
    state: str
    reason: str | None = None
    selected: bool = False
    """The directory a load of the save directory would use."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "name": self.name, "path": str(self.path), "kind": self.kind, "iteration": self.iteration,
            "state": self.state, "reason": self.reason, "selected": self.selected,
        }


@dataclass
class SaveDirReport:
    """The save-directory part of a report."""

    path: Path | str
    tracker: int | None = None
    tracker_error: str | None = None
    selected: Path | str | None = None
    notes: list[str] = field(default_factory=list)
    entries: list[DirEntry] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "path": str(self.path), "tracker": self.tracker, "tracker_error": self.tracker_error,
            "selected": None if self.selected is None else str(self.selected), "notes": list(self.notes),
            "entries": [e.to_dict() for e in self.entries],
        }


@dataclass
class InspectReport:
    """Result of :func:`inspect_path`: the save directory (if ``DIR`` is one) and the checkpoint."""

    path: Path | str
    """The directory, or the URL on an object store."""
    kind: str
    """``"checkpoint"`` or ``"save_dir"``."""
    state: str
    reasons: list[str] = field(default_factory=list)
    save_dir: SaveDirReport | None = None
    checkpoint: CheckpointReport | None = None

    @property
    def exit_code(self) -> int:
        """0 for a committed intact checkpoint, 1 otherwise."""
        return 0 if self.state == COMMITTED else 1

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` document (see ``inspect_schema.json``)."""
        return {
            "schema_version": SCHEMA_VERSION, "path": str(self.path), "kind": self.kind, "state": self.state,
            "loadable": self.state == COMMITTED, "reasons": list(self.reasons),
            "save_dir": None if self.save_dir is None else self.save_dir.to_dict(),
            "checkpoint": None if self.checkpoint is None else self.checkpoint.to_dict(),
        }

    def to_json(self) -> str:
        """Stable JSON: sorted keys, 2-space indent, no NaN."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False)
