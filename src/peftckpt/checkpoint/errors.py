"""The checkpoint library's exceptions: one base class and a few precise subclasses.

Every message says what went wrong, which key/rank/file, expected vs. got, and (where one exists)
the flag that changes the behaviour.
"""

from __future__ import annotations

import pickle

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointFormatError",
    "CheckpointIntegrityError",
    "UnsafeCheckpointError",
    "CheckpointMismatchError",
    "StrictnessError",
    "unwrap_dcp_error",
    "as_read_error",
    "weights_only_reason",
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
    from torch.distributed.checkpoint.api import CheckpointException  # here: importing errors needs no torch

    if isinstance(e, CheckpointException):
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return inner
    return e


def weights_only_reason(text: str) -> str:
    """The line of a ``torch.load(weights_only=True)`` refusal that names what was refused (torch's message is
    mostly advice to turn the check off)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error:" in line or "GLOBAL" in line:
            return line[line.find("WeightsUnpickler error:"):] if "WeightsUnpickler error:" in line else line
    return lines[0] if lines else text


def as_read_error(e: BaseException, source: object) -> BaseException:
    """A failure of DCP reading checkpoint ``source``'s data as the library's error (after
    :func:`unwrap_dcp_error`): an item that ``torch.load(weights_only=True)`` refuses is an
    :class:`UnsafeCheckpointError`, unreadable bytes a :class:`CheckpointIntegrityError`. Library errors,
    interrupts and anything else (bugs keep their traceback) are returned unchanged."""
    text = str(e)
    if isinstance(e, pickle.UnpicklingError):
        reason = weights_only_reason(text)
        return UnsafeCheckpointError(f"a tensor item of checkpoint {source} cannot be loaded with "
                                     f"torch.load(weights_only=True), so it is refused (it could run code): {reason}")
    if isinstance(e, (OSError, EOFError, RuntimeError, ValueError)) and not isinstance(e, CheckpointError):
        return CheckpointIntegrityError(f"checkpoint {source} cannot be read: {type(e).__name__}: "
                                        f"{text.splitlines()[0] if text else ''}")
    return e
