"""The commit protocol, written once against a :class:`~peftckpt.checkpoint.location.base.Location`.

The rules live here; a location only supplies the steps that differ between a directory and an object store.

* **Committed** means: an ``iter_*`` name that holds its manifest (:func:`list_committed`). A save writes its
  files where no reader looks (a staging name; on a store a fresh ``iter_*`` without its manifest yet) and
  publishes the manifest last (:meth:`Location.publish`), so an interrupted save never looks committed.
* **The tracker** names the newest committed iteration. It moves only after a commit (:func:`commit`): forward
  always, backward only when the caller asks (``allow_tracker_rewind``, a deliberate resume from an older
  iteration); a late save of an older iteration leaves it alone. A crash before it moves leaves it on the
  previous, still complete checkpoint.
* **Resolve** (:func:`resolve`): the tracker's iteration if committed; else a complete stand-in for it left by
  an interrupted re-save; else the newest committed iteration -- both with a :class:`CheckpointFallbackWarning`.
* **A re-save** of a committed iteration always leaves one complete copy with its manifest: the old one moved
  aside (a directory renames twice) or the new one staged (a store copies, manifest last). :func:`clean`, run by
  the next save, finishes what was interrupted and deletes every other leftover.
* **Retention** (:func:`apply_retention`) never deletes the newest checkpoint, the tracker's, or a protected
  one; each deletion uncommits the checkpoint in one step first (:meth:`Location.retire`).
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from .base import CommittedCopy, Location, SaveTarget
from .names import (
    MANIFEST_FILENAME,
    STAGING_PREFIX,
    TRACKER_FILENAME,
    CheckpointFallbackWarning,
    is_leftover_name,
    iteration_dirname,
    looks_like_save_location,
    parse_iteration_dirname,
    stand_in_target,
)

if TYPE_CHECKING:
    from ..collectives import Collectives
    from ..storage.checkpoint_files import CheckpointFiles

__all__ = ["read_tracker", "parse_tracker", "write_tracker", "list_committed", "resolve", "reading", "committed_copy",
           "claim", "unclaim", "in_progress", "clean", "commit", "apply_retention"]

_TRACKER_RE = re.compile(rb"[ \t\r\n]*([0-9]{1,30})[ \t\r\n]*")
_TRACKER_MAX_BYTES = 64
_TRACKER_HINT = "fix or delete it (the newest committed iter_* directory is used when it is absent)"


# ------------------------------------------------------------------------------------------- tracker
def read_tracker(loc: Location) -> int | None:
    """Iteration recorded in the tracker of ``loc``, or ``None`` when there is none.

    A tracker holds plain ASCII decimal digits (surrounding whitespace allowed); anything else -- other
    Unicode digits such as ``٤``, bytes that are not UTF-8, a directory or FIFO in its place -- is garbled.

    Raises:
        CheckpointFormatError: the tracker exists but is garbled.
    """
    try:
        data: bytes | Exception | None = loc.read_small(TRACKER_FILENAME, _TRACKER_MAX_BYTES)
    except FileNotFoundError:
        data = None
    except Exception as e:  # noqa: BLE001 - said by _tracker_in
        data = e
    return _tracker_in(loc, data)


def _tracker_in(loc: Location, data: bytes | Exception | None) -> int | None:
    """The iteration in the tracker ``loc`` read (its bytes, ``None`` when absent, or the error reading it raised)."""
    if isinstance(data, (OSError, ValueError)) and not isinstance(data, FileNotFoundError):
        raise CheckpointFormatError(f"tracker file {loc.describe(TRACKER_FILENAME)} is garbled: it {data}; "
                                    f"{_TRACKER_HINT}") from None
    if isinstance(data, Exception):
        raise data
    return None if data is None else parse_tracker(data, loc.describe(TRACKER_FILENAME))


def parse_tracker(data: bytes, source: object) -> int:
    """The iteration in a tracker's bytes, read from ``source`` (named in the error)."""
    match = _TRACKER_RE.fullmatch(data)
    if match is None:
        raise CheckpointFormatError(
            f"tracker file {source} is garbled: expected a non-negative iteration number in ASCII digits, "
            f"got {data[:40]!r}; {_TRACKER_HINT}"
        )
    return int(match.group(1))


def _tracked_or_none(loc: Location) -> int | None:
    try:
        return read_tracker(loc)
    except CheckpointFormatError:  # a garbled tracker is replaced by the next commit, protects nothing
        return None


