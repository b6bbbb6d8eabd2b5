"""What the error of a load that found a damaged checkpoint adds: the newest intact earlier checkpoint of its save
location and how to load it (never loaded by itself), or skipping the checksums as the last resort."""

from __future__ import annotations

import os
import warnings

from .checks.load_checks import EarlierCheckpoints, damage_hint, is_damage
from .collectives import Collectives
from .errors import CheckpointError
from .location import protocol
from .location.base import Location
from .location.locate import locate
from .location.names import parse_iteration_dirname
from .tools.verify import newest_intact_before

__all__ = ["explain_damage"]


def explain_damage(comm: Collectives, e: Exception, path: str | os.PathLike[str], search_earlier: bool) -> None:
    """Append to the agreed error ``e`` of a load from ``path`` (in place), when it reports damage, what to do
    instead: rank 0 looks for the newest intact earlier checkpoint (:func:`_damage_hint`) while the other ranks
    wait for its answer, so every rank's error says the same (collective: an agreed error is raised by every
    rank; any other error is left as it is, with no collective)."""
    if not getattr(e, "every_rank", False):
        return
    hint: str | None = None
    if comm.rank == 0 and is_damage(e):
        try:
            hint = _damage_hint(str(e), path, search_earlier)
        except Exception:  # noqa: BLE001 - the error itself is what matters; the hint is a help
            hint = None
    hint = comm.broadcast_from_first(hint)
    if hint and e.args and isinstance(e.args[0], str):
        e.args = (e.args[0] + hint, *e.args[1:])


def _damage_hint(message: str, path: str | os.PathLike[str], search_earlier: bool) -> str:
    """What a damage error (``message``) of a load from ``path`` adds (one process): with ``search_earlier``, the
    newest intact checkpoint of the save location before the damaged one (verified, at most a few tried) or that
    there is none; skipping the checksums only as the last resort, where it could help (checksums failed, on a
    directory only: a store is not offered a load without verification)."""
    loc = locate(path, "checkpoint")
    checksums_help = loc.local_dir() is not None and "checksum mismatch" in message
    earlier: EarlierCheckpoints | None = None
    if search_earlier:
        try:
            with warnings.catch_warnings():  # the load already said how it resolved the location
                warnings.simplefilter("ignore")
                rel, iteration = protocol.resolve(loc)
            save: Location | None = loc
            if not rel:  # a checkpoint itself: its save location, if it is an iter_* in one
                save = locate(loc.parent, "checkpoint") if parse_iteration_dirname(loc.name) is not None else None
            if save is not None:
                earlier = newest_intact_before(save, iteration)
        except CheckpointError:
            earlier = None
    return damage_hint(earlier, checksums_help)
