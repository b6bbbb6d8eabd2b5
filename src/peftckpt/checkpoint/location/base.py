"""Where checkpoints live: a :class:`Location` -- a local directory, or a prefix on an object store.

A location offers the few primitives the commit protocol (:mod:`~peftckpt.checkpoint.location.protocol`, written
once against this class) needs -- small atomic writes, listing, "does this checkpoint hold its manifest" -- and the
steps where a directory and a store must differ: how a fully written save is published (fsync + rename, or PUT
the manifest last), how a checkpoint is retired, how a run locks the location, and how a committed checkpoint is
read (the directory itself, or a verified node-local copy).

Names passed to a location (``rel``) are ``/``-separated and relative to it; ``""`` is the location itself.
"""

from __future__ import annotations

import contextlib
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ..errors import CheckpointError

if TYPE_CHECKING:
    from ..collectives import Collectives
    from ..storage.byte_sources import ByteSource
    from ..storage.checkpoint_files import CheckpointFiles
    from ..storage.checksums import StreamTo
    from ..storage.manifest import Manifest

__all__ = ["Location", "SaveTarget", "Held", "CommittedCopy"]


@dataclass(frozen=True)
class SaveTarget:
    """One save in progress: what it is committed from, and where this host's ranks write its files."""

    iteration: int
    name: str
    """The name the save is published from, relative to the location: a staging name, or on a store the
    ``iter_*`` name itself when that iteration is not committed yet."""
    local: Path
    """The directory the ranks write their files into (on a store: in the node-local spool, then uploaded)."""


class Held(Protocol):
    """A run lock (or lease) held on a location; released once."""

    def release(self) -> None: ...


@dataclass
class CommittedCopy:
    """A committed checkpoint as the one-process tools read it: a local directory (the checkpoint itself, or a
    verified copy of one on a store, deleted at exit), what to call it in messages, and what a fetch found."""

    local: Path
    url: str
    """The checkpoint's path or URL, as messages name it."""
    iteration: int
    manifest: Manifest | None = None
    """Read while fetching (a copy); ``None`` for a directory (the tool reads it)."""
    problems: list[str] | None = None
    """Objects that were missing, resized, damaged or unlisted (named by URL); ``None``: nothing was verified
    while fetching (a directory: the tool verifies it)."""
    fetched_into: Path | None = None
    """The directory a fetched copy was made in, deleted by :meth:`release` (``None``: nothing to delete)."""
    listed: dict[str, int] | None = None
    """The sizes of the data files left where they lie (hashed as they streamed, not copied: ``data=False``; or
    read in place: :attr:`files`), by name; ``None``: every file is under :attr:`local`."""
    files: CheckpointFiles | None = None
    """Where the tool reads the data files it left where they lie (``in_place``): a store's objects, by ranges,
    verified by their block index as they are read."""

    def release(self) -> None:
        """Delete a fetched copy now (one verified checkpoint after another need not pile up until exit)."""
        if self.fetched_into is not None:
            shutil.rmtree(self.fetched_into, ignore_errors=True)

    @property
    def verified(self) -> bool:
        """Every file was hashed against the manifest while it was fetched."""
        return self.problems is not None

    def rename(self, text: str) -> str:
        """``text`` with the local copy's path replaced by the URL."""
        return text.replace(str(self.local), self.url)

    def with_local_problems(self, found: list[str]) -> list[str]:
        """The fetch's problems, then ``found`` on the local copy (renamed to URLs) except those about an object
        the fetch already reported: absent from the copy, its local "missing" adds nothing."""
        fetched = self.problems or []
        bad = {p.split(": ", 1)[0] for p in fetched}
        return fetched + [p for p in map(self.rename, found) if p.split(": ", 1)[0] not in bad]


