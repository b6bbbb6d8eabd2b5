"""The reference trainer: flags, data, loop and its checkpoint integration.

Names are imported on first use (see :mod:`peftckpt._lazy`)."""

# ruff: noqa: F401 -- the TYPE_CHECKING imports re-export the lazy names to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .args import ArgumentError, build_parser, parse_train_args
    from .trainer import Trainer

_EXPORTS = {
    "ArgumentError": ".args", "build_parser": ".args", "parse_train_args": ".args", "Trainer": ".trainer",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
