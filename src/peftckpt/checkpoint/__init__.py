"""Save/load orchestration, sections, trainable filter, strictness, formats, manifest, commit protocol.

Names are imported on first use (see :mod:`peftckpt._lazy`)."""

# ruff: noqa: F401 -- the TYPE_CHECKING imports re-export the lazy names to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .api import Checkpointer, LoadOptions, LoadResult, SaveOptions
    from .checks.strictness import KeyReport, StrictHandling
    from .errors import (
        CheckpointError,
        CheckpointFormatError,
        CheckpointIntegrityError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        StrictnessError,
        UnsafeCheckpointError,
    )
    from .state.trainable import TORCH, TORCH_DIST, filter_trainable
    from .storage.manifest import Manifest, read_manifest
    from .tools.verify import VerifyReport, verify_checkpoint

_EXPORTS = {
    "Checkpointer": ".api", "LoadOptions": ".api", "LoadResult": ".api", "SaveOptions": ".api",
    "CheckpointError": ".errors", "CheckpointFormatError": ".errors", "CheckpointIntegrityError": ".errors",
    "CheckpointMismatchError": ".errors", "CheckpointNotFoundError": ".errors", "StrictnessError": ".errors",
    "UnsafeCheckpointError": ".errors", "Manifest": ".storage.manifest", "read_manifest": ".storage.manifest",
    "KeyReport": ".checks.strictness", "StrictHandling": ".checks.strictness", "TORCH": ".state.trainable",
    "TORCH_DIST": ".state.trainable", "filter_trainable": ".state.trainable", "VerifyReport": ".tools.verify",
    "verify_checkpoint": ".tools.verify",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
