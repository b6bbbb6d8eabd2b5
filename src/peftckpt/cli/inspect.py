"""``peftckpt inspect DIR [--keys] [--json] [--no-verify-checksums]``: parsing first (``--help`` imports no
torch), then the report (:mod:`peftckpt.checkpoint.tools.inspect`) and its text (:mod:`peftckpt.cli.inspect_text`)."""

from __future__ import annotations

import argparse
import os
import sys

from ..checkpoint.errors import CheckpointError
from ..checkpoint.location.names import MANIFEST_FILENAME, TRACKER_FILENAME
from .parsing import FlagParser, HelpFormatter, parse_or_exit_code, print_error

__all__ = ["inspect_main"]


_EPILOG = f"""\
DIR is a save directory (the checkpoint its {TRACKER_FILENAME} names is
inspected, and every iter_*, staging and trash directory is listed with its state) or one
checkpoint directory, committed or not.

states: committed (manifest valid, files intact), uncommitted (staging directory or no
{MANIFEST_FILENAME}: a save stopped before its commit), corrupted (manifest invalid, a file
missing/truncated/altered, or a pickle refused by the restricted unpickler). Nothing from the
checkpoint is ever executed.

cost: by default every file of the inspected checkpoint is re-read and hashed, like a
load does (about disk speed: seconds for an adapter, minutes for a 100 GB full checkpoint).
--no-verify-checksums only compares file presence and sizes with the manifest and reads just
the metadata. The other directories of a save directory are always checked that cheap way.

exit codes: 0 committed and intact, 1 uncommitted / corrupted / refused, 2 usage error (bad DIR)."""


class _Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown; the epilog's lines kept as written."""


def _build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="peftckpt inspect",
        description="Report on a checkpoint offline: commit state, format, iteration, layout, sections, "
                    "keys (global shapes, dtypes, bytes, trainable) and sizes.",
        epilog=_EPILOG,
        formatter_class=_Formatter,
    )
    parser.add_argument("dir", metavar="DIR", help="a save directory or a checkpoint (iter_*) directory")
    parser.add_argument("--keys", action="store_true",
                        help="also print the per-key table, grouped by section (the summary is the default)")
    parser.add_argument("--json", action="store_true",
                        help="print the JSON report (versioned by its schema_version field; every key included) "
                             "instead of text")
    parser.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                        help="skip re-reading and hashing every file; check only presence and sizes")
    return parser


def inspect_main(argv: list[str] | None = None) -> int:
    """``peftckpt inspect DIR [--keys] [--json] [--no-verify-checksums]``; returns the exit code."""
    args = parse_or_exit_code(_build_parser(), argv)
    if isinstance(args, int):
        return args
    from ..checkpoint.tools.inspect import inspect_path
    from .inspect_text import render_text

    try:
        report = inspect_path(args.dir, verify_checksums=args.verify_checksums)
    except CheckpointError as exc:  # only a bad DIR gets here
        print_error("peftckpt inspect", exc)
        return 2
    try:
        print(report.to_json() if args.json else render_text(report, args.keys), end="\n" if args.json else "")
        sys.stdout.flush()
    except BrokenPipeError:  # `peftckpt inspect DIR | head`: the reader left, which is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if report.exit_code:
        print(f"peftckpt inspect: {report.path}: {report.state}, not loadable", file=sys.stderr)
    return report.exit_code
