"""The checkpoint library's exceptions: one base class and a few precise subclasses.

Every message says what went wrong, which key/rank/file, expected vs. got, and (where one exists)
the flag that changes the behaviour.
"""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "UnsafeCheckpointError",
    "CheckpointMismatchError",
    "StrictnessError",
    "unwrap_dcp_error",
]


class CheckpointError(Exception):
    """Base class of every error raised by peftckpt's checkpoint library."""

    every_rank: bool = False
    """True when every rank raises this error with the same message (a launcher prints it once)."""


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


def unwrap_dcp_error(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` wrapper (a ``BaseException``
    that would escape ``except Exception``); any other exception unchanged."""
    if isinstance(e, CheckpointException):
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return inner
    return e
