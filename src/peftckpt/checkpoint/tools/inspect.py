"""Offline report on a checkpoint or a save location: the collection behind ``peftckpt inspect DIR [--keys] [--json]
[--no-verify-checksums]`` (the records and their JSON are in :mod:`~peftckpt.checkpoint.tools.inspect_report`, the
text rendering and the command itself in :mod:`peftckpt.cli.inspect`).

No process group and no torchrun: everything is read from the files, and nothing from the checkpoint is ever
executed (JSON manifest; DCP's pickled ``.metadata`` only through
:func:`~peftckpt.checkpoint.storage.safe_pickle.load_dcp_metadata`; legacy rank files only with
``torch.load(weights_only=True, mmap=True)``, which reads the pickle but not the tensor data).

Steps of :func:`inspect_path` (the same for a directory and for a location on an object store):
    1. Classify ``DIR``: one checkpoint (a manifest, a staging/``iter_*`` name, DCP or legacy rank files) or a
       save location (tracker, ``iter_*``/staging/trash entries, or empty).
    2. Save location: list every ``iter_*``, staging and trash entry with a cheap state (manifest and file
       sizes, no hashing), and resolve the tracker to the checkpoint a load would pick.
    3. That checkpoint (or ``DIR`` itself) goes through :func:`inspect_checkpoint`, whose steps are listed
       there: manifest, integrity (:func:`~peftckpt.checkpoint.tools.verify.verify_checkpoint`), keys, sizes,
       state. On a store it is inspected in a local copy, every object hashed as it downloads (so checksums are
       always verified), and the report names the objects' URLs.

Commit states: ``committed`` (manifest valid, files intact: a load would accept it), ``uncommitted`` (a
staging directory, or no manifest: a save stopped before its commit; never loadable) and ``corrupted``
(manifest unreadable or invalid, or files missing / truncated / altered, or a pickle refused by the
restricted unpickler).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from ..errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError, UnsafeCheckpointError
from ..location import protocol
from ..location.base import Location
from ..location.locate import locate
from ..location.names import (
    MANIFEST_FILENAME,
    STAGING_PREFIX,
    TRACKER_FILENAME,
    TRASH_PREFIX,
    CheckpointFallbackWarning,
    is_leftover_name,
    looks_like_save_location,
    parse_iteration_dirname,
)
from ..state.sections import MODEL, OPTIMIZER
from ..storage.checksums import verify_files
from ..storage.formats import FORMATS, storage_format
from ..storage.key_listing import KeyRecord, guess_format, section_of, tensor_bytes
from ..storage.manifest import Manifest, read_manifest
from .inspect_report import (
    COMMITTED,
    CORRUPTED,
    SCHEMA_PATH,
    SCHEMA_VERSION,
    UNCOMMITTED,
    CheckpointReport,
    DirEntry,
    InspectReport,
    SaveDirReport,
    SizeSummary,
)
from .verify import verify_checkpoint

__all__ = ["SCHEMA_VERSION", "SCHEMA_PATH", "COMMITTED", "UNCOMMITTED", "CORRUPTED", "KeyRecord", "SizeSummary",
           "CheckpointReport", "DirEntry", "SaveDirReport", "InspectReport", "inspect_checkpoint", "inspect_path"]

_ITER_IN_NAME = re.compile(r"(iter_\d{7,})")


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


def _merge_manifest_keys(report: CheckpointReport, manifest: Manifest) -> None:
    """Model keys take their global shape, dtype and ``requires_grad`` from the manifest; excluded frozen
    keys are added with ``saved=False``."""
    for records, saved in ((manifest.saved_keys, True), (manifest.excluded_keys, False)):
        for key, rec in records.items():
            shape, dtype = list(rec["shape"]), str(rec["dtype"])
            old = report.keys.get(key)
            report.keys[key] = KeyRecord(section_of(key), "tensor", shape, dtype, tensor_bytes(shape, dtype),
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
    on_disk = _files_under(Path(report.path))
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
        report.format = guess_format(root)
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
    if report.format in FORMATS:
        listing = FORMATS[report.format].list_keys(root, problems)
        report.keys.update(listing.keys)
        report.refused.extend(listing.refused)
        report.notes.extend(listing.notes)
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


def _classify(loc: Location) -> str:
    """``"checkpoint"`` or ``"save_dir"``; raises for a location that is neither (a usage error)."""
    local = loc.local_dir()
    if local is None:
        loc.check_readable()  # a missing bucket or credentials: said as such
    elif not local.exists():
        raise CheckpointNotFoundError(f"DIR {local} does not exist")
    elif not local.is_dir():
        raise CheckpointFormatError(f"DIR {local} is a file, not a checkpoint directory or a save directory")
    if loc.holds_manifest() or is_leftover_name(loc.name) or parse_iteration_dirname(loc.name) is not None or (
            local is not None and guess_format(local) is not None):
        return "checkpoint"
    names = loc.names()
    if not names or looks_like_save_location(names):
        return "save_dir"
    raise CheckpointFormatError(
        f"DIR {loc.text} is neither a peftckpt checkpoint (no {MANIFEST_FILENAME}, no DCP or legacy rank files) "
        f"nor a save directory (no {TRACKER_FILENAME}, no iter_* directories)"
    )


def _entry(loc: Location, name: str) -> DirEntry:
    """A save location's entry with its cheap state (manifest and sizes; no hashing)."""
    kind = "staging" if name.startswith(STAGING_PREFIX) else "trash" if name.startswith(TRASH_PREFIX) \
        else "checkpoint"
    entry = DirEntry(name, loc.ref(name), kind, _iteration_from_name(name), COMMITTED)
    if kind == "staging":
        entry.state, entry.reason = UNCOMMITTED, "staging directory of a save that never committed " \
                                                 "(the next save removes it)"
        return entry
    if not loc.holds_manifest(name):
        entry.state = UNCOMMITTED
        entry.reason = f"no {MANIFEST_FILENAME}: a save stopped before its commit"
    else:
        local = loc.local_dir(name)
        try:
            manifest = loc.read_manifest(name)
            problems = loc.size_problems(name, manifest) if local is None else _size_problems(local, manifest)
        except CheckpointError as exc:
            problems = [str(exc)]
        except OSError as exc:  # deleted while listed (retention, another run's cleanup)
            problems = [f"{loc.describe(name)}: vanished while it was inspected ({exc.strerror})"]
        if problems:
            entry.state = CORRUPTED
            entry.reason = problems[0] + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else "")
    if kind == "trash":
        why = "old copy of a re-saved or retired checkpoint, being deleted (the next save removes it)"
        entry.reason = why if entry.reason is None else f"{why}; {entry.reason}"
    return entry


