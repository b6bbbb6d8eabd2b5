"""The trainer's checkpoint flags (Megatron-LM names): their definitions, the combinations refused at parse
time, and the start-up check of the paths they name (before any model is built)."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.checks.strictness import StrictHandling
from ..checkpoint.errors import CheckpointError
from ..checkpoint.location.dir_lock import SaveDirInUseError
from ..checkpoint.location.urls import url_problem
from ..checkpoint.storage.manifest import TORCH, TORCH_DIST
from .errors import ArgumentError

if TYPE_CHECKING:
    from ..checkpoint.location.base import Held

__all__ = ["add_checkpoint_args", "validate_checkpoint_args", "check_checkpoint_paths"]


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """Checkpoint flags (Megatron-LM names)."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to, or an object-store URL "
                   "(s3://bucket/prefix; credentials and endpoint from the AWS environment)")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    g.add_argument("--load", default=None, help="resume from the newest committed checkpoint of this directory (or s3:// URL)")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="the base weights, loaded (model only) before --load: a full torch_dist checkpoint (a "
                   "directory or s3:// URL) or an HF Llama directory (config.json + safetensors, read per rank without conversion)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model weights from --load and start at iteration 0")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG state")
    g.add_argument("--no-save-optim", action="store_true", help="do not save the optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="do not save the RNG state")
    g.add_argument("--ckpt-format", choices=[TORCH_DIST, TORCH], default=TORCH_DIST)
    g.add_argument("--ckpt-convert-format", choices=[TORCH_DIST, TORCH], default=None,
                   help="load --load, save it in this format to --ckpt-convert-save, then exit")
    g.add_argument("--ckpt-convert-save", default=None)
    g.add_argument("--dist-ckpt-strictness", choices=[m.value for m in StrictHandling],
                   default=StrictHandling.ASSUME_OK_UNEXPECTED.value)
    g.add_argument("--save-trainable-params-only", action="store_true",
                   help="save only parameters with requires_grad (the adapters) and their optimizer state")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="fail if --load holds no checkpoint instead of starting from scratch")
    g.add_argument("--no-verify-base", action="store_true",
                   help="load an adapter even if the base fingerprint differs from the one it was trained on")
    g.add_argument("--no-verify-checksums", action="store_true",
                   help="skip re-reading every checkpoint file to check its checksum before loading")
    g.add_argument("--no-base-cache", action="store_true",
                   help="read a --pretrained-checkpoint on an object store by ranges, each rank its own pieces, "
                        "instead of keeping a copy in the host's base cache ($PEFTCKPT_CACHE_DIR/bases, capped at "
                        "$PEFTCKPT_BASE_CACHE_GB GB) for the next run")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, if --save is set) when the iteration is a multiple of N")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background: training waits only for the copy to host memory")
    g.add_argument("--keep-last-k", type=int, default=None, help="keep only the newest K checkpoints in --save")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (what SLURM and Kubernetes send before preemption), finish the iteration, save "
                   "a checkpoint, wait for its commit and exit 0; without it SIGTERM stops like Ctrl-C: at the "
                   "next iteration boundary, without a new save, exit 143")


PATH_FLAGS = ("save", "load", "pretrained_checkpoint", "ckpt_convert_save")


def refuse_urls(args: argparse.Namespace) -> None:
    """A checkpoint path flag given a URL peftckpt cannot store on (an unknown scheme, a missing package, no
    bucket) is refused before anything reads or writes it (it would otherwise name a local directory ``s3:``)."""
    for dest in PATH_FLAGS:
        value = getattr(args, dest, None)
        problem = url_problem(value) if value else None
        if problem is not None:
            raise ArgumentError(f"--{dest.replace('_', '-')} {value} {problem}")


def validate_checkpoint_args(args: argparse.Namespace) -> None:
    """Refuse checkpoint flag combinations that cannot work."""
    if args.save_trainable_params_only and args.ckpt_format != TORCH_DIST:
        raise ArgumentError("--save-trainable-params-only needs --ckpt-format torch_dist (the legacy torch format "
                            "detaches tensors, losing requires_grad)")
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        raise ArgumentError("--save-interval needs --save and a value >= 1")
    if args.ckpt_convert_format and not (args.load and args.ckpt_convert_save):
        raise ArgumentError("--ckpt-convert-format needs --load and --ckpt-convert-save")
    if args.ckpt_convert_save and not args.ckpt_convert_format:
        raise ArgumentError("--ckpt-convert-save needs --ckpt-convert-format")
    if args.exit_on_missing_checkpoint and not args.load:
        raise ArgumentError("--exit-on-missing-checkpoint needs --load")
    if args.finetune and not args.load:
        raise ArgumentError("--finetune needs --load")
    if args.async_save and args.ckpt_format != TORCH_DIST:
        raise ArgumentError("--async-save needs --ckpt-format torch_dist")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ArgumentError(f"--exit-interval must be >= 1, got {args.exit_interval}")
    if args.exit_signal_handler and not args.save:
        raise ArgumentError("--exit-signal-handler needs --save (where the checkpoint taken on SIGTERM goes)")
    if args.keep_last_k is not None and args.keep_last_k < 1:
        raise ArgumentError(f"--keep-last-k must be >= 1, got {args.keep_last_k}")


