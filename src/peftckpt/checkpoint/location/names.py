"""The names inside a save location, the same on a directory and on an object store::

    <save>/latest_checkpointed_iteration.txt   "100": the tracker, rewritten after each commit
    <save>/iter_0000100/                       one committed checkpoint
    <save>/iter_0000100/metadata.json          the manifest; its presence is what "committed" means
    <save>/.staging.iter_0000100.<token>/      a save in progress (hidden, never matches ``iter_*``)
    <save>/.trash.<why>.iter_0000100.<token>/  a checkpoint being deleted (directories only)
    <save>/.peftckpt.lock                      the run lock (a flock'ed file, or a lease object)
"""

from __future__ import annotations

import re

__all__ = ["TRACKER_FILENAME", "MANIFEST_FILENAME", "LOCK_FILENAME", "STAGING_PREFIX", "TRASH_PREFIX",
           "CheckpointFallbackWarning", "iteration_dirname", "parse_iteration_dirname", "stand_in_target",
           "is_leftover_name", "looks_like_save_location"]

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
"""Name of the tracker in a save location; it holds the latest committed iteration as text."""

MANIFEST_FILENAME = "metadata.json"
"""Name of the JSON manifest inside a checkpoint; its presence marks the checkpoint committed."""

LOCK_FILENAME = ".peftckpt.lock"
"""The run lock of a save location (hidden: never an ``iter_*``, staging or trash name)."""

STAGING_PREFIX = ".staging."
"""Prefix of in-progress saves (hidden; never parsed as a committed checkpoint)."""

TRASH_PREFIX = ".trash."
"""Prefix of directories being deleted (a replaced old copy, or a checkpoint retired by retention)."""

_ITER_DIGITS = 7
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_STAND_IN_RE = re.compile(r"^\.(?:trash\.replace|staging)\.(iter_\d{7,})\.[^./]+$")


class CheckpointFallbackWarning(UserWarning):
    """A resolve did not use the tracker's iteration (absent, or not committed)."""


def iteration_dirname(iteration: int) -> str:
    """Name of the checkpoint of ``iteration``: ``iter_0000100`` (7 digits, more if needed)."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:0{_ITER_DIGITS}d}"


def parse_iteration_dirname(name: str) -> int | None:
    """Iteration encoded in a committed checkpoint's name, or ``None`` if ``name`` is not one."""
    match = _ITER_RE.match(name)
    return int(match.group(1)) if match else None


def stand_in_target(name: str) -> str | None:
    """The ``iter_*`` name that ``name`` may stand in for after an interrupted re-save (an old copy moved aside
    on a directory, a staged new copy on a store), or ``None``."""
    match = _STAND_IN_RE.match(name)
    return match.group(1) if match else None


def is_leftover_name(name: str) -> bool:
    """A staging or trash name: what an interrupted save or deletion leaves, never a committed checkpoint."""
    return name.startswith((STAGING_PREFIX, TRASH_PREFIX))


def looks_like_save_location(names: list[str]) -> bool:
    """Whether a location holding ``names`` is a save location (a tracker, a lock, checkpoints, leftovers)."""
    return any(n in (TRACKER_FILENAME, LOCK_FILENAME) or is_leftover_name(n) or parse_iteration_dirname(n) is not None
               for n in names)
