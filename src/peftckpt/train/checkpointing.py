"""Trainer <-> checkpoint library glue: the checkpoint flags and their validation."""

from __future__ import annotations

import argparse

__all__ = ["add_checkpoint_args", "validate_checkpoint_args"]


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """Checkpoint flags (Megatron-LM names)."""


def validate_checkpoint_args(args: argparse.Namespace) -> None:
    """Refuse checkpoint flag combinations that cannot work."""
