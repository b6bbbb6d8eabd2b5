"""``peftckpt`` command line: ``train`` (under torchrun or alone) and the offline checkpoint tools."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

USAGE = """usage: peftckpt <command> [options]

commands:
  train     train a GPT (+ LoRA) with TP x PP x DP; run under torchrun for more than one process
  verify    check a checkpoint's files against its manifest (offline)

`peftckpt <command> --help` for the options of a command."""


def _train(argv: Sequence[str]) -> int:
    from .train.args import ArgumentError, parse_train_args

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        args = parse_train_args(list(argv), world_size)
    except ArgumentError as e:
        if rank == 0:
            print(f"peftckpt train: error: {e}", file=sys.stderr)
        return 2
    from .train.run import run_training

    code = run_training(args, world_size, rank)
    if world_size > 1:
        # Everything is written and the process groups are destroyed. Skip interpreter finalisation:
        # gloo's C++ threads torn down by static destructors there occasionally abort the process
        # ("terminate called without an active exception"), turning a finished run into a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "train":
        return _train(rest)
    if command == "verify":
        from .checkpoint.verify import verify_main

        return verify_main(rest)
    print(f"peftckpt: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
