"""Save/load orchestration, sections, trainable filter, strictness, formats, manifest, commit protocol."""

from .api import Checkpointer, LoadOptions, LoadResult, SaveOptions
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    StrictnessError,
    UnsafeCheckpointError,
)
from .manifest import Manifest, read_manifest
from .strictness import KeyReport, StrictHandling
from .trainable import TORCH, TORCH_DIST, filter_trainable
from .verify import VerifyReport, verify_checkpoint

__all__ = [
    "Checkpointer", "LoadOptions", "LoadResult", "SaveOptions",
    "CheckpointError", "CheckpointFormatError", "CheckpointIntegrityError", "CheckpointMismatchError",
    "CheckpointNotFoundError", "StrictnessError", "UnsafeCheckpointError",
    "Manifest", "read_manifest", "KeyReport", "StrictHandling", "TORCH", "TORCH_DIST", "filter_trainable",
    "VerifyReport", "verify_checkpoint",
]
