"""Offline report on a checkpoint: the report records and their collection behind
``peftckpt inspect DIR [--keys] [--json] [--no-verify-checksums]`` (the text rendering and the command
itself are in :mod:`peftckpt.cli.inspect`).

No process group and no torchrun: everything is read from disk, and nothing from the checkpoint is ever
executed (JSON manifest; DCP's pickled ``.metadata`` only through
:func:`~peftckpt.checkpoint.storage.safe_pickle.load_dcp_metadata`; legacy rank files only with
``torch.load(weights_only=True, mmap=True)``, which reads the pickle but not the tensor data).

Steps of :func:`inspect_path`:
    1. Classify ``DIR``: one checkpoint directory (a manifest, a staging/``iter_*`` name, DCP or legacy rank
       files) or a save directory (tracker, ``iter_*``/staging/trash directories, or empty).
    2. Save directory: list every ``iter_*``, staging and trash directory with a cheap state (manifest and
       file sizes, no hashing), and resolve the tracker to the checkpoint a load would pick.
    3. That checkpoint (or ``DIR`` itself) goes through :func:`inspect_checkpoint`, whose steps are listed
       there: manifest, integrity (:func:`~peftckpt.checkpoint.tools.verify.verify_checkpoint`), keys, sizes, state.

Commit states: ``committed`` (manifest valid, files intact: a load would accept it), ``uncommitted`` (a
staging directory, or no manifest: a save stopped before its commit; never loadable) and ``corrupted``
(manifest unreadable or invalid, or files missing / truncated / altered, or a pickle refused by the
restricted unpickler). The JSON form (``--json``) follows ``inspect_schema.json`` next to this module
(:data:`SCHEMA_PATH`), versioned by :data:`SCHEMA_VERSION`.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from peftckpt.checkpoint.checks.integrity import DCP_METADATA_FILENAME
from peftckpt.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    UnsafeCheckpointError,
)
from peftckpt.checkpoint.remote import fetch_copy
from peftckpt.checkpoint.state.sections import MODEL, OPTIMIZER
from peftckpt.checkpoint.state.trainable import TORCH, TORCH_DIST
from peftckpt.checkpoint.storage.checksums import verify_files
from peftckpt.checkpoint.storage.formats import storage_format
from peftckpt.checkpoint.storage.legacy import FILENAME as LEGACY_FILENAME
from peftckpt.checkpoint.storage.manifest import Manifest, read_manifest
from peftckpt.checkpoint.storage.object_store import ObjectStore, parse_location
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from peftckpt.checkpoint.storage.storage_layout import (
    LOCK_FILENAME,
    MANIFEST_FILENAME,
    STAGING_PREFIX,
    TRACKER_FILENAME,
    TRASH_PREFIX,
    CheckpointFallbackWarning,
    parse_iteration_dirname,
    read_tracker,
    resolve_checkpoint_dir,
)
from peftckpt.checkpoint.tools.verify import verify_checkpoint

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMA_PATH",
    "COMMITTED",
    "UNCOMMITTED",
    "CORRUPTED",
    "KeyRecord",
    "SizeSummary",
    "CheckpointReport",
    "DirEntry",
    "SaveDirReport",
    "InspectReport",
    "inspect_checkpoint",
    "inspect_path",
]

SCHEMA_VERSION = 1
"""Version of the ``--json`` document; bumped on any incompatible change of ``inspect_schema.json``."""

SCHEMA_PATH = resources.files("peftckpt.checkpoint.tools").joinpath("inspect_schema.json")
"""The JSON Schema of the ``--json`` document (package data)."""

COMMITTED = "committed"
UNCOMMITTED = "uncommitted"
CORRUPTED = "corrupted"

_ITER_IN_NAME = re.compile(r"(iter_\d{7,})")


# ------------------------------------------------------------------------------------------- records


@dataclass
class KeyRecord:
    """One storage key of a checkpoint (or a frozen model key a trainable-only save left out)."""

    section: str
    """First dotted component of the key: ``model``, ``optimizer``, ``rng_state``, ``iteration``, ..."""
    kind: str
    """``"tensor"`` or ``"object"`` (a pickled non-tensor value)."""
    shape: list[int] | None = None
    """Global shape (legacy non-model entries: the shape in the first rank file); ``None`` for objects."""
    dtype: str | None = None
    """``"float32"``, ...; ``None`` for objects."""
    nbytes: int | None = None
    """Tensor bytes (numel x element size); ``None`` for objects."""
    stored_bytes: int | None = None
    """Bytes the entry occupies in the storage files (DCP storage info); ``None`` when not known."""
    trainable: bool | None = None
    """``requires_grad`` at save time for model tensors (from the manifest); ``None`` otherwise."""
    saved: bool = True
    """False for a frozen key that a trainable-only save excluded (absent from the files)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``bytes`` is :attr:`nbytes`)."""
        return {
            "section": self.section, "kind": self.kind, "shape": self.shape, "dtype": self.dtype,
            "bytes": self.nbytes, "stored_bytes": self.stored_bytes, "trainable": self.trainable,
            "saved": self.saved,
        }

    @property
    def size_bytes(self) -> int:
        """Bytes counted in the size summary: tensor bytes, else stored bytes, else 0."""
        if self.nbytes is not None:
            return self.nbytes
        return self.stored_bytes or 0


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
    """What :func:`inspect_checkpoint` found in one checkpoint directory."""

    path: Path
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
    """One ``iter_*``, staging or trash directory of a save directory."""

    name: str
    path: Path
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

    path: Path
    tracker: int | None = None
    tracker_error: str | None = None
    selected: Path | None = None
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


# ------------------------------------------------------------------------------------------ helpers


def _section_of(key: str) -> str:
    return key.split(".", 1)[0]


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_bytes(shape: list[int], dtype: str) -> int | None:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        return None
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * torch_dtype.itemsize


def _iteration_from_name(name: str) -> int | None:
    match = _ITER_IN_NAME.search(name)
    return parse_iteration_dirname(match.group(1)) if match else None


def _files_under(root: Path) -> dict[str, int]:
    """``{posix relpath: size}`` of every file under ``root`` (symlinks not followed; a file deleted while
    it is listed, e.g. by retention, is skipped)."""
    found = {}
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            try:
                found[path.relative_to(root).as_posix()] = path.lstat().st_size
            except FileNotFoundError:
                continue
    return found


def _size_problems(root: Path, manifest: Manifest) -> list[str]:
    """What ``verify`` finds without hashing (same wording): presence, type and size of each recorded file,
    unlisted files, and whether DCP's metadata describes a whole checkpoint made of those files; for
    ``--no-verify-checksums`` and the cheap states of a save directory's entries."""
    problems = verify_files(root, manifest, hash_if=lambda _rel: False)
    try:
        problems += storage_format(manifest.format, f"checkpoint {root}").structure_problems(root, manifest)
    except UnsafeCheckpointError as exc:
        problems.append(str(exc))
    return list(dict.fromkeys(problems))


