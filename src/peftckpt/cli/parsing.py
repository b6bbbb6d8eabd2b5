"""What every command's parsing shares."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["parse_or_exit_code"]


def parse_or_exit_code(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The parsed flags, or the exit code argparse chose (2 for a usage error, 0 for ``--help``) instead of
    raising ``SystemExit``, so a command returns its code like any other outcome."""
    try:
        return parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
