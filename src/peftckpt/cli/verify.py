"""``peftckpt verify DIR [--json]``: exit 0 intact, 1 problems found (one line each), 2 usage error."""

from __future__ import annotations

import argparse
import json
import sys

from ..checkpoint.errors import CheckpointError
from ..checkpoint.location.urls import url_problem
from .parsing import FlagParser, HelpFormatter, parse_or_exit_code

__all__ = ["verify_main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="peftckpt verify",
        description="Check a checkpoint offline: manifest, file sizes and checksums, DCP metadata.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "dir", metavar="DIR", help="a save directory (uses its tracker) or an iter_* directory"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    return parser


def verify_main(argv: list[str] | None = None) -> int:
    """``peftckpt verify DIR [--json]``. Exit code: 0 intact, 1 problems found, 2 usage error."""
    args = parse_or_exit_code(_build_parser(), argv)
    if isinstance(args, int):
        return args
    problem = url_problem(args.dir)
    if problem is not None:
        print(f"peftckpt verify: error: DIR {args.dir} {problem}", file=sys.stderr)
        return 2
    from ..checkpoint.location.locate import locate  # torch: not needed to parse flags or print --help
    from ..checkpoint.tools.verify import verify_checkpoint

    target = locate(args.dir, "DIR")
    if target.known_missing():
        print(f"peftckpt verify: error: DIR {target.text} does not exist", file=sys.stderr)
        return 2

    try:
        report = verify_checkpoint(target)
    except CheckpointError as exc:
        if args.json:
            print(json.dumps({"path": target.text, "ok": False, "problems": [str(exc)]}, indent=2))
        print(f"peftckpt verify: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    if report.ok:
        if not args.json:
            mib = report.total_bytes / 2**20
            print(f"OK {report.path} (iteration {report.iteration}, {report.num_files} files, {mib:.1f} MiB)")
        return 0
    for problem in report.problems:
        print(problem, file=sys.stderr)
    print(f"FAILED {report.path}: {len(report.problems)} problem(s)", file=sys.stderr)
    return 1
