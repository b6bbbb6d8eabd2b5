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

    def _append(self, record: dict[str, Any]) -> None:
        if self.enabled and self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def train(self, iteration: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        self._append({"iteration": iteration, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                      "tokens_per_s": tokens_per_s})
        if not self.enabled:
            return
        if self.progress:
            width = 30
            done = int(width * iteration / max(1, self.total_iters))
            bar = "#" * done + "." * (width - done)
            self.stream.write(f"\r[{bar}] {iteration}/{self.total_iters} loss {loss:.4f} lr {lr:.2e} "
                              f"|g| {grad_norm:.3f} {tokens_per_s:,.0f} tok/s")
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