class Location(ABC):
    """A save location or a checkpoint: a directory (:class:`~peftckpt.checkpoint.location.directory.Directory`)
    or a prefix on an object store (:class:`~peftckpt.checkpoint.location.store.StorePrefix`)."""

    text: str
    """The location as messages name it: a path, or a URL."""

    STAND_IN_PREFIX: ClassVar[str]
    """Prefix of the names under which an interrupted re-save leaves a complete copy of the iteration it
    replaces (``names.stand_in_target``): the old copy moved aside, or the new copy staged."""
    STAND_IN_WORDS: ClassVar[str]
    """How a warning names such a copy."""
    WRITES_IN_PLACE: ClassVar[bool]
    """A fresh iteration is written under its ``iter_*`` name (manifest last), so an ``iter_*`` without a
    manifest is a leftover of an interrupted save; else it is written aside and renamed."""

    # -------------------------------------------------------------------------------------- naming
    @abstractmethod
    def describe(self, rel: str = "") -> str:
        """``rel`` inside the location, as messages name it."""

    @abstractmethod
    def ref(self, rel: str = "") -> Path | str:
        """``rel`` as the library returns a checkpoint: a :class:`~pathlib.Path`, or a URL."""

    @property
    @abstractmethod
    def name(self) -> str:
        """The last component (``iter_0000004`` for ``.../run/iter_0000004``)."""

    @property
    @abstractmethod
    def parent(self) -> str:
        """The enclosing location, as messages name it."""

    def absolute(self) -> Location:
        """The same location, independent of the working directory (a relative path made absolute)."""
        return self

    @abstractmethod
    def sub(self, rel: str) -> Location:
        """The location ``rel`` inside this one."""

    # -------------------------------------------------------------------------------------- probes
    @abstractmethod
    def check_readable(self) -> None:
        """Raise one :class:`~peftckpt.checkpoint.errors.CheckpointError` unless the location can be listed
        (it exists and is a directory; or the bucket exists and the credentials work)."""

    def store_problem(self, flag: str) -> str | None:
        """Why the store behind the location cannot be reached, or ``None`` (always, for a directory)."""
        return None

    # ---------------------------------------------------------------------------------- small files
    @abstractmethod
    def read_small(self, rel: str, max_bytes: int) -> bytes:
        """The bytes of ``rel``. Raises ``FileNotFoundError`` when absent, ``ValueError``/``OSError`` when it is
        not a regular file of at most ``max_bytes`` (garbled), ``CheckpointError`` when the store fails."""

    @abstractmethod
    def is_file(self, rel: str) -> bool:
        """Whether ``rel`` is a file (an object) of the location."""

    @abstractmethod
    def byte_source(self, rel: str) -> ByteSource:
        """The file ``rel``, read by ranges (a missing one: ``FileNotFoundError``); close it when done."""

    @abstractmethod
    def write_atomic(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` by ``data`` durably; a reader sees the old bytes or the new ones, never a part."""

    def replace_problem(self, rel: str) -> str | None:
        """Why ``rel`` could not be replaced by :meth:`write_atomic` (a directory in its place), or ``None``."""
        return None

    @abstractmethod
    def names(self) -> list[str]:
        """The names directly inside the location, sorted (empty when it does not exist)."""

    @abstractmethod
    def holds_manifest(self, rel: str = "", keep: bool = False) -> bool:
        """Whether ``rel`` holds a manifest (for an ``iter_*`` name: whether that checkpoint is committed).
        ``keep``: the caller reads that manifest next (a load resolving its checkpoint); a store reads it now, one
        GET instead of a HEAD and then a GET, for the read that follows (:meth:`fetched`, :meth:`copy_committed`)."""

    def probe(self, name: str, max_bytes: int, keep: bool = False) -> tuple[bool, bytes | Exception | None]:
        """What resolving a location asks first: whether it holds a manifest itself (:meth:`holds_manifest`), and the
        small file ``name`` (:meth:`read_small`: its bytes, ``None`` when absent, or the error reading it raised).
        On a store both requests are in flight at once (the time of one round trip)."""
        return self.holds_manifest(keep=keep), self._read_or_error(name, max_bytes)

    def _read_or_error(self, name: str, max_bytes: int) -> bytes | Exception | None:
        try:
            return self.read_small(name, max_bytes)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - handed to the caller, which raises it where it matters
            return e

    @abstractmethod
    def read_manifest(self, rel: str = "") -> Manifest:
        """The validated manifest of the checkpoint ``rel``."""

    def local_dir(self, rel: str = "") -> Path | None:
        """``rel`` as a local directory where the location is on a file system (``None`` on a store)."""
        return None

    @abstractmethod
    def size_problems(self, rel: str, manifest: Manifest) -> list[str]:
        """The cheap check of the checkpoint ``rel`` (no hashing): each recorded file present with its recorded
        size, and nothing unlisted; one message per bad file, naming it."""

    # ---------------------------------------------------------------------------------------- saves
    @abstractmethod
    def lock(self) -> Held:
        """Take this run's lock on the location (raises ``SaveDirInUseError`` naming the holder)."""

    @abstractmethod
    def check_held(self) -> None:
        """Raise ``SaveDirInUseError`` if this process's lock on the location was taken over (a store's lease,
        checked against the store); a directory's ``flock`` cannot be lost while the process lives."""

    @abstractmethod
    def begin_save(self, iteration: int, token: str) -> SaveTarget:
        """Create the place a save of ``iteration`` writes into (``token``: unique per save, no ``.`` or ``/``)."""

    def stream_to(self, target: SaveTarget, rank: int) -> StreamTo | None:
        """Where ``rank``'s data files for ``target`` go as they are written, instead of into ``target.local``
        (a store: each straight into its object, see :mod:`~peftckpt.checkpoint.storage.object_writes`); ``None``:
        they are written in place."""
        return None

    def abort_unfinished(self, keep: set[str]) -> int:
        """Abandon what streamed writes of interrupted saves left unfinished outside ``keep`` (on a store,
        multipart uploads nobody will complete); how many. A directory has none: its files are the writes."""
        return 0

    @abstractmethod
    def upload(self, target: SaveTarget, files: list[Path], rank: int, keep: bool = False) -> None:
        """Make this rank's written ``files`` part of ``target`` (a store uploads them; ``keep``: leave the local
        copies). A directory has them in place already (ranks other than 0 make them durable)."""

    def stored_sizes(self, target: SaveTarget) -> dict[str, int] | None:
        """The sizes of ``target``'s files as the location holds them, where that differs from the local files
        the ranks wrote (a store); ``None`` for a directory."""
        return None

    @abstractmethod
    def publish(self, target: SaveTarget, manifest_bytes: bytes, on_step: Callable[[str], None]) -> None:
        """Commit the fully written ``target`` as ``iter_*``: the manifest last, then the checkpoint under its
        name. Calls ``on_step("manifest_written")`` and then ``on_step("renamed")``."""

    @abstractmethod
    def retire(self, name: str) -> None:
        """Delete the committed checkpoint ``name``, uncommitting it first in one step."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete the leftover ``name`` (an uncommitted save, a half-deleted copy)."""

    @abstractmethod
    def restore(self, stand_in: str, final: str) -> bool:
        """Put the complete copy ``stand_in`` back as ``final`` (finishing an interrupted re-save); False when
        ``final`` is in the way."""

    @abstractmethod
    def cleaned(self, changed: bool) -> None:
        """After a cleanup (``changed``: something was removed or restored); a directory fsyncs itself."""

    def known_missing(self) -> bool:
        """Whether the location is known not to exist (a directory that is not there; a store cannot tell
        without a request, so never)."""
        return False

    # ------------------------------------------------------------------------------- new outputs
    @abstractmethod
    def new_output_problem(self, flag: str) -> str | None:
        """Why the location, named by ``flag``, cannot receive a new output (it holds something), or ``None``."""

    @abstractmethod
    def discard(self, existed: bool) -> None:
        """Delete what a failed command wrote into the location (``existed``: it existed, empty, before)."""

    @contextlib.contextmanager
    def as_new_output(self, flag: str) -> Iterator[Path | str]:
        """The location as a new, empty output (refused, naming ``flag``, if it holds anything); whatever was
        written is deleted again if the body fails, so nothing half-written is left behind."""
        problem = self.new_output_problem(flag)
        if problem is not None:
            raise CheckpointError(f"{problem}; nothing was written")
        existed = not self.known_missing()
        try:
            yield self.ref()
        except BaseException:
            self.discard(existed)
            raise

    # ---------------------------------------------------------------------------------------- loads
    fetched_to_read: ClassVar[bool] = False
    """Whether a load reads the checkpoint through files the location gives it (:meth:`fetched`) rather than the
    location itself."""

    @contextlib.contextmanager
    def fetched(self, comm: Collectives, rel: str, iteration: int, cache: bool = False, verify_first: bool = False
                ) -> Iterator[CheckpointFiles]:
        """Collective (where :attr:`fetched_to_read`): the files of the committed checkpoint ``rel`` (resolved by
        :func:`~.protocol.reading`) as a load reads them, its small files verified in a local directory
        (``cache``: a base, kept whole in the host's base cache for the next run; ``verify_first``: every file
        verified before the load reads any)."""
        raise NotImplementedError(f"{type(self).__name__} is read in place")
        yield  # pragma: no cover - a generator, for the context manager

    @contextlib.contextmanager
    def foreign_files(self, comm: Collectives, wanted: Callable[[str], bool], cache: bool = True
                      ) -> Iterator[tuple[Location, bool | None]]:
        """Collective: where to read a directory of files peftckpt did not write (an HF model directory, read by
        ranges) from, and whether it was in the host's base cache (``None``: not cached). A directory is read where
        it is; a store, with ``cache``, from the host's cached copy of its top-level files that ``wanted``
        accepts."""
        yield self, None

    @abstractmethod
    def copy_committed(self, rel: str, iteration: int, data: bool = True, in_place: bool = False) -> CommittedCopy:
        """For the one-process tools: the committed checkpoint ``rel`` (resolved by
        :func:`~.protocol.committed_copy`) as a local directory (``data=False``: a tool that only verifies -- a
        store's data objects are hashed as they stream, not copied; ``in_place``: a tool that reads tensors -- a
        store's data objects are read where they lie, :attr:`CommittedCopy.files`)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.text!r})"

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.text == self.text

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.text))
