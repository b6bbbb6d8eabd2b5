"""Per-iteration metrics: a JSON-lines file for scripts, a live line or plain log lines for people."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsLogger"]


class MetricsLogger:
    """Only the rank that owns it writes (the trainer creates it on global rank 0)."""

    def __init__(self, metrics_file: str | None, log_interval: int, total_iters: int,
                 progress: bool | None = None, stream: TextIO | None = None, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(metrics_file) if metrics_file else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stream = stream or sys.stdout
        self.progress = self.stream.isatty() if progress is None else progress
        self.log_interval = log_interval
        self.total_iters = total_iters
        self.start = time.monotonic()
        self._line_width = 0
        self._first: tuple[int, float] | None = None
        """(iteration, time) of this run's first logged step: the ETA's rate counts from there, so a resumed run
        and the first step's one-off costs do not skew it."""

    def eta(self, iteration: int, now: float | None = None) -> str:
        """Time left to ``total_iters`` at this run's mean rate so far, ``h:mm:ss`` (``?`` until it is known)."""
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = (iteration, now)
        done = iteration - self._first[0]
        if done <= 0:
            return "?"
        left = max(0, self.total_iters - iteration) * (now - self._first[1]) / done
        minutes, seconds = divmod(int(round(left)), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{seconds:02d}"

    def _append(self, record: dict[str, Any]) -> None:
        if self.enabled and self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def train(self, iteration: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        self._append({"iteration": iteration, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": tokens_per_s})
        if not self.enabled:
            return
        eta = self.eta(iteration)
        if self.progress:
            width = 30
            done = int(width * iteration / max(1, self.total_iters))
            bar = "#" * done + "." * (width - done)
            line = (f"[{bar}] {iteration}/{self.total_iters} loss {loss:.4f} lr {lr:.2e} |g| {grad_norm:.3f} "
                    f"{tokens_per_s:,.0f} tok/s ETA {eta}")
            self.stream.write("\r" + line.ljust(self._line_width))  # blank what a longer line left behind
            self._line_width = len(line)
            if iteration >= self.total_iters:
                self.stream.write("\n")
            self.stream.flush()
        elif iteration % self.log_interval == 0 or iteration == self.total_iters:
            self.stream.write(f"iteration {iteration:6d}/{self.total_iters} | loss {loss:.6f} | lr {lr:.3e} | "
                              f"grad norm {grad_norm:.4f} | {tokens_per_s:,.0f} tokens/s\n")
            self.stream.flush()

    def eval(self, iteration: int, eval_loss: float) -> None:
        self._append({"iteration": iteration, "eval_loss": eval_loss})
        if not self.enabled:
            return
        prefix = "\n" if self.progress else ""
        self.stream.write(f"{prefix}eval at iteration {iteration}: loss {eval_loss:.6f}\n")
        self.stream.flush()

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        prefix = "\n" if self.progress else ""
        self.stream.write(f"{prefix}{message}\n")
        self.stream.flush()
