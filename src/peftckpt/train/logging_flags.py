"""The trainer's experiment-tracking flags (Megatron-LM names): TensorBoard and Weights & Biases.

Both write, on global rank 0 only, the values ``--metrics-file`` holds (see :mod:`peftckpt.train.metrics`). Their
packages come with the ``logging`` extra; a flag whose package is missing is refused at parse time, before torch
is imported or any model is built (:func:`check_logging_packages`).
"""

from __future__ import annotations

import argparse
import importlib.util

from ..checkpoint.location.urls import local_only_problem
from .errors import ArgumentError

__all__ = ["add_logging_backend_args", "validate_logging_args", "check_logging_packages", "missing_package_message",
           "FLAG_PACKAGES"]

FLAG_PACKAGES = {"--tensorboard-dir": "tensorboard", "--wandb-project": "wandb"}
"""The package each experiment-tracking flag needs (both in the ``logging`` extra)."""


def add_logging_backend_args(g: argparse._ArgumentGroup) -> None:
    """``--tensorboard-dir``, ``--tensorboard-log-interval`` and ``--wandb-*`` into the "logging" group."""
    g.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="write the metrics (loss, lr, grad_norm, tokens_per_s; eval_loss) as TensorBoard scalars "
                   "here, step = iteration; rank 0 only (needs the logging extra)")
    g.add_argument("--tensorboard-log-interval", type=int, default=None, metavar="N",
                   help="TensorBoard and W&B get the training scalars every N iterations, eval_loss at every "
                   "evaluation (default: 1)")
    g.add_argument("--wandb-project", default=None, metavar="NAME",
                   help="log the same values to this Weights & Biases project (rank 0; needs the logging extra); "
                   "offline when WANDB_MODE is unset and no API key is configured")
    g.add_argument("--wandb-exp-name", default=None, metavar="NAME", help="the W&B run's name (default: W&B's)")
    g.add_argument("--wandb-save-dir", default=None, metavar="DIR",
                   help="where W&B keeps the run's files, in DIR/wandb (default: $WANDB_DIR, else the current "
                   "directory)")


def missing_package_message(flag: str, package: str) -> str:
    """The one line for a flag whose package is not installed (worded as the s3fs one of object-store URLs)."""
    return (f"{flag} needs the {package} package, which is not installed (pip install {package}, or the logging "
            "extra: pip install '.[logging]' in a peftckpt checkout)")


def check_logging_packages(args: argparse.Namespace) -> None:
    """``ArgumentError`` naming the flag and the extra when a given tracking flag's package is missing. Looked up,
    not imported (wandb takes a second to import): a package that is there but broken fails when rank 0 opens
    its writer."""
    for flag, package in FLAG_PACKAGES.items():
        if getattr(args, flag[2:].replace("-", "_"), None) and importlib.util.find_spec(package) is None:
            raise ArgumentError(missing_package_message(flag, package))


def validate_logging_args(args: argparse.Namespace) -> None:
    """Refuse tracking flags that would do nothing or cannot work; fills ``--tensorboard-log-interval``'s default."""
    if not args.wandb_project:
        given = [flag for flag, value in (("--wandb-exp-name", args.wandb_exp_name),
                                          ("--wandb-save-dir", args.wandb_save_dir)) if value]
        if given:
            raise ArgumentError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --wandb-project")
    if args.tensorboard_log_interval is not None:
        if not (args.tensorboard_dir or args.wandb_project):
            raise ArgumentError("--tensorboard-log-interval needs --tensorboard-dir or --wandb-project")
        if args.tensorboard_log_interval < 1:
            raise ArgumentError(f"--tensorboard-log-interval must be >= 1, got {args.tensorboard_log_interval}")
    else:
        args.tensorboard_log_interval = 1
    for flag, value in (("--tensorboard-dir", args.tensorboard_dir), ("--wandb-save-dir", args.wandb_save_dir)):
        problem = local_only_problem(value) if value else None
        if problem is not None:
            raise ArgumentError(f"{flag} {value} {problem}")
    check_logging_packages(args)
