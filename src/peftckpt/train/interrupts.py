"""Stopping a training run between iterations: Ctrl-C (SIGINT), SIGTERM and ``--exit-signal-handler``.

A signal only records itself; the trainer asks :meth:`StopSignals.agreed` at every iteration boundary, a
collective that tells every rank whether any rank was signalled, so all ranks stop after the same iteration
and can still save together. What a stop does:

- SIGINT (Ctrl-C), or SIGTERM without ``--exit-signal-handler``: a save in flight completes, no new save
  starts, one line names the last committed checkpoint, exit ``128 + signal`` (130 for Ctrl-C).
- SIGTERM with ``--exit-signal-handler`` (what SLURM and Kubernetes send before preemption): every rank
  finishes the iteration, saves (trainable-only if that is the run's mode), waits for the commit, exit 0.

A second Ctrl-C stops at once (``KeyboardInterrupt``; nothing new is saved).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StopSignals", "Stop", "RunStopped"]


@dataclass(frozen=True)
class Stop:
    """What the ranks agreed to do after a signal."""

    signum: int
    save: bool
    """Save a checkpoint before exiting (SIGTERM with ``--exit-signal-handler``)."""

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 0 if self.save else 128 + self.signum


class RunStopped(Exception):
    """Raised on every rank after an agreed stop, once the checkpoint work is done; ``str`` is the line to
    print (rank 0 prints it) and ``exit_code`` the process's exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopSignals:
    """SIGINT and SIGTERM handlers that record the signal, and the per-iteration agreement across ranks.

    ``save_on_sigterm`` is ``--exit-signal-handler``. Until :meth:`installed` is entered nothing is recorded
    and :meth:`agreed` returns ``None`` without a collective (every rank installs alike, or none does)."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, save_on_sigterm: bool = False, distributed: bool = False):
        self.save_on_sigterm = save_on_sigterm
        self.distributed = distributed
        self.received: int | None = None
        self.stop: Stop | None = None
        """The stop the ranks agreed on, once they have."""
        self.active = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.received is None or signum == signal.SIGTERM:
            self.received = signum

    @contextmanager
    def installed(self) -> Iterator[StopSignals]:
        """Handle SIGINT and SIGTERM inside the block (main thread only; elsewhere nothing changes)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous: dict[int, Any] = {s: signal.signal(s, self._handle) for s in self._SIGNALS}
        self.active = True
        try:
            yield self
        finally:
            self.active = False
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _code(self) -> int:
        """This rank's signal as one number, ``kind * 64 + signum`` with kind 1 = stop, 2 = save and stop (0: no
        signal), so the maximum over the ranks is the answer: a save wins over a plain stop."""
        if self.received is None:
            return 0
        save = self.received == signal.SIGTERM and self.save_on_sigterm
        return (2 if save else 1) * 64 + self.received

    def agreed(self) -> Stop | None:
        """Whether any rank was signalled, the same answer on every rank (collective when distributed, until a
        stop is agreed: that answer is final, so later calls return it without asking again)."""
        if not self.active:
            return None
        if self.stop is not None:
            return self.stop
        code = self._code()
        if self.distributed:
            value = torch.tensor([code], dtype=torch.int64)
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
            code = int(value.item())
        if code != 0:
            self.stop = Stop(signum=code % 64, save=code // 64 == 2)
        return self.stop
