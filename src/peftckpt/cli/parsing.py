"""What every command's parsing and error reporting share."""

from __future__ import annotations

import argparse
import copy
import difflib
import os
import sys
import time
import traceback
from collections.abc import Sequence
from typing import NoReturn

__all__ = ["parse_or_exit_code", "print_error", "HelpFormatter", "FlagParser", "say_once", "DEBUG_ENV"]

DEBUG_ENV = "PEFTCKPT_DEBUG"
"""Set (to anything but empty or ``0``) to print the traceback under an expected error's one-line message."""


def print_error(prog: str, exc: BaseException) -> None:
    """``<prog>: error: <message>`` on stderr; the traceback too when :data:`DEBUG_ENV` is set."""
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{prog}: error: {exc}", file=sys.stderr)


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` that states every option's default: ``(default: X)``, ``(default: off)`` for switches; a
    help text that already says its default (``default:``) is left as written."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings:  # argparse prints no help line at all without text
            action = copy.copy(action)
            action.help = ""
            action.help = (self._get_help_string(action) or "").replace("%", "%%")
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS or "default" in text
                or action.dest == "help"):
            return text
        if action.nargs == 0:  # store_true / BooleanOptionalAction
            said = "on" if action.default else "off"
        elif action.default is None or action.default == []:
            said = "none"
        elif isinstance(action.default, list | tuple):
            said = " ".join(map(str, action.default))
        else:
            said = str(action.default)
        return f"{text.strip()} (default: {said})".lstrip()


class FlagParser(argparse.ArgumentParser):
    """argparse, with a usage error said first and alone: ``<prog>: error: <message>`` (an unknown flag with the
    closest known ones), then the usage when it is a line or three, else where to find it -- never a page of
    synopsis before the one line that matters; said once under torchrun (rank 0), exit 2."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage().strip()
        hint = usage if usage.count("\n") < 3 else f"(`{self.prog} --help` lists every option)"
        say_once(self.prog, _Said(self._with_suggestions(message) + "\n" + hint),
                 int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
        sys.exit(2)

    def _with_suggestions(self, message: str) -> str:
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return message
        known = [o for action in self._actions for o in action.option_strings if o.startswith("--")]
        said = []
        for token in message[len(prefix):].split():
            flag = token.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag.startswith("-") else []
            said.append(f"{token} (did you mean {close[0]}?)" if close else token)
        return f"unrecognized arguments: {' '.join(said)}"


class _Said(Exception):
    """A message to print as it is."""


def say_once(prog: str, exc: BaseException, rank: int, world_size: int) -> None:
    """A usage error every rank found while parsing (no process group yet): rank 0 says it; the others wait a
    moment before they exit, since torchrun stops every worker as soon as one exits with an error -- rank 0
    included, possibly before its message is out."""
    if rank == 0:
        print_error(prog, exc)
    elif world_size > 1:
        time.sleep(_PEER_EXIT_DELAY_S)


_PEER_EXIT_DELAY_S = 5.0


def parse_or_exit_code(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace | int:
    """The parsed flags, or the exit code argparse chose (2 for a usage error, 0 for ``--help``) instead of
    raising ``SystemExit``, so a command returns its code like any other outcome."""
    try:
        return parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
