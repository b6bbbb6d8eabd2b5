"""The keys a checkpoint's files hold, listed without loading any tensor (for ``inspect``): from DCP's metadata
through the restricted unpickler, or from legacy rank files with ``torch.load(weights_only=True, mmap=True)``.
Each format lists its own (:meth:`~peftckpt.checkpoint.storage.formats.StorageFormat.list_keys`)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..checks.integrity import DCP_METADATA_FILENAME
from ..errors import CheckpointError, UnsafeCheckpointError
from ..state.sections import MODEL
from .legacy import FILENAME as LEGACY_FILENAME
from .manifest import TORCH, TORCH_DIST
from .safe_pickle import load_dcp_metadata

__all__ = ["KeyRecord", "KeyListing", "list_dcp_keys", "list_legacy_keys", "guess_format", "section_of",
           "tensor_bytes"]


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
class KeyListing:
    """What a format found listing a checkpoint's keys."""

    keys: dict[str, KeyRecord] = field(default_factory=dict)
    refused: list[dict[str, str]] = field(default_factory=list)
    """``{"file", "message"}`` of each pickle the restricted unpickler (or weights_only) refused."""
    notes: list[str] = field(default_factory=list)


def section_of(key: str) -> str:
    return key.split(".", 1)[0]


def _dtype_name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(shape: list[int], dtype: str) -> int | None:
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        return None
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * torch_dtype.itemsize


def _legacy_rank_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob(f"mp_rank_*/{LEGACY_FILENAME}") if p.is_file())


def guess_format(root: Path) -> str | None:
    """The format a directory's files look like, without a manifest (``None``: neither)."""
    if (root / DCP_METADATA_FILENAME).exists() or any(root.glob("*.distcp")):
        return TORCH_DIST
    if any(root.glob("mp_rank_*")):
        return TORCH
    return None


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
            keys[key] = KeyRecord(section_of(key), "tensor", shape, dtype, tensor_bytes(shape, dtype),
                                  stored.get(key))
        else:
            keys[key] = KeyRecord(section_of(key), "object", stored_bytes=stored.get(key))
    return keys


def list_dcp_keys(root: Path, problems: list[str]) -> KeyListing:
    """The keys of a DCP checkpoint; a problem found is added to ``problems`` (replacing a shorter report of
    the same one)."""
    report = KeyListing()
    path = root / DCP_METADATA_FILENAME
    if not path.is_file():
        problems.append(f"{path}: DCP metadata was not written (the save stopped while writing shards), "
                        "so no key can be listed")
        return report
    try:
        metadata = load_dcp_metadata(path)
    except UnsafeCheckpointError as exc:
        report.refused.append({"file": str(path), "message": str(exc)})
        if str(exc) in problems:  # verify_checkpoint already reported it, in fewer words
            problems.remove(str(exc))
        problems.append(f"{path}: refused by the restricted unpickler, nothing in it was run: {exc}")
        return report
    except CheckpointError as exc:
        if str(exc) not in problems:
            problems.append(str(exc))
        return report
    report.keys.update(_dcp_keys(metadata))
    return report


def _legacy_add(keys: dict[str, KeyRecord], key: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        keys.setdefault(key, KeyRecord(section_of(key), "object"))
        return
    record = keys.get(key)
    if record is None:
        keys[key] = KeyRecord(section_of(key), "tensor", list(value.shape), _dtype_name(value.dtype),
                              value.numel() * value.element_size())
    elif record.nbytes is not None:
        record.nbytes += value.numel() * value.element_size()


def list_legacy_keys(root: Path, problems: list[str]) -> KeyListing:
    """The keys of a legacy checkpoint's rank files (pickles only: tensor data stays on disk)."""
    report = KeyListing()
    files = _legacy_rank_files(root)
    if not files:
        problems.append(f"{root}: no legacy rank file (mp_rank_*/{LEGACY_FILENAME}), so no key can be listed")
        return report
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
    return report
