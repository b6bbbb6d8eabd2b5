"""peftckpt: adapter-sized, reshardable, crash-safe distributed checkpoints for PEFT.

The library's public names are importable from here (``from peftckpt import Checkpointer``); they are
loaded on first use, so ``import peftckpt`` (and the command line's ``--help``) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Checkpointer": "checkpoint.api", "SaveOptions": "checkpoint.api", "LoadOptions": "checkpoint.api",
    "LoadResult": "checkpoint.api", "PendingSave": "checkpoint.api",
    "CheckpointError": "checkpoint.errors", "CheckpointFormatError": "checkpoint.errors",
    "CheckpointIntegrityError": "checkpoint.errors", "CheckpointMismatchError": "checkpoint.errors",
    "CheckpointNotFoundError": "checkpoint.errors", "StrictnessError": "checkpoint.errors",
    "UnsafeCheckpointError": "checkpoint.errors", "SaveDirInUseError": "checkpoint.save_lock",
    "StrictHandling": "checkpoint.strictness", "KeyReport": "checkpoint.strictness",
    "Manifest": "checkpoint.manifest", "read_manifest": "checkpoint.manifest",
    "VerifyReport": "checkpoint.verify", "verify_checkpoint": "checkpoint.verify",
    "declare_fused": "sharding.layout", "FusedChunks": "sharding.layout",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'peftckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
