"""``peftckpt plot METRICS [-o OUT.png]``: loss (and eval loss) and learning rate against iteration, one PNG.

It reads a ``--metrics-file`` of ``peftckpt train``. A resumed run appends to the same file, so an iteration can
appear more than once: the last record of each counts (the run that went on from there). Lines that are not
metrics records (a line cut short by a killed run, say) are left out and counted in one warning. Exit codes: 0
written (its path printed), 1 a file that cannot be read or holds no training record (one line naming it), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..json_text import parse_json
from .parsing import FlagParser, HelpFormatter, parse_or_exit_code, print_error

__all__ = ["plot_main", "read_metrics", "draw", "Curves", "MetricsFileError"]

PROG = "peftckpt plot"


class MetricsFileError(ValueError):
    """A metrics file that cannot be plotted; the message names it."""


@dataclass
class Curves:
    """What a metrics file holds, the last record of each iteration."""

    train: dict[int, tuple[float, float]] = field(default_factory=dict)
    """iteration -> (loss, lr), in iteration order once read."""
    evals: dict[int, float] = field(default_factory=dict)
    """iteration -> eval_loss."""
    skipped: list[int] = field(default_factory=list)
    """Line numbers (1-based) that are not metrics records."""


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def read_metrics(path: Path) -> Curves:
    """The training and eval records of ``path`` (JSON lines), the last one per iteration; raises
    :class:`MetricsFileError` naming the file when it is missing, unreadable, empty or holds no training record."""
    curves = Curves()
    train: dict[int, tuple[float, float]] = {}
    evals: dict[int, float] = {}
    lines = 0
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                lines += 1
                try:
                    record = parse_json(line)
                except json.JSONDecodeError:
                    record = None
                iteration = record.get("iteration") if isinstance(record, dict) else None
                if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
                    curves.skipped.append(number)
                    continue
                assert isinstance(record, dict)
                loss, lr, eval_loss = (_number(record.get(k)) for k in ("loss", "lr", "eval_loss"))
                if loss is not None:
                    train[iteration] = (loss, math.nan if lr is None else lr)
                elif eval_loss is not None:
                    evals[iteration] = eval_loss
                else:
                    curves.skipped.append(number)
    except FileNotFoundError:
        raise MetricsFileError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise MetricsFileError(f"{path} is a directory, not a metrics file") from None
    except UnicodeDecodeError:
        raise MetricsFileError(f"cannot read {path}: not UTF-8 text (expected a --metrics-file, JSON lines)") from None
    except OSError as e:
        raise MetricsFileError(f"cannot read {path}: {e.strerror or e}") from None
    if lines == 0:
        raise MetricsFileError(f"{path} is empty")
    if not train:
        raise MetricsFileError(f"{path} holds no training record (a JSON line with iteration and loss, as "
                               "peftckpt train --metrics-file writes)")
    curves.train = dict(sorted(train.items()))
    curves.evals = dict(sorted(evals.items()))
    return curves


def draw(curves: Curves, out: Path, title: str) -> None:
    """Two panels sharing the iteration axis -- loss (and eval loss), learning rate -- as a PNG at ``out``
    (matplotlib's Agg canvas; pyplot and its global state are not used). Written next to ``out`` and renamed
    onto it, so a failed write leaves no partial image."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    its = list(curves.train)
    losses = [loss for loss, _ in curves.train.values()]
    lrs = [lr for _, lr in curves.train.values()]
    marker = "o" if len(its) == 1 else None
    fig = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_lr = fig.subplots(2, 1, sharex=True, height_ratios=[2, 1])
    ax_loss.plot(its, losses, label="loss", linewidth=1, marker=marker)
    if curves.evals:
        ax_loss.plot(list(curves.evals), list(curves.evals.values()), label="eval_loss", marker="o", markersize=3)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(title)
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.plot(its, lrs, color="tab:green", linewidth=1, marker=marker)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("iteration")
    ax_lr.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax_lr.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        fig.savefig(partial, format="png", dpi=100)
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)


def _build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog=PROG, formatter_class=HelpFormatter,
                        description="Plot a peftckpt train --metrics-file: loss (and eval loss) and learning rate "
                        "against iteration, as a PNG. Needs matplotlib (the logging extra).")
    parser.add_argument("metrics", metavar="METRICS", help="the --metrics-file of a run (JSON lines)")
    parser.add_argument("-o", "--output", metavar="OUT.png", default=None,
                        help="the PNG to write (default: METRICS with the suffix .png)")
    return parser


def plot_main(argv: list[str] | None = None) -> int:
    """``peftckpt plot METRICS [-o OUT.png]``; returns the exit code (0 written, 1 a bad metrics file, 2 usage)."""
    parser = _build_parser()
    args = parse_or_exit_code(parser, argv)
    if isinstance(args, int):
        return args
    metrics = Path(args.metrics)
    out = Path(args.output) if args.output else metrics.with_suffix(".png")
    if out.exists() and metrics.exists() and out.resolve() == metrics.resolve():
        print(f"{PROG}: error: the output {out} is METRICS itself; pass another -o", file=sys.stderr)
        return 2
    try:
        curves = read_metrics(metrics)
    except MetricsFileError as e:
        print_error(PROG, e)
        return 1
    if curves.skipped:
        print(f"{PROG}: warning: {metrics}: {len(curves.skipped)} line(s) that are not metrics records left out "
              f"(first: line {curves.skipped[0]})", file=sys.stderr)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"{PROG}: error: {PROG} needs the matplotlib package, which is not installed (pip install "
              "matplotlib, or the logging extra: pip install '.[logging]' in a peftckpt checkout)", file=sys.stderr)
        return 1
    try:
        draw(curves, out, title=metrics.name)
    except OSError as e:
        print(f"{PROG}: error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(out)
    return 0
