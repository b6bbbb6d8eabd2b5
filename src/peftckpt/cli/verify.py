"""``peftckpt verify [--all] DIR [--json]``: exit 0 intact, 1 problems found (one line each), 2 usage error.

``--all`` verifies every committed checkpoint of the save location ``DIR``, newest first: one line each, then a
summary; exit 0 only if every one is intact."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from ..checkpoint.errors import CheckpointError
from ..checkpoint.location.urls import url_problem
from .parsing import FlagParser, HelpFormatter, parse_or_exit_code

if TYPE_CHECKING:
    from ..checkpoint.location.base import Location

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
    parser.add_argument("--all", action="store_true",
                        help="verify every committed checkpoint of the save directory DIR, newest first, not only "
                             "the one its tracker names")
    return parser


def verify_main(argv: list[str] | None = None) -> int:
    """``peftckpt verify [--all] DIR [--json]``. Exit code: 0 intact, 1 problems found, 2 usage error."""
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

    if args.all:
        return _verify_all(target, args.json)
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
    earlier = "" if str(report.path) == target.text else f"; `peftckpt verify --all {target.text}` checks the earlier ones"
    print(f"FAILED {report.path}: {len(report.problems)} problem(s){earlier}", file=sys.stderr)
    return 1


_SHOWN_PROBLEMS = 3
"""Problems named on a damaged checkpoint's line of ``--all`` (``--json`` lists every one)."""


def _verify_all(target: Location, as_json: bool) -> int:
    """``--all``: one line per committed checkpoint of the save location ``target``, newest first, then a summary
    (on stderr when one is damaged); exit 0 only if every one is intact."""
    from ..checkpoint.tools.verify import verify_all

    if target.holds_manifest():
        print(f"peftckpt verify: error: DIR {target.text} is a checkpoint, not a save directory; --all takes the "
              f"save directory ({target.parent}), or leave --all out to verify this checkpoint alone", file=sys.stderr)
        return 2
    try:
        found = verify_all(target)
    except CheckpointError as exc:
        if as_json:
            print(json.dumps({"path": target.text, "ok": False, "problems": [str(exc)], "checkpoints": []}, indent=2))
        print(f"peftckpt verify: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(found.to_dict(), indent=2))
    else:
        for r in found.checkpoints:
            if r.ok:
                print(f"OK      {r.path} (iteration {r.iteration}, {r.num_files} files, {r.total_bytes / 2**20:.1f} MiB)")
            else:
                more = len(r.problems) - _SHOWN_PROBLEMS
                said = "; ".join(p.replace("\n", " ") for p in r.problems[:_SHOWN_PROBLEMS])
                print(f"DAMAGED {r.path}: {said}" + (f"; and {more} more problem(s)" if more > 0 else ""))
    damaged = [r.iteration for r in found.checkpoints if not r.ok]
    newest = found.newest_intact
    summary = (f"{found.path}: {len(found.checkpoints)} committed checkpoint(s), "
               f"{len(found.checkpoints) - len(damaged)} intact, {len(damaged)} damaged"
               + (f" (iteration{'s' if len(damaged) > 1 else ''} {', '.join(map(str, damaged))})" if damaged else "")
               + ("" if found.tracker is None else f"; the tracker names iteration {found.tracker}")
               + ("" if found.tracker_problem is None else f"; {found.tracker_problem}")
               + ("" if not damaged else "; no intact checkpoint" if newest is None
                  else f"; newest intact: {newest.path}"))
    if found.ok:
        if not as_json:
            print(summary)
        return 0
    print(f"FAILED {summary}", file=sys.stderr)
    return 1
