"""Fault injection at named points of a save, for crash-safety tests (and for users who want to rehearse).

Set ``PEFTCKPT_FAULT_INJECT`` to ``POINT:ACTION[:rank=R][:iteration=N]`` (several separated by ``,``):

=================  ============================================================================
point              when
=================  ============================================================================
``data``           while the rank writes its shard files (after its first item is on its way)
``upload``         object store only: while the rank uploads its files (after its first object)
``before_manifest`` all data written and fsynced (on a store: uploaded), manifest not yet written
``before_rename``  manifest written into the staging directory, not yet renamed to ``iter_*`` (on a store:
                   the manifest object is written; a re-save's staged copy not yet promoted)
``before_tracker`` renamed (committed), tracker not yet moved
=================  ============================================================================

Actions: ``kill`` (SIGKILL this process: no cleanup, no flush), ``eio`` / ``enospc`` (raise the
``OSError`` an I/O error or a full disk raises). Unset, this module does nothing.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable

__all__ = ["FAULT_ENV", "fault_point", "fault_hook"]

FAULT_ENV = "PEFTCKPT_FAULT_INJECT"
POINTS = ("data", "upload", "before_manifest", "before_rename", "before_tracker")


def fault_hook(point: str, rank: int, iteration: int) -> Callable[[], None] | None:
    """:func:`fault_point` as a call for a point passed many times in one step (the ``data`` point, once per
    item written), or ``None`` when no fault names ``point`` (the environment is read once, here)."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or not any(entry.strip().split(":")[0] == point for entry in spec.split(",")):
        return None
    return lambda: fault_point(point, rank, iteration)


def fault_point(point: str, rank: int, iteration: int) -> None:
    """Trigger the configured fault if ``point`` (on this rank, at this iteration) is armed."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for entry in spec.split(","):
        fields = entry.strip().split(":")
        if len(fields) < 2 or fields[0] != point:
            continue
        opts = dict(f.split("=", 1) for f in fields[2:] if "=" in f)
        if "rank" in opts and int(opts["rank"]) != rank:
            continue
        if "iteration" in opts and int(opts["iteration"]) != iteration:
            continue
        action = fields[1]
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "eio":
            raise OSError(errno.EIO, f"injected I/O error at {point}")
        elif action == "enospc":
            raise OSError(errno.ENOSPC, f"No space left on device (injected at {point})")
        else:
            raise ValueError(f"{FAULT_ENV}: unknown action {action!r} in {entry!r}")
