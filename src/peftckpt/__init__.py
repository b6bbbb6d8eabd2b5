"""peftckpt: adapter-sized, reshardable, crash-safe distributed checkpoints for PEFT.

The library's public names are importable from here (``from peftckpt import Checkpointer``); they are
loaded on first use, so ``import peftckpt`` (and the command line's ``--help``) does not import torch.
"""

# ruff: noqa: F401 -- the TYPE_CHECKING imports re-export the lazy names to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

if TYPE_CHECKING:
    from .checkpoint.api import Checkpointer, LoadOptions, LoadResult, PendingSave, SaveOptions
    from .checkpoint.checks.strictness import KeyReport, StrictHandling
    from .checkpoint.errors import (
        CheckpointError,
        CheckpointFormatError,
        CheckpointIntegrityError,
        CheckpointMismatchError,
        CheckpointNotFoundError,
        StrictnessError,
        UnsafeCheckpointError,
    )
    from .checkpoint.location.dir_lock import SaveDirInUseError
    from .checkpoint.storage.manifest import Manifest, read_manifest
    from .checkpoint.tools.verify import VerifyReport, verify_checkpoint
    from .sharding.layout import FusedChunks, declare_fused

__version__ = "0.1.0"

_EXPORTS = {
    "Checkpointer": "checkpoint.api", "SaveOptions": "checkpoint.api", "LoadOptions": "checkpoint.api",
    "LoadResult": "checkpoint.api", "PendingSave": "checkpoint.api",
    "CheckpointError": "checkpoint.errors", "CheckpointFormatError": "checkpoint.errors",
    "CheckpointIntegrityError": "checkpoint.errors", "CheckpointMismatchError": "checkpoint.errors",
    "CheckpointNotFoundError": "checkpoint.errors", "StrictnessError": "checkpoint.errors",
    "UnsafeCheckpointError": "checkpoint.errors", "SaveDirInUseError": "checkpoint.location.dir_lock",
    "StrictHandling": "checkpoint.checks.strictness", "KeyReport": "checkpoint.checks.strictness",
    "Manifest": "checkpoint.storage.manifest", "read_manifest": "checkpoint.storage.manifest",
    "VerifyReport": "checkpoint.tools.verify", "verify_checkpoint": "checkpoint.tools.verify",
    "declare_fused": "sharding.layout", "FusedChunks": "sharding.layout",
}

__all__ = ["__version__", *_EXPORTS]
__getattr__, __dir__ = lazy_exports(__name__, {name: f".{module}" for name, module in _EXPORTS.items()})