def _inspect_save_dir(loc: Location, verify_checksums: bool) -> InspectReport:
    sd = SaveDirReport(path=loc.ref())
    try:
        sd.tracker = protocol.read_tracker(loc)
    except CheckpointFormatError as exc:
        sd.tracker_error = str(exc)
    sd.entries = sorted(
        (_entry(loc, n) for n in loc.names() if (is_leftover_name(n) or parse_iteration_dirname(n) is not None)
         and ((local := loc.local_dir(n)) is None or local.is_dir())),
        key=lambda e: (-1 if e.iteration is None else e.iteration, e.name),
    )
    report = InspectReport(path=loc.ref(), kind="save_dir", state=UNCOMMITTED, save_dir=sd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            name, _ = protocol.resolve(loc)
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
    sd.selected = loc.ref(name)
    ckpt = _inspect_one(loc.sub(name), verify_checksums)
    for entry in sd.entries:
        if entry.name == name:
            entry.selected = True
            entry.state = ckpt.state
            entry.reason = ckpt.reasons[0] if ckpt.reasons else entry.reason
    report.checkpoint, report.state, report.reasons = ckpt, ckpt.state, list(ckpt.reasons)
    return report


def _inspect_one(loc: Location, verify_checksums: bool) -> CheckpointReport:
    """:func:`inspect_checkpoint` of one checkpoint: in place, or on a store in a verified local copy (every object
    hashed as it downloads, so checksums are always verified), the report naming the objects' URLs."""
    local = loc.local_dir()
    if local is not None:
        return inspect_checkpoint(local, verify_checksums=verify_checksums)
    try:
        copy = protocol.committed_copy(loc)
    except CheckpointNotFoundError as exc:
        return CheckpointReport(loc.text, UNCOMMITTED, [str(exc)])
    except CheckpointError as exc:  # a garbled manifest
        return CheckpointReport(loc.text, CORRUPTED, [str(exc)])
    ckpt = inspect_checkpoint(copy.local, verify_checksums=False)
    ckpt.reasons = copy.with_local_problems(ckpt.reasons)
    ckpt.notes = [copy.rename(n) for n in ckpt.notes if "--no-verify-checksums" not in n]
    ckpt.checksums_verified = True
    ckpt.path = copy.url
    if copy.problems and ckpt.state == COMMITTED:
        ckpt.state = CORRUPTED
    return ckpt


def inspect_path(path: str | os.PathLike[str], *, verify_checksums: bool = True) -> InspectReport:
    """Report on ``path``: a save location or one checkpoint, local or on a store (see the module docstring).

    Raises:
        CheckpointNotFoundError / CheckpointFormatError: ``path`` does not exist, is a file, or is a
            directory that is neither a checkpoint nor a save directory. Every problem of the checkpoint
            itself is reported in the result, not raised.
    """
    loc = locate(path, "DIR").absolute()
    if _classify(loc) == "save_dir":  # 1.
        return _inspect_save_dir(loc, verify_checksums)  # 2.
    ckpt = _inspect_one(loc, verify_checksums)  # 3.
    return InspectReport(loc.ref(), "checkpoint", ckpt.state, list(ckpt.reasons), checkpoint=ckpt)
