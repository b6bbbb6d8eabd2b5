"""``--dist-ckpt-strictness``: what to do with unexpected and missing keys (Megatron-LM semantics).

*Unexpected*: requested by this rank but absent from the checkpoint (per rank).
*Missing*: in the checkpoint but requested by no rank (global view; costs one all-gather).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from ..errors import StrictnessError

__all__ = ["StrictHandling", "KeyReport", "check_keys", "STRICTNESS_FLAG"]

STRICTNESS_FLAG = "LoadOptions.strictness ="


class StrictHandling(StrEnum):
    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @property
    def needs_missing(self) -> bool:
        """Whether the mode looks at missing keys (which needs every rank's request)."""
        return self in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @property
    def removes_unexpected(self) -> bool:
        return self not in (StrictHandling.ASSUME_OK_UNEXPECTED, StrictHandling.RAISE_UNEXPECTED,
                            StrictHandling.RAISE_ALL)


@dataclass
class KeyReport:
    """Keys the load skipped: ``unexpected`` (this rank) and ``missing`` (all ranks; empty unless computed)."""

    unexpected: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def _listing(keys: Iterable[str], hints: Mapping[str, str], limit: int = 20) -> str:
    keys = sorted(keys)
    lines = [f"  {k}" + (f"  ({hints[k]})" if k in hints else "") for k in keys[:limit]]
    if len(keys) > limit:
        lines.append(f"  ... and {len(keys) - limit} more")
    return "\n".join(lines)


def check_keys(mode: StrictHandling, requested: Iterable[str], saved: Iterable[str], rank: int,
               requested_by_all: Iterable[str] | None = None, hints: Mapping[str, str] | None = None,
               source: str = "checkpoint") -> KeyReport:
    """Apply ``mode``; returns the keys to drop from this rank's request (unexpected) and the missing ones.

    Raises :class:`StrictnessError` listing the keys when the mode says so. ``assume_ok_unexpected`` is
    not relaxed: the load cannot succeed with keys absent from the checkpoint, so it fails -- with this
    message rather than the storage layer's. ``hints`` adds a reason next to a key in messages.
    """
    hints = hints or {}
    saved_set = set(saved)
    unexpected = sorted(set(requested) - saved_set)
    missing: list[str] = []
    if mode.needs_missing:
        if requested_by_all is None:
            raise ValueError(f"strictness {mode.value} needs the keys requested by all ranks")
        missing = sorted(saved_set - set(requested_by_all))
    problems = []
    if unexpected and not mode.removes_unexpected:
        problems.append(
            f"rank {rank}: {len(unexpected)} key(s) requested but absent from {source}:\n"
            f"{_listing(unexpected, hints)}\n"
            f"pass {STRICTNESS_FLAG} log_unexpected (or ignore_all) to skip them and keep their current values"
        )
    if missing and mode is StrictHandling.RAISE_ALL:
        problems.append(
            f"{len(missing)} key(s) in {source} requested by no rank:\n{_listing(missing, hints)}\n"
            f"pass {STRICTNESS_FLAG} log_all (or raise_unexpected) to load without them"
        )
    if problems:
        raise StrictnessError("\n".join(problems))
    if mode in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and unexpected:
        warnings.warn(f"rank {rank}: skipping {len(unexpected)} key(s) absent from {source}:\n"
                      f"{_listing(unexpected, hints)}", stacklevel=2)
    if mode is StrictHandling.LOG_ALL and missing and rank == 0:
        warnings.warn(f"{len(missing)} key(s) in {source} requested by no rank:\n{_listing(missing, hints)}",
                      stacklevel=2)
    return KeyReport(unexpected=unexpected, missing=missing)
