"""Process setup around the trainer and the evaluator: process group, error reporting, exit codes."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ..checkpoint.errors import CheckpointError
from .args import ArgumentError

__all__ = ["run_training", "run_with_process_group", "exit_multi_rank"]


def run_with_process_group(body: Callable[[], None], world_size: int, rank: int, prog: str) -> int:
    """Initialise gloo when ``world_size > 1``, run ``body``, tear down; returns the exit code.

    A user error (bad flag value found late, bad checkpoint) is printed as ``peftckpt <prog>: error: ...``
    and gives 2 (flags) or 1 (checkpoints)."""
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    code = 1
    try:
        body()
        code = 0
    except (ArgumentError, CheckpointError) as e:
        if rank == 0 or not isinstance(e, ArgumentError):
            print(f"peftckpt {prog}: error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, ArgumentError) else 1
    finally:
        # Tear down while the interpreter is fully alive: drop every object that holds a process group
        # (pipeline stages, async-save group), wait for the peers, then destroy. Gloo groups destroyed
        # during interpreter finalisation, or while a peer already closed its sockets, can abort the process.
        gc.collect()
        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    return code


def run_training(args: argparse.Namespace, world_size: int, rank: int) -> int:
    """Train per ``args`` (see :class:`~peftckpt.train.trainer.Trainer`); returns the exit code."""

    def body() -> None:
        from .trainer import Trainer

        Trainer(args, world_size, rank).run()

    return run_with_process_group(body, world_size, rank, "train")


def exit_multi_rank(code: int, world_size: int) -> int:
    """After a multi-rank run whose process groups are destroyed, exit without interpreter finalisation.

    Gloo's C++ threads torn down by static destructors there occasionally abort the process ("terminate
    called without an active exception"), turning a finished run into a failure."""
    if world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