def _legacy_rank_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"mp_rank_*/{LEGACY_FILENAME}") if p.is_file())


def _guess_format(root: Path) -> str | None:
    if (root / DCP_METADATA_FILENAME).exists() or any(root.glob("*.distcp")):
        return TORCH_DIST
    if any(root.glob("mp_rank_*")):
        return TORCH
    return None


# ------------------------------------------------------------------------------------- key listings


def _dcp_keys(metadata: Metadata) -> dict[str, KeyRecord]:
    stored: dict[str, int] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        fqn, length = getattr(index, "fqn", None), getattr(info, "length", None)
        if isinstance(fqn, str) and isinstance(length, int):
            stored[fqn] = stored.get(fqn, 0) + length
    keys = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            shape, dtype = list(entry.size), _dtype_name(entry.properties.dtype)
            keys[key] = KeyRecord(_section_of(key), "tensor", shape, dtype, _tensor_bytes(shape, dtype),
                                  stored.get(key))
        else:
            keys[key] = KeyRecord(_section_of(key), "object", stored_bytes=stored.get(key))
    return keys


def _list_dcp(root: Path, report: CheckpointReport, problems: list[str]) -> None:
    path = root / DCP_METADATA_FILENAME
    if not path.is_file():
        problems.append(f"{path}: DCP metadata was not written (the save stopped while writing shards), "
                        "so no key can be listed")
        return
    try:
        metadata = load_dcp_metadata(path)
    except UnsafeCheckpointError as exc:
        report.refused.append({"file": str(path), "message": str(exc)})
        if str(exc) in problems:  # verify_checkpoint already reported it, in fewer words
            problems.remove(str(exc))
        problems.append(f"{path}: refused by the restricted unpickler, nothing in it was run: {exc}")
        return
    except CheckpointError as exc:
        if str(exc) not in problems:
            problems.append(str(exc))
        return
    report.keys.update(_dcp_keys(metadata))


