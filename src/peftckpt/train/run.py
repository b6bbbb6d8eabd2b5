"""Process setup around the trainer: process group, error reporting, exit codes."""

from __future__ import annotations

import argparse
import gc
import sys
from datetime import timedelta

import torch.distributed as dist

from ..checkpoint.errors import CheckpointError
from .args import ArgumentError

__all__ = ["run_training"]


def _run(args: argparse.Namespace, world_size: int, rank: int) -> int:
    from .trainer import Trainer

    try:
        trainer = Trainer(args, world_size, rank)
        trainer.run()
        return 0
    except (ArgumentError, CheckpointError) as e:
        if rank == 0 or not isinstance(e, ArgumentError):
            print(f"peftckpt train: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ArgumentError) else 1


def run_training(args: argparse.Namespace, world_size: int, rank: int) -> int:
    """Initialise gloo (CPU) or NCCL (GPU) when ``world_size > 1``, train, tear down. Returns the exit code."""
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    code = 1
    try:
        code = _run(args, world_size, rank)
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
