"""``peftckpt launch [torchrun options] COMMAND [options]``: torchrun's launcher, run in this process, for the
commands that use a process group (``train``, ``eval``).

It takes every torchrun option (``--nproc-per-node``, ``--nnodes``, ``--rdzv-endpoint``, ...) and starts the
workers exactly as ``torchrun ... -m peftckpt COMMAND`` would, but reports as a tool: a worker's error is the
one line the worker printed, the exit code is the workers' own (2 for a usage error, 1 for a checkpoint or input
error, 130/143 for a signal), and there is no launcher traceback (torchrun's ``ChildFailedError`` report) or
launcher banner around it. Plain ``torchrun`` keeps working."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence

from .parsing import HelpFormatter

__all__ = ["launch_main", "LAUNCHED_COMMANDS"]

LAUNCHED_COMMANDS = ("train", "eval")
"""The commands that run on many processes; the others (verify, inspect, import/export) run in one."""

_PROG = "peftckpt launch"


def _help_parser() -> argparse.ArgumentParser:
    """What ``--help`` prints, without importing torch: the options most runs need (torchrun takes the rest)."""
    parser = argparse.ArgumentParser(
        prog=_PROG, formatter_class=HelpFormatter,
        usage=f"{_PROG} [torchrun options] {{{','.join(LAUNCHED_COMMANDS)}}} [options of the command]",
        description="Start the workers of `peftckpt train` or `peftckpt eval` as torchrun does, and exit with "
                    "their code and their one message (no launcher traceback or banner).",
        epilog="Every other torchrun option applies too (torchrun --help lists them). Plain `torchrun ... -m "
               "peftckpt train ...` works the same, with torchrun's report around errors.")
    parser.add_argument("--nproc-per-node", default="1", help="worker processes on this node")
    parser.add_argument("--nnodes", default="1", help="nodes (MIN:MAX for elastic runs)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank (static rendezvous)")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    parser.add_argument("--rdzv-backend", default="static", help="rendezvous backend (c10d for elastic runs)")
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts of the workers on a failure")
    return parser


def launch_main(argv: Sequence[str]) -> int:
    argv = list(argv)
    command_at = next((i for i, a in enumerate(argv) if a in LAUNCHED_COMMANDS), len(argv))
    if not argv or {"-h", "--help"} & set(argv[:command_at]):
        _help_parser().print_help()
        return 0 if argv else 2

    from torch.distributed import run as torchrun

    parser = torchrun.get_args_parser()
    parser.prog = _PROG
    parser.usage = _help_parser().usage
    args = parser.parse_args(argv)
    command = args.training_script
    if command not in LAUNCHED_COMMANDS:
        print(f"{_PROG}: error: cannot launch {command!r}: the commands that run on many processes are "
              f"{', '.join(LAUNCHED_COMMANDS)} (the tools run alone: peftckpt {command} ...)", file=sys.stderr)
        return 2
    if args.module or args.no_python:
        print(f"{_PROG}: error: -m/--module and --no-python do not apply: launch runs `python -m peftckpt "
              f"{command}`", file=sys.stderr)
        return 2
    # The workers run `python -m peftckpt COMMAND ARGS...`
    args.training_script, args.module = "peftckpt", True
    args.training_script_args = [command, *args.training_script_args]
    _quiet_launcher()
    try:
        torchrun.run(args)
    except Exception as e:  # the launcher's own report of what the workers did: turned into their exit code
        return _exit_code(e)
    return 0


def _quiet_launcher() -> None:
    """torchrun's banners (``OMP_NUM_THREADS`` set to 1, rendezvous info) and its per-worker failure log lines
    repeat what the workers print. Its default of one OpenMP thread per worker is kept, set silently; the
    launcher's errors still surface (as the exception :func:`launch_main` turns into one line)."""
    import torch.distributed.launcher.api  # noqa: F401  (imports the agent: its loggers exist from here)

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    prefixes = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")
    for name in list(logging.Logger.manager.loggerDict):
        if name.startswith(prefixes):  # each has a level of its own (elastic's get_logger): set one by one
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _exit_code(error: Exception) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if isinstance(error, ChildFailedError):
        # The workers said what went wrong (once, by rank 0, or by the one rank that saw it); the exit code is
        # that of the lowest failed rank, a worker killed by a signal as a shell reports it (128 + signal).
        rank, failure = min(error.failures.items())
        code = failure.exitcode
        if code < 0:  # no worker could say anything: say which one died, and of what
            sig = -code
            name = signal.Signals(sig).name if sig in {int(s) for s in signal.valid_signals()} else f"signal {sig}"
            print(f"{_PROG}: worker rank {rank} was killed by {name}", file=sys.stderr)
            return 128 + sig
        return code or 1
    if isinstance(error, SignalException):
        # The launcher got the signal and forwarded it to every worker; they said what was saved.
        return 128 + int(error.sigval)
    print(f"{_PROG}: error: {error}", file=sys.stderr)
    return 1
