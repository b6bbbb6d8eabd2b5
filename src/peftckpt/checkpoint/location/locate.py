"""A flag's or an argument's value as its :class:`~.base.Location`, and what the library and the trainer ask of
any location without caring which kind it is."""

from __future__ import annotations

import os

from ..storage.manifest import Manifest
from . import protocol
from .base import Location
from .directory import Directory
from .store import StorePrefix
from .urls import parse_location

__all__ = ["locate", "manifest_at", "tracker_at"]


def locate(value: str | os.PathLike[str] | Location, what: str) -> Location:
    """``value`` (a path, a ``file://`` or store URL, or already a location) as a :class:`Location`; ``what``
    (``"--save"``, ``"checkpoint"``) names it in the one error an unsupported URL gets."""
    if isinstance(value, Location):
        return value
    parsed = parse_location(value, what)
    return StorePrefix(parsed) if not isinstance(parsed, os.PathLike) else Directory(parsed)


def manifest_at(value: str | os.PathLike[str]) -> Manifest:
    """The manifest of the committed checkpoint a path or a URL designates (as a load would resolve it)."""
    loc = locate(value, "checkpoint")
    return loc.read_manifest(protocol.resolve(loc)[0])


def tracker_at(value: str | os.PathLike[str]) -> int | None:
    """The iteration the tracker of a save location names, ``None`` without one."""
    return protocol.read_tracker(locate(value, "save directory"))