def _save_dir_problem(flag: str, path: Path) -> str | None:
    """Why ``path`` cannot become a save directory, or ``None``: it is a writable directory, or its nearest
    existing ancestor is one (the run lock creates it). Nothing is left behind by the check."""
    if path.exists() and not path.is_dir():
        return f"{flag} {path} is a file, not a directory"
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{flag} {path} is not a writable directory ({probe} is a file)"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".peftckpt-write-test."):
            pass
    except OSError as e:
        return f"{flag} {path} is not a writable directory ({e.strerror or e})"
    return None


def _read_dir_problem(flag: str, path: Path, must_exist: bool) -> str | None:
    """Why ``path`` cannot be read as a checkpoint or save directory, or ``None``."""
    if not path.exists():
        return f"{flag} {path} does not exist" if must_exist else None
    if not path.is_dir():
        return f"{flag} {path} is a file, not a checkpoint or save directory"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{flag} {path} is not readable"
    return None


def check_checkpoint_paths(args: argparse.Namespace, rank: int) -> Held | None:
    """Before any model is built or any iteration runs (collective): every rank checks that ``--load`` and
    ``--pretrained-checkpoint`` are readable and that ``--save`` (and ``--ckpt-convert-save``) is, or can be
    created as, a writable directory (rank 0 probes a store location once: nothing is written); rank 0 then locks
    the save location for the run's life (creating a directory; a run that ends without saving anything leaves
    no trace of it, see ``SaveDirLock.release``).

    Returns the lock (rank 0, with ``--save``), to release when the run ends.

    Raises (on every rank, with the same message):
        ArgumentError: a path flag that cannot work, naming the flag, the path and the rank(s).
        SaveDirInUseError: another live run holds the save location.
    """
    from ..checkpoint.collectives import Collectives  # torch: only once a run starts
    from ..checkpoint.location.locate import locate

    flags = {"--load": args.load, "--pretrained-checkpoint": args.pretrained_checkpoint, "--save": args.save,
             "--ckpt-convert-save": args.ckpt_convert_save}
    locs = {flag: locate(v, flag) for flag, v in flags.items() if v}
    local = {flag: path for flag, loc in locs.items() if (path := loc.local_dir()) is not None}
    problems = [p for flag, must_exist in (("--load", False), ("--pretrained-checkpoint", True)) if flag in local
                and (p := _read_dir_problem(flag, local[flag], must_exist)) is not None]
    if not problems:
        problems = [p for flag in ("--save", "--ckpt-convert-save")
                    if flag in local and (p := _save_dir_problem(flag, local[flag])) is not None]
    if not problems and rank == 0:  # one probe of each store location (nothing is written)
        problems = [p for flag, loc in locs.items() if (p := loc.store_problem(flag)) is not None]
    comm = Collectives()
    found = comm.gather(problems)
    if any(found):
        lines = dict.fromkeys(p for ps in found for p in ps)
        ranks = [r for r, ps in enumerate(found) if ps]
        where = "" if len(found) == 1 else f" (seen by rank(s) {', '.join(map(str, ranks))})"
        raise ArgumentError("; ".join(lines) + where)
    lock: Held | None = None
    error: tuple[bool, str] | None = None
    flag = "--ckpt-convert-save" if args.ckpt_convert_format else "--save"
    if rank == 0 and flag in locs:
        try:
            lock = locs[flag].lock()
        except SaveDirInUseError as e:
            error = (True, str(e))
        except OSError as e:
            error = (False, f"cannot lock save directory {locs[flag].text}: {e.strerror or e}")
        except CheckpointError as e:
            error = (False, f"cannot lock save location {locs[flag].text}: {e}")
    errors = [e for e in comm.gather(error) if e]
    if errors:
        in_use, message = errors[0]
        refused = SaveDirInUseError(message) if in_use else CheckpointError(message)
        refused.every_rank = True
        raise refused
    return lock
