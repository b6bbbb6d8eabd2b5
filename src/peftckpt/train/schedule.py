"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to ``--min-lr``."""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["OptimizerParamScheduler"]


class OptimizerParamScheduler:
    """Sets the learning rate of every param group for a given iteration (Megatron's name and role)."""

    def __init__(self, optimizer: torch.optim.Optimizer, max_lr: float, min_lr: float, warmup_iters: int,
                 decay_iters: int, decay_style: str):
        if decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-decay-style must be constant, linear or cosine, got {decay_style!r}")
        self.optimizer = optimizer
        self.max_lr = max_lr
        self.min_lr = min_lr
        self.warmup_iters = warmup_iters
        self.decay_iters = max(decay_iters, warmup_iters + 1)
        self.decay_style = decay_style
        self.num_steps = 0

    def lr_at(self, step: int) -> float:
        """Learning rate of the optimizer step number ``step`` (0-based)."""
        if self.warmup_iters > 0 and step < self.warmup_iters:
            return self.max_lr * (step + 1) / self.warmup_iters
        if self.decay_style == "constant":
            return self.max_lr
        progress = min(1.0, (step - self.warmup_iters) / (self.decay_iters - self.warmup_iters))
        if self.decay_style == "linear":
            coeff = 1.0 - progress
        else:
            coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr + (self.max_lr - self.min_lr) * coeff

    def apply(self) -> float:
        """Set the learning rate for the next optimizer step and return it."""
        lr = self.lr_at(self.num_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def step(self) -> None:
        """Count one optimizer step."""
        self.num_steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_lr": self.max_lr, "min_lr": self.min_lr, "warmup_iters": self.warmup_iters,
            "decay_iters": self.decay_iters, "decay_style": self.decay_style, "num_steps": self.num_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position; the schedule's shape comes from the current flags (as Megatron's
        ``--override-opt-param-scheduler``) unless they are unchanged."""
        self.num_steps = int(state["num_steps"])
