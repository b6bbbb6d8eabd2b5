"""Process setup around the trainer and the evaluator: process group, error reporting, exit codes."""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ..checkpoint.errors import CheckpointError
from ..cli.parsing import print_error
from ..parallel.device import backend_for, resolve_device
from .args import ArgumentError
from .flag_words import in_flag_terms_error, say_warnings_in_flag_terms
from .interrupts import RunStopped, StopSignals

__all__ = ["run_training", "run_with_process_group", "end_with_launcher", "exit_multi_rank"]


def run_with_process_group(body: Callable[[], None], world_size: int, rank: int, prog: str,
                           device: str = "cpu") -> int:
    """Pick this rank's ``--device`` and, when ``world_size > 1``, initialise the process group for it
    (:func:`~peftckpt.parallel.device.backend_for`); run ``body``, tear down; returns the exit code.

    A user error (bad flag value found late, bad checkpoint) is printed as ``peftckpt <prog>: error: ...``
    and gives 2 (flags) or 1 (checkpoints); a run stopped by a signal prints where it can resume and gives
    its exit code (:mod:`~peftckpt.train.interrupts`)."""
    end_with_launcher()
    device_error: ArgumentError | None = None
    try:
        backend = backend_for(resolve_device(device))
    except ValueError as e:  # the same on every rank: said once, after a gloo group lets them leave together
        device_error, backend = ArgumentError(str(e)), "gloo"
        device_error.every_rank = True  # type: ignore[attr-defined]
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
    code = 1
    agreed = False  # every rank leaves at the same point: wait for the others before tearing down
    try:
        if device_error is not None:
            raise device_error
        with say_warnings_in_flag_terms(f"peftckpt {prog}"):
            body()
        code, agreed = 0, True
    except RunStopped as e:  # a signal, agreed by every rank
        if rank == 0:
            print(f"peftckpt {prog}: {e}", file=sys.stderr)
        code, agreed = e.exit_code, True
    except KeyboardInterrupt:  # a second Ctrl-C (or one before the handlers): at once, wherever this rank was
        if rank == 0:
            print(f"peftckpt {prog}: interrupted at once; nothing more was saved", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)  # peers may be inside a collective: no teardown
    except (ArgumentError, CheckpointError) as e:
        # Raised alike on every rank: said once, by rank 0. Other errors may be one rank's own.
        if rank == 0 or not (isinstance(e, ArgumentError) or getattr(e, "every_rank", False)):
            print_error(f"peftckpt {prog}", in_flag_terms_error(e))
        code = 2 if isinstance(e, ArgumentError) else 1
        # Known to be raised by every rank (an agreed error): all can wait for rank 0 to have said it, so
        # torchrun does not stop rank 0 mid-message when a peer exits first.
        agreed = bool(getattr(e, "every_rank", False))
    finally:
        # Tear down while the interpreter is fully alive: drop every object that holds a process group
        # (pipeline stages, async-save group), wait for the peers, then destroy. Gloo groups destroyed
        # during interpreter finalisation, or while a peer already closed its sockets, can abort the process.
        gc.collect()
        if dist.is_initialized():
            if agreed:
                dist.barrier()
                if code and threading.current_thread() is threading.main_thread():
                    # Every rank now leaves with this same code; a launcher that sees a peer exit first stops the
                    # others with SIGTERM, which would end this rank with another code mid-teardown.
                    signal.signal(signal.SIGTERM, signal.SIG_IGN)
            dist.destroy_process_group()
    return code


def run_training(args: argparse.Namespace, world_size: int, rank: int) -> int:
    """Train per ``args`` (see :class:`~peftckpt.train.trainer.Trainer`); returns the exit code."""

    def body() -> None:
        from .checkpoint_flags import check_checkpoint_paths
        from .trainer import Trainer

        lock = check_checkpoint_paths(args, rank)  # before any model is built: fail now, not after training
        signals = StopSignals(save_on_sigterm=args.exit_signal_handler, distributed=world_size > 1)
        try:
            with signals.installed():  # from here a signal stops the run at the next iteration boundary
                Trainer(args, world_size, rank, stop=signals).run()
        finally:
            if lock is not None:
                lock.release()

    return run_with_process_group(body, world_size, rank, "train", args.device)


def end_with_launcher() -> None:
    """Under ``torchrun``, make this worker die with its launcher.

    torchrun starts each worker in a session of its own, so a launcher killed with SIGKILL (OOM killer,
    ``kill -9``) takes no worker with it: they would go on training and saving into ``--save`` next to a
    rerun. Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG)``) sends SIGKILL to the worker the moment
    its parent exits; a kill is safe at any point, since a save commits atomically or not at all. Elsewhere
    (not Linux, not under torchrun) nothing changes."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before the signal was armed
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def exit_multi_rank(code: int, world_size: int) -> int:
    """After a multi-rank run whose process groups are destroyed, exit without interpreter finalisation.

    Gloo's C++ threads torn down by static destructors there occasionally abort the process ("terminate
    called without an active exception"), turning a finished run into a failure."""
    if world_size > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
