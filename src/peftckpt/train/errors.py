"""Errors of the trainer's command line."""

from __future__ import annotations

__all__ = ["ArgumentError"]


class ArgumentError(ValueError):
    """A flag value or combination that cannot work."""
