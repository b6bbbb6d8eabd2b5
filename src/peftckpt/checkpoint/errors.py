"""The checkpoint library's exceptions: one base class and a few precise subclasses.

Every message says what went wrong, which key/rank/file, expected vs. got, and (where one exists)
the flag that changes the behaviour.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "UnsafeCheckpointError",
    "CheckpointMismatchError",
    "StrictnessError",
]


class CheckpointError(Exception):
    """Base class of every error raised by peftckpt's checkpoint library."""


class CheckpointNotFoundError(CheckpointError):
    """The directory holds no committed checkpoint (or not the requested iteration)."""


class CheckpointFormatError(CheckpointError):
    """Not a peftckpt checkpoint, an unknown format, or a newer format version than this library reads."""


class CheckpointIntegrityError(CheckpointError):
    """A file of a checkpoint is missing, truncated or does not match its recorded checksum."""


class UnsafeCheckpointError(CheckpointIntegrityError):
    """A checkpoint file tried to make the loader build an object outside the admitted set (pickle)."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model it is loaded into (architecture, base weights, shapes)."""


class StrictnessError(CheckpointError):
    """Keys requested but absent (unexpected) or saved but never requested (missing), per the strictness mode."""