def _legacy_add(keys: dict[str, KeyRecord], key: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        keys.setdefault(key, KeyRecord(_section_of(key), "object"))
        return
    record = keys.get(key)
    if record is None:
        keys[key] = KeyRecord(_section_of(key), "tensor", list(value.shape), _dtype_name(value.dtype),
                              value.numel() * value.element_size())
    elif record.nbytes is not None:
        record.nbytes += value.numel() * value.element_size()


def _list_legacy(root: Path, report: CheckpointReport, problems: list[str]) -> None:
    files = _legacy_rank_files(root)
    if not files:
        problems.append(f"{root}: no legacy rank file (mp_rank_*/{LEGACY_FILENAME}), so no key can be listed")
        return
    for path in files:
        try:
            # mmap: only the pickle is read; tensor data stays on disk.
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as exc:
            # torch's message is a page of advice to turn the check off; keep only the refused global.
            text = str(exc)
            start = text.find("WeightsUnpickler error:")
            reason = (text[start:] if start >= 0 else text).strip().split("\n", 1)[0]
            reason = reason.split(" was not an allowed global", 1)[0]
            report.refused.append({"file": str(path), "message": reason})
            problems.append(f"{path}: refused by torch.load(weights_only=True), nothing in it was run: {reason}")
            continue
        except Exception as exc:  # a damaged zip / pickle: any reader error
            problems.append(f"{path}: cannot be read: {type(exc).__name__}: {str(exc).strip()[:200]}")
            continue
        if not isinstance(state, dict):
            problems.append(f"{path}: holds a {type(state).__name__}, expected a dict of sections")
            continue
        for name, value in state.items():
            if name.startswith(MODEL) and isinstance(value, dict):
                for k, v in value.items():
                    _legacy_add(report.keys, f"{MODEL}.{k}", v)
            else:
                _legacy_add(report.keys, str(name), value)
    report.notes.append("legacy torch format: the stored size of non-tensor entries is not recorded (shown as ?)")
    if len(files) > 1:
        report.notes.append(f"legacy torch format: shapes of non-model entries are those of {files[0]} (local "
                            f"to that model-parallel rank); their bytes are summed over {len(files)} rank files")


# How each format's keys are listed: from DCP's metadata, or from the legacy rank files themselves.
_KEY_LISTERS: dict[str, Callable[[Path, CheckpointReport, list[str]], None]] = {TORCH_DIST: _list_dcp, TORCH: _list_legacy}


def _merge_manifest_keys(report: CheckpointReport, manifest: Manifest) -> None:
    """Model keys take their global shape, dtype and ``requires_grad`` from the manifest; excluded frozen
    keys are added with ``saved=False``."""
    for records, saved in ((manifest.saved_keys, True), (manifest.excluded_keys, False)):
        for key, rec in records.items():
            shape, dtype = list(rec["shape"]), str(rec["dtype"])
            old = report.keys.get(key)
            report.keys[key] = KeyRecord(_section_of(key), "tensor", shape, dtype, _tensor_bytes(shape, dtype),
                                         old.stored_bytes if old else None, bool(rec["requires_grad"]), saved)


def _summarise(report: CheckpointReport, manifest: Manifest | None) -> SizeSummary:
    sizes = SizeSummary(manifest_bytes=None if manifest is None else manifest.total_bytes)
    with_flag = manifest is not None
    if with_flag:
        sizes.trainable_bytes = sizes.frozen_bytes = 0
    for rec in report.keys.values():
        if rec.section == MODEL and rec.kind == "tensor":
            sizes.model_bytes += rec.size_bytes
            if rec.saved:
                sizes.saved_model_bytes += rec.size_bytes
            if with_flag and rec.trainable is not None:
                if rec.trainable:
                    sizes.trainable_bytes = (sizes.trainable_bytes or 0) + rec.size_bytes
                else:
                    sizes.frozen_bytes = (sizes.frozen_bytes or 0) + rec.size_bytes
        elif rec.section == OPTIMIZER:
            sizes.optimizer_bytes += rec.size_bytes
        elif rec.section != MODEL:
            sizes.other_bytes += rec.size_bytes
    on_disk = _files_under(report.path)
    sizes.disk_bytes, sizes.num_files = sum(on_disk.values()), len(on_disk)
    return sizes


# -------------------------------------------------------------------------------------- inspection


def inspect_checkpoint(path: str | os.PathLike[str], *, verify_checksums: bool = True) -> CheckpointReport:
    """Report on one checkpoint directory (committed or not); never raises for a damaged checkpoint.

    Steps:
        1. Commit state from the name and the manifest: a staging directory or a missing manifest is
           uncommitted; an unreadable or invalid manifest is corrupted.
        2. Integrity of a committed candidate: :func:`~peftckpt.checkpoint.tools.verify.verify_checkpoint`
           (every file re-read and hashed, as a load does); with ``verify_checksums=False`` only the
           presence and size of every recorded file.
        3. Keys: DCP ``.metadata`` through the restricted unpickler (``torch_dist``) or the rank files
           with ``torch.load(weights_only=True, mmap=True)`` (``torch``); model keys then take the
           manifest's global shapes and ``requires_grad``, and excluded frozen keys are added.
        4. Size summary, and the final state (any problem makes a committed candidate corrupted).
    """
    root = Path(path)
    report = CheckpointReport(path=root, iteration=_iteration_from_name(root.name))
    problems: list[str] = []
    # 1.
    manifest: Manifest | None = None
    has_manifest = (root / MANIFEST_FILENAME).is_file()
    uncommitted = root.name.startswith(STAGING_PREFIX) or not has_manifest
    if root.name.startswith(STAGING_PREFIX):
        report.reasons.append(f"{root} is the staging directory of a save that never committed: it is not "
                              "loadable, a load never picks it and the next save removes it")
    elif not has_manifest:
        report.reasons.append(f"{root} has no {MANIFEST_FILENAME}: a save stopped before its commit, so it is "
                              f"not loadable; load the save directory {root.parent} for the last committed one")
    if has_manifest:
        try:
            manifest = read_manifest(root)
        except CheckpointError as exc:
            problems.append(str(exc))
    if manifest is not None:
        report.format, report.format_version = manifest.format, manifest.format_version
        report.library_version, report.created_at = manifest.library_version, manifest.created_at
        report.iteration, report.layout = manifest.iteration, dict(manifest.layout)
        report.trainable_only, report.base_fingerprint = manifest.trainable_only, manifest.base_fingerprint
        report.model_config, report.adapter_config = dict(manifest.model_config), manifest.adapter_config
        report.sections = list(manifest.sections)
    else:
        report.format = _guess_format(root)
    # 2.
    if manifest is not None and not uncommitted:
        if verify_checksums:
            try:
                problems.extend(verify_checkpoint(root).problems)
                report.checksums_verified = True
            except CheckpointError as exc:
                problems.append(str(exc))
        else:
            problems.extend(_size_problems(root, manifest))
            report.notes.append("checksums not verified (--no-verify-checksums): only file presence and sizes "
                                "were checked")
    # 3.
    list_keys = _KEY_LISTERS.get(report.format or "")
    if list_keys is not None:
        list_keys(root, report, problems)
    elif manifest is None:
        problems.append(f"{root}: no DCP metadata and no legacy rank files, so no key can be listed")
    if manifest is not None:
        _merge_manifest_keys(report, manifest)
    # 4.
    report.sizes = _summarise(report, manifest)
    report.reasons.extend(p for p in dict.fromkeys(problems) if p not in report.reasons)
    if uncommitted:
        report.state = UNCOMMITTED
    elif manifest is None or problems:
        report.state = CORRUPTED
    return report


def _classify(target: Path) -> str:
    """``"checkpoint"`` or ``"save_dir"``; raises for a path that is neither (a usage error)."""
    if not target.exists():
        raise CheckpointNotFoundError(f"DIR {target} does not exist")
    if not target.is_dir():
        raise CheckpointFormatError(f"DIR {target} is a file, not a checkpoint directory or a save directory")
    name = target.name
    if (target / MANIFEST_FILENAME).is_file() or name.startswith((STAGING_PREFIX, TRASH_PREFIX)) \
            or parse_iteration_dirname(name) is not None or _guess_format(target) is not None:
        return "checkpoint"
    entries = list(target.iterdir())
    if not entries or any(e.name in (TRACKER_FILENAME, LOCK_FILENAME) or e.name.startswith((STAGING_PREFIX, TRASH_PREFIX))
                          or parse_iteration_dirname(e.name) is not None for e in entries):
        return "save_dir"
    raise CheckpointFormatError(
        f"DIR {target} is neither a peftckpt checkpoint (no {MANIFEST_FILENAME}, no DCP or legacy rank files) "
        f"nor a save directory (no {TRACKER_FILENAME}, no iter_* directories)"
    )


def _entry(path: Path) -> DirEntry:
    """A save directory's entry with its cheap state (manifest and sizes; no hashing)."""
    name = path.name
    kind = "staging" if name.startswith(STAGING_PREFIX) else "trash" if name.startswith(TRASH_PREFIX) \
        else "checkpoint"
    entry = DirEntry(name, path, kind, _iteration_from_name(name), COMMITTED)
    if kind == "staging":
        entry.state, entry.reason = UNCOMMITTED, "staging directory of a save that never committed " \
                                                 "(the next save removes it)"
        return entry
    if not (path / MANIFEST_FILENAME).is_file():
        entry.state = UNCOMMITTED
        entry.reason = f"no {MANIFEST_FILENAME}: a save stopped before its commit"
    else:
        try:
            problems = _size_problems(path, read_manifest(path))
        except CheckpointError as exc:
            problems = [str(exc)]
        except OSError as exc:  # deleted while listed (retention, another run's cleanup)
            problems = [f"{path}: vanished while it was inspected ({exc.strerror})"]
        if problems:
            entry.state = CORRUPTED
            entry.reason = problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
    if kind == "trash":
        why = "old copy of a re-saved or retired checkpoint, being deleted (the next save removes it)"
        entry.reason = why if entry.reason is None else f"{why}; {entry.reason}"
    return entry


def _inspect_save_dir(save: Path, verify_checksums: bool) -> InspectReport:
    sd = SaveDirReport(path=save)
    try:
        sd.tracker = read_tracker(save)
    except CheckpointFormatError as exc:
        sd.tracker_error = str(exc)
    sd.entries = sorted(
        (_entry(p) for p in save.iterdir() if p.is_dir() and (
            p.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) or parse_iteration_dirname(p.name) is not None)),
        key=lambda e: (-1 if e.iteration is None else e.iteration, e.name),
    )
    report = InspectReport(path=save, kind="save_dir", state=UNCOMMITTED, save_dir=sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ckpt_dir, _ = resolve_checkpoint_dir(save)
        except CheckpointNotFoundError as exc:
            report.reasons.append(str(exc))
            return report
        except CheckpointError as exc:  # a garbled tracker: a load fails the same way
            report.state = CORRUPTED
            report.reasons.append(str(exc))
            return report
        finally:
            for w in caught:
                if issubclass(w.category, CheckpointFallbackWarning):
                    sd.notes.append(str(w.message))
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    sd.selected = ckpt_dir
    ckpt = inspect_checkpoint(ckpt_dir, verify_checksums=verify_checksums)
    for entry in sd.entries:
        if entry.path == ckpt_dir:
            entry.selected = True
            entry.state = ckpt.state
            entry.reason = ckpt.reasons[0] if ckpt.reasons else entry.reason
    report.checkpoint, report.state, report.reasons = ckpt, ckpt.state, list(ckpt.reasons)
    return report


def inspect_path(path: str | os.PathLike[str], *, verify_checksums: bool = True) -> InspectReport:
    """Report on ``path``: a save directory or one checkpoint directory (see the module docstring).

    Raises:
        CheckpointNotFoundError / CheckpointFormatError: ``path`` does not exist, is a file, or is a
            directory that is neither a checkpoint nor a save directory. Every problem of the checkpoint
            itself is reported in the result, not raised.
    """
    location = parse_location(path, "DIR")
    if isinstance(location, ObjectStore):
        return _inspect_remote(location)
    target = location.absolute()
    if _classify(target) == "save_dir":  # 1.
        return _inspect_save_dir(target, verify_checksums)  # 2.
    ckpt = inspect_checkpoint(target, verify_checksums=verify_checksums)  # 3.
    return InspectReport(target, "checkpoint", ckpt.state, list(ckpt.reasons), checkpoint=ckpt)


def _inspect_remote(store: ObjectStore) -> InspectReport:
    """:func:`inspect_path` of a URL: the committed checkpoint it designates, downloaded with every object hashed
    and checked as it streams (so checksums are always verified), then inspected like a local one; paths in the
    report are the objects' URLs. Only the selected checkpoint is reported (no listing of the save location)."""
    try:
        copy = fetch_copy(store)
    except CheckpointNotFoundError as exc:
        return InspectReport(store.url, "checkpoint", UNCOMMITTED, [str(exc)])
    except CheckpointError as exc:  # a garbled tracker or manifest
        return InspectReport(store.url, "checkpoint", CORRUPTED, [str(exc)])
    ckpt = inspect_checkpoint(copy.local, verify_checksums=False)
    ckpt.reasons = copy.with_local_problems(ckpt.reasons)
    ckpt.notes = [copy.rename(n) for n in ckpt.notes if "--no-verify-checksums" not in n]
    ckpt.checksums_verified = True
    ckpt.path = copy.url  # type: ignore[assignment]
    if copy.problems and ckpt.state == COMMITTED:
        ckpt.state = CORRUPTED
    return InspectReport(store.url, "checkpoint", ckpt.state, list(ckpt.reasons), checkpoint=ckpt)