def write_tracker(loc: Location, iteration: int) -> None:
    """Atomically set the tracker of ``loc`` to ``iteration``."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    loc.write_atomic(TRACKER_FILENAME, f"{iteration}\n".encode())


# ------------------------------------------------------------------------------------------ listing
def _one_name_each(loc: Location, names: Iterable[str]) -> None:
    """Refuse a location where two names parse to one iteration (``iter_0000100`` and ``iter_00000100``): which
    one a load, a retention or a clean means would be a guess, so none of them acts on it."""
    seen: dict[int, str] = {}
    for name in names:
        iteration = parse_iteration_dirname(name)
        if iteration is not None and iteration in seen:
            raise CheckpointFormatError(
                f"{loc.text}: {seen[iteration]} and {name} both name iteration {iteration}; rename or remove one "
                f"(the name a save writes is {iteration_dirname(iteration)})")
        if iteration is not None:
            seen[iteration] = name


def _committed(loc: Location, names: Iterable[str]) -> list[int]:
    names = list(names)
    _one_name_each(loc, names)
    return sorted(it for n in names if (it := parse_iteration_dirname(n)) is not None and loc.holds_manifest(n))


def list_committed(loc: Location) -> list[int]:
    """Sorted iterations of ``loc`` whose ``iter_*`` holds a manifest (i.e. committed)."""
    return _committed(loc, loc.names())


def _stand_ins(loc: Location, names: Iterable[str]) -> dict[str, list[str]]:
    """Complete copies an interrupted re-save left (holding a manifest), by the ``iter_*`` they stand in for."""
    found: dict[str, list[str]] = {}
    for name in names:
        final = stand_in_target(name) if name.startswith(loc.STAND_IN_PREFIX) else None
        if final is not None and loc.holds_manifest(name):
            found.setdefault(final, []).append(name)
    return {k: sorted(v) for k, v in found.items()}


# ------------------------------------------------------------------------------------------ resolve
def _own_iteration(loc: Location) -> int:
    """The iteration of the checkpoint ``loc`` itself: from its name, else from its manifest."""
    for name in (loc.name, stand_in_target(loc.name) or ""):
        parsed = parse_iteration_dirname(name)
        if parsed is not None:
            return parsed
    return loc.read_manifest().iteration


def resolve(loc: Location, keep_manifest: bool = False) -> tuple[str, int]:
    """Find the committed checkpoint that ``loc`` designates: ``(name relative to loc, iteration)``; the name is
    ``""`` when ``loc`` is a checkpoint itself. ``keep_manifest``: its manifest is read next (a load, a copy): a
    store keeps the one it reads to find out (:meth:`Location.holds_manifest`).

    ``loc`` is either a checkpoint (holding a manifest) or a save location, resolved by the rule in the module
    docstring.

    Raises:
        CheckpointNotFoundError: ``loc`` does not exist, is an uncommitted ``iter_*`` or staging location, or
            is a save location without any committed checkpoint.
        CheckpointFormatError: ``loc`` exists but is neither a checkpoint nor a save location, or its tracker
            is garbled.
    """
    try:
        return _resolved(loc, keep_manifest)
    except Exception:
        # Explained only now (on a store a probe is a request of its own): a missing directory or bucket, or
        # credentials that do not work, said as such rather than as what resolving found without them.
        loc.check_readable()
        raise


def _resolved(loc: Location, keep_manifest: bool) -> tuple[str, int]:
    """:func:`resolve`, the location not probed first."""
    is_staging = loc.name.startswith(STAGING_PREFIX)  # complete or not, staging is never committed
    # Whether the location is a checkpoint itself, and its tracker: both asked at once (one round trip on a store).
    own, tracker = loc.probe(TRACKER_FILENAME, _TRACKER_MAX_BYTES, keep=keep_manifest and not is_staging)
    if own and not is_staging:
        return "", _own_iteration(loc)
    if parse_iteration_dirname(loc.name) is not None or is_staging:
        why = "it is the staging directory of a save" if is_staging else f"it has no {MANIFEST_FILENAME}"
        raise CheckpointNotFoundError(
            f"{loc.text} is not a committed checkpoint ({why}): a save was interrupted before its commit; "
            f"load the save directory {loc.parent} to get the last committed one")
    tracked = _tracker_in(loc, tracker)
    if tracked is not None and loc.holds_manifest(iteration_dirname(tracked), keep=keep_manifest):
        # The common case, decided without listing the location: every rank resolves a load, and on a store a
        # listing per rank would grow the job's LIST requests with its size. (The manifest is kept for the load.)
        return iteration_dirname(tracked), tracked
    names = loc.names()
    committed = _committed(loc, names)
    if tracked is not None:
        if tracked in committed:
            return iteration_dirname(tracked), tracked
        copies = _stand_ins(loc, names).get(iteration_dirname(tracked))
        if copies:
            warnings.warn(
                f"{loc.text}: iteration {tracked} named by {TRACKER_FILENAME} was being re-saved when the save "
                f"stopped; using its {loc.STAND_IN_WORDS} {loc.describe(copies[-1])} (the next save finishes the "
                "re-save)", CheckpointFallbackWarning, stacklevel=2)
            return copies[-1], tracked
    if not committed:
        if tracked is not None or looks_like_save_location(names) or not names:
            where = "" if tracked is None else f" ({TRACKER_FILENAME} names iteration {tracked})"
            raise CheckpointNotFoundError(f"no committed checkpoint in {loc.text}{where}")
        raise CheckpointFormatError(
            f"{loc.text} is neither a peftckpt checkpoint (no {MANIFEST_FILENAME}) nor a save directory "
            f"(no {TRACKER_FILENAME}, no iter_* directories)")
    newest = committed[-1]
    reason = (f"there is no {TRACKER_FILENAME}" if tracked is None
              else f"{TRACKER_FILENAME} names iteration {tracked}, which is not committed")
    warnings.warn(f"{loc.text}: {reason}; using the newest committed checkpoint, iteration {newest}",
                  CheckpointFallbackWarning, stacklevel=2)
    return iteration_dirname(newest), newest


# ---------------------------------------------------------------------------------------- cleaning
_IN_PROGRESS: dict[str, set[str]] = {}
"""The saves in progress in this process, by location: ``{location text: {target name, ...}}``."""
_IN_PROGRESS_GUARD = threading.Lock()


@contextlib.contextmanager
def reading(loc: Location, comm: Collectives, cache: bool = False, verify_first: bool = False
            ) -> Iterator[CheckpointFiles | None]:
    """Collective: the files a load reads the committed checkpoint ``loc`` designates from, where they are not the
    location itself (``None``: a directory, read in place, which the load resolves). A location read through a local
    directory of its own (a store's: its small files, or a verified copy) is resolved by rank 0 (its warnings said there), its error
    raised on every rank with its type -- a caller tells "no checkpoint yet" (:class:`CheckpointNotFoundError`, a
    first ``--load`` that starts from scratch) from a real failure the same way on every rank -- and then fetched
    (:meth:`Location.fetched`; ``cache``: a base, kept in the host's base cache; ``verify_first``: every file
    verified before the load reads any)."""
    if not loc.fetched_to_read:
        yield None
        return
    def resolved_here() -> tuple[str, int]:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            found = resolve(loc, keep_manifest=True)
        for w in said:
            warnings.warn(w.message, w.category, stacklevel=5)
        return found

    rel, iteration = comm.first_answers(resolved_here)
    with loc.fetched(comm, rel, iteration, cache=cache, verify_first=verify_first) as files:
        yield files


def committed_copy(loc: Location, data: bool = True, in_place: bool = False) -> CommittedCopy:
    """For the one-process tools: the committed checkpoint ``loc`` designates (:func:`resolve`), as a local
    directory (on a store: fetched, every object verified as it arrives -- ``data=False``: the data objects only
    hashed as they stream; ``in_place``: read where they lie; see :meth:`Location.copy_committed`)."""
    return loc.copy_committed(*resolve(loc, keep_manifest=True), data=data, in_place=in_place)


def claim(loc: Location, name: str) -> None:
    """Mark ``name`` as a save in progress in this process: :func:`clean` leaves it alone (another checkpointer
    of this process may be saving into the same location; the run lock, shared by the process, allows that)."""
    with _IN_PROGRESS_GUARD:
        _IN_PROGRESS.setdefault(loc.text, set()).add(name)


def unclaim(loc: Location, name: str) -> None:
    """The save ``name`` is committed or abandoned (idempotent)."""
    with _IN_PROGRESS_GUARD:
        _IN_PROGRESS.get(loc.text, set()).discard(name)


def in_progress(loc: Location) -> set[str]:
    """The names :func:`claim` marked in ``loc`` and not yet released."""
    with _IN_PROGRESS_GUARD:
        return set(_IN_PROGRESS.get(loc.text, ()))


def clean(loc: Location, keep: str | None = None) -> tuple[list[str], list[str]]:
    """Finish or remove what interrupted saves left; returns ``(restored, removed)`` names.

    Steps:
        1. A complete stand-in for an ``iter_*`` that is no longer committed (a re-save stopped between
           uncommitting the old copy and committing the new one) is put back under that name.
        2. Every other staging or trash name, except ``keep`` and the saves in progress in this process
           (:func:`claim`), is deleted; on a location that writes fresh iterations in place, so is every
           ``iter_*`` without its manifest.
        3. Streamed writes that interrupted saves left unfinished, outside those names, are abandoned
           (:meth:`~peftckpt.checkpoint.location.base.Location.abort_unfinished`).

    Call it from the committing rank holding the run lock, before any rank writes.
    """
    names = loc.names()
    _one_name_each(loc, names)
    restored = [final for final, copies in sorted(_stand_ins(loc, names).items())  # 1.
                if not loc.holds_manifest(final) and loc.restore(copies[-1], final)]
    removed = []
    busy = in_progress(loc)
    for name in loc.names():  # 2.
        if name == keep or name in busy:
            continue
        if is_leftover_name(name) or (loc.WRITES_IN_PLACE and parse_iteration_dirname(name) is not None
                                      and not loc.holds_manifest(name)):
            loc.remove(name)
            removed.append(name)
    loc.abort_unfinished(busy | ({keep} if keep else set()))  # 3.
    loc.cleaned(bool(restored or removed))
    return restored, removed


# ------------------------------------------------------------------------------------------ commit
def commit(loc: Location, target: SaveTarget, manifest_bytes: bytes, *, update_tracker: bool = True,
           allow_tracker_rewind: bool = False, on_step: Callable[[str], None] | None = None) -> str:
    """Commit the fully written ``target`` (every rank finished, and on a store uploaded, its files) as
    ``iter_XXXXXXX``; returns that name.

    Steps:
        1. Before anything changes: a tracker that cannot be replaced must not be found only after an existing
           ``iter_*`` was replaced (a garbled one is simply overwritten).
        2. Publish: the manifest last, then the checkpoint under its name (:meth:`Location.publish`, whose
           docstring gives its crash argument).
        3. Move the tracker by the rule in the module docstring.
    """
    final = iteration_dirname(target.iteration)
    problem = loc.replace_problem(TRACKER_FILENAME) if update_tracker else None  # 1.
    if problem is not None:
        raise CheckpointFormatError(f"tracker {loc.describe(TRACKER_FILENAME)} {problem}, so it cannot be updated; "
                                    "remove it (nothing was committed)")
    current = _tracked_or_none(loc)
    loc.publish(target, manifest_bytes, on_step or (lambda _step: None))  # 2.
    if update_tracker and (current is None or target.iteration >= current or allow_tracker_rewind):  # 3.
        write_tracker(loc, target.iteration)
    return final


# --------------------------------------------------------------------------------------- retention
def apply_retention(loc: Location, keep_last_k: int, protect: Iterable[int] = ()) -> list[int]:
    """Delete committed checkpoints older than the newest ``keep_last_k``; return the deleted iterations.

    Never deleted: the newest committed checkpoint, the one the tracker names, the iterations in ``protect``
    (e.g. the checkpoint this run resumed from, or the one just committed), and staging/trash leftovers (those
    belong to :func:`clean`). Each deletion uncommits the checkpoint in one step first, so a crash mid-delete
    never leaves a half-deleted checkpoint that still looks committed.
    """
    if keep_last_k <= 0:
        raise ValueError(f"keep_last_k must be >= 1, got {keep_last_k}")
    committed = list_committed(loc)
    if not committed:
        return []
    tracked = _tracked_or_none(loc)
    keep = set(committed[-keep_last_k:]) | {committed[-1]} | set(protect) | ({tracked} - {None})
    deleted = []
    for iteration in committed:
        if iteration not in keep:
            loc.retire(iteration_dirname(iteration))
            deleted.append(iteration)
    return deleted
