"""``peftckpt train``: parse the trainer's flags (an error said once, exit 2), then run (see :mod:`peftckpt.train.run`)."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["train_main"]


def train_main(argv: Sequence[str]) -> int:
    from ..checkpoint.errors import CheckpointError
    from ..train.args import ArgumentError, parse_train_args
    from .parsing import say_once

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        args = parse_train_args(list(argv), world_size)
    except ArgumentError as e:
        say_once("peftckpt train", e, rank, world_size)
        return 2
    except CheckpointError as e:  # a base or checkpoint whose architecture contradicts its files: before any model
        say_once("peftckpt train", e, rank, world_size)
        return 1
    from ..train.run import exit_multi_rank, run_training

    return exit_multi_rank(run_training(args, world_size, rank), world_size)
