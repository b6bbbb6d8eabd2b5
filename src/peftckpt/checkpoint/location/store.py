"""A save location on an object store: a prefix (``s3://bucket/run``), committed into by writing the manifest last.

What it relies on from the store: strong read-after-write consistency for PUT, GET, LIST and DELETE (S3 has it
since 2020; so do GCS and Azure Blob), and that a PUT of one object is atomic. No conditional writes (except for
the run's lease, :mod:`~.store_lease`), no rename.

Why a crash never loses the last good checkpoint here (the rules are :mod:`~.protocol`'s):

* A fresh iteration is uploaded under ``iter_N/`` itself, where no reader looks until its manifest is there; the
  manifest is written last, by one PUT, only after every rank's uploads were listed back with the sizes
  recorded: its appearance is the commit.
* A re-save of a committed iteration uploads the new copy, manifest included, under ``.staging.iter_N.<token>``
  first. Only then is the old copy uncommitted (its manifest deleted first) and the new objects copied into
  ``iter_N/`` server-side, manifest last. Until that copy is complete one complete copy with its manifest
  always exists: the old one, or the staged new one, which a resolve falls back to (with a warning) and the next
  save's clean finishes promoting.
* Retention deletes a checkpoint's manifest first, so a half-deleted checkpoint is never taken for a committed one.

The ranks stream their data files straight into their objects as they write them (multipart, a few parts in
flight, :mod:`~peftckpt.checkpoint.storage.object_writes`: no local copy, a bounded amount of memory); an object
appears only once complete, and a save killed mid-object leaves an unfinished upload no reader sees, which the next
run's first save aborts (:mod:`~.store_writes`). What a format does not stream (DCP's small ``.metadata``, the
legacy format's files) is written into a node-local *spool* (``<cache>/spool/<scheme>/<bucket>/<prefix>/``) and
uploaded from there. A load (:meth:`StorePrefix.fetched`) has one rank per host fetch the checkpoint's small files into
``<cache>/fetch/<token>/`` (deleted when the load ends), every object hashed as it arrives and checked against the
manifest and rank 0's listing; the data objects of a ``torch_dist`` checkpoint are read where they lie, by ranges
(:mod:`~.store_reads`), a legacy checkpoint's downloaded whole.
"""

from __future__ import annotations

import atexit
import contextlib
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from ..checks.load_checks import damaged
from ..errors import CheckpointError
from ..faults import fault_point
from ..storage.checkpoint_files import CheckpointFiles
from ..storage.checksums import StreamTo, is_data_file
from ..storage.formats import storage_format
from ..storage.manifest import MANIFEST_MAX_BYTES, Manifest
from ..storage.object_ranges import ObjectSource
from ..storage.object_store import ObjectStore, store_error
from . import protocol
from .base import CommittedCopy, Held, Location, SaveTarget
from .base_cache import CACHE_ENV, BaseCache, cache_root
from .dir_lock import acquire_save_lock
from .directory import Directory
from .names import MANIFEST_FILENAME, STAGING_PREFIX, iteration_dirname
from .store_fetch import fetch_files, listed_problems, read_listed, read_remote_manifest, renamed_error
from .store_foreign import cached_foreign
from .store_lease import acquire_remote_lock, check_lease
from .store_reads import StoreFiles, shared_pool
from .store_writes import abort_unfinished, object_streams

if TYPE_CHECKING:
    from ..collectives import Collectives

__all__ = ["CACHE_ENV", "cache_root", "StorePrefix", "renamed_error", "clean_uncommitted"]

class StorePrefix(Location):
    """A save location or a checkpoint on an object store. Every store failure is one
    :class:`~peftckpt.checkpoint.errors.CheckpointError` naming the URL (:func:`store_error`)."""

    STAND_IN_PREFIX: ClassVar[str] = STAGING_PREFIX
    STAND_IN_WORDS: ClassVar[str] = "new copy staged at"
    WRITES_IN_PLACE: ClassVar[bool] = True

    def __init__(self, store: ObjectStore | str):
        self.store = store if isinstance(store, ObjectStore) else ObjectStore(store)
        self.text = self.store.url
        self._kept: tuple[str, bytes] | None = None
        """The manifest :meth:`holds_manifest` read for the read that follows (its checkpoint, its bytes)."""

    @contextlib.contextmanager
    def _failing(self, rel: str, what: str) -> Iterator[None]:
        """Store failures (not absence, not a size refused) as one error naming the URL of ``rel``."""
        try:
            yield
        except (CheckpointError, FileNotFoundError, ValueError):
            raise
        except Exception as e:  # noqa: BLE001 - the store's failure, named once
            raise store_error(e, self.store.url_of(rel), what) from None

    def describe(self, rel: str = "") -> str:
        return self.store.url_of(rel)

    def ref(self, rel: str = "") -> str:
        return self.store.url_of(rel)

    @property
    def name(self) -> str:
        return self.store.name()

    @property
    def parent(self) -> str:
        return self.text.rsplit("/", 1)[0]

    def sub(self, rel: str) -> StorePrefix:
        return StorePrefix(self.store.url_of(rel))

    @property
    def spool(self) -> Path:
        """The node-local directory a save stages in (also where its node-local run lock lives)."""
        return cache_root() / "spool" / self.store.scheme / self.store.root

    # -------------------------------------------------------------------------------------- probes
    def check_readable(self) -> None:
        self.store.check_reachable()  # a missing bucket or credentials: said as such, not as "no checkpoint"

    def store_problem(self, flag: str) -> str | None:
        try:
            self.store.check_reachable()
        except CheckpointError as e:
            return f"{flag} {e}"
        return None

    # ---------------------------------------------------------------------------------- small files
    def read_small(self, rel: str, max_bytes: int) -> bytes:
        with self._failing(rel, "the object"):
            return self.store.read_bytes(rel, max_bytes)

    def is_file(self, rel: str) -> bool:
        with self._failing(rel, "the object"):
            return self.store.exists(rel)

    def byte_source(self, rel: str) -> ObjectSource:
        with self._failing(rel, "the object"):
            size = self.store.size(rel)
        return ObjectSource(self.store, rel, size, shared_pool())

    def write_atomic(self, rel: str, data: bytes) -> None:
        with self._failing(rel, "the object"):
            self.store.write_bytes(rel, data)

    def names(self) -> list[str]:
        with self._failing("", "the save location"):
            return self.store.children()

    def holds_manifest(self, rel: str = "", keep: bool = False) -> bool:
        where = f"{rel}/{MANIFEST_FILENAME}" if rel else MANIFEST_FILENAME
        with self._failing(where, "the manifest"):
            if not keep:
                return self.store.exists(where)
            try:
                self._kept = (rel, self.store.read_bytes(where, MANIFEST_MAX_BYTES))
            except FileNotFoundError:
                return False
            except ValueError:  # too large: there all the same (its read says why it is refused)
                pass
            return True

    def _kept_manifest(self, rel: str) -> bytes | None:
        """The manifest of ``rel`` that :meth:`holds_manifest` just read (once), if it did."""
        kept, self._kept = self._kept, None
        return kept[1] if kept is not None and kept[0] == rel else None

    def probe(self, name: str, max_bytes: int, keep: bool = False) -> tuple[bool, bytes | Exception | None]:
        read = shared_pool().submit(self._read_or_error, name, max_bytes)
        try:
            return self.holds_manifest(keep=keep), read.result()
        finally:
            read.cancel()

    def read_manifest(self, rel: str = "") -> Manifest:
        return read_remote_manifest(self.store, rel)[0]

    def size_problems(self, rel: str, manifest: Manifest) -> list[str]:
        with self._failing(rel, "the checkpoint"):
            problems = listed_problems(self.store, rel, manifest, self.store.list_files(rel))
        return [problems[n] for n in sorted(problems)]

    # ---------------------------------------------------------------------------------------- saves
    def lock(self) -> Held:
        return acquire_remote_lock(self.store, acquire_save_lock(self.spool))

    def check_held(self) -> None:
        with self._failing(".peftckpt.lock", "the run lock"):
            check_lease(self.store.url)

    def begin_save(self, iteration: int, token: str) -> SaveTarget:
        """Upload into ``iter_N`` itself when it is not committed, else into a staging prefix; stage locally in
        the spool (whose leftovers, from this host's interrupted saves, go first; a save in progress in this
        process, :func:`~.protocol.claim`, stays)."""
        final = iteration_dirname(iteration)
        name = f"{STAGING_PREFIX}{final}.{token}" if self.holds_manifest(final) else final
        busy = protocol.in_progress(self)  # another checkpointer of this process, saving here
        for leftover in self.spool.glob(f"{STAGING_PREFIX}*"):
            if leftover.name not in busy:
                shutil.rmtree(leftover, ignore_errors=True)
        local = self.spool / f"{STAGING_PREFIX}{final}.{token}"
        local.mkdir(parents=True, exist_ok=True)
        return SaveTarget(iteration, name, local)

    def stream_to(self, target: SaveTarget, rank: int) -> StreamTo:
        return object_streams(self.store, target, rank)

    def abort_unfinished(self, keep: set[str]) -> int:
        return abort_unfinished(self.store, keep)

    def upload(self, target: SaveTarget, files: list[Path], rank: int, keep: bool = False) -> None:
        """Upload this rank's ``files`` from the spool to ``target``, then delete them locally (unless ``keep``:
        rank 0's ``.metadata``, which its commit checks read). Failures name the object."""
        for n, path in enumerate(files):
            rel = f"{target.name}/{path.relative_to(target.local).as_posix()}"
            with self._failing(rel, "the upload"):
                self.store.upload(path, rel)
            if n == 0:
                fault_point("upload", rank, target.iteration)
        if keep:
            return
        for path in files:
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # the last rank of a node (other than rank 0's) leaves no empty directory
            target.local.rmdir()

    def stored_sizes(self, target: SaveTarget) -> dict[str, int]:
        with self._failing(target.name, "the uploaded checkpoint"):
            return self.store.list_files(target.name)

    def publish(self, target: SaveTarget, manifest_bytes: bytes, on_step: Callable[[str], None]) -> None:
        """Steps:
            1. Refuse if another run took the location's lease over since (nothing is committed).
            2. PUT the manifest into ``target``: for a fresh iteration this is the commit.
            3. For a re-save (``target`` is a staging prefix): promote it (:meth:`restore`).
            4. Empty this save's spool.
        """
        self.check_held()  # 1.
        final = iteration_dirname(target.iteration)
        self.write_atomic(f"{target.name}/{MANIFEST_FILENAME}", manifest_bytes)  # 2.
        on_step("manifest_written")
        if target.name != final:  # 3.
            self.restore(target.name, final)
        on_step("renamed")
        shutil.rmtree(target.local, ignore_errors=True)  # 4.

    def retire(self, name: str) -> None:
        with self._failing(name, "retention"):
            self.store.delete(f"{name}/{MANIFEST_FILENAME}")
            self.store.delete(name)

    def remove(self, name: str) -> None:
        with self._failing(name, "a leftover of an earlier save"):
            self.store.delete(name)

    def restore(self, stand_in: str, final: str) -> bool:
        """Replace ``final`` by the complete staged copy ``stand_in``: uncommit the old copy (manifest first),
        delete it, copy the staged objects in (manifest last), delete the staged copy."""
        with self._failing(final, "the re-save"):
            if self.store.exists(f"{final}/{MANIFEST_FILENAME}"):
                self.store.delete(f"{final}/{MANIFEST_FILENAME}")
            self.store.delete(final)
            for name in sorted(self.store.list_files(stand_in)):
                if name != MANIFEST_FILENAME:
                    self.store.copy(f"{stand_in}/{name}", f"{final}/{name}")
            self.store.copy(f"{stand_in}/{MANIFEST_FILENAME}", f"{final}/{MANIFEST_FILENAME}")
            self.store.delete(stand_in)
        return True

    def cleaned(self, changed: bool) -> None:
        pass  # every delete was one request, durable when it returned

    def new_output_problem(self, flag: str) -> str | None:
        self.check_readable()
        return f"{flag} {self.text} already holds objects" if self.names() else None

    def discard(self, existed: bool) -> None:
        self.remove("")

    # ---------------------------------------------------------------------------------------- loads
    fetched_to_read = True

    @contextlib.contextmanager
    def fetched(self, comm: Collectives, rel: str, iteration: int, cache: bool = False, verify_first: bool = False
                ) -> Iterator[CheckpointFiles]:
        """Steps (the checkpoint ``rel`` resolved by rank 0, see :func:`~.protocol.reading`):
            1. Rank 0 reads the manifest and lists the checkpoint's objects -- one LIST per load, whatever the world
               size -- checks the listing against the manifest and tells every rank.
            2. The lowest rank of each host fetches, hashing each object as it streams:
               * ``cache`` (a base): the whole checkpoint into the host's base cache, unless a run already left it
                 there (:mod:`~.base_cache`; a hit is read like a local checkpoint, verified as it is read);
               * a format read by ranges (``torch_dist``), unless ``verify_first``: only the small files (manifest,
                 ``.metadata``), into a fresh directory -- every rank then reads the data objects where they lie,
                 by ranged GETs of the bytes it needs, verified as they are read (:mod:`~.store_reads`);
               * else every recorded object, into a fresh directory.
               Any missing, resized, damaged or unlisted object fails the load on every rank, named by its URL.
            3. The caller loads; library errors naming the local directory name the URL instead (a damaged copy in
               the base cache is named as such, and deleted).
            4. Once every rank is done, a fresh directory is deleted.
        """
        url = self.store.url_of(rel)

        def listed_manifest() -> tuple[str, bytes, tuple[dict[str, int], dict[str, str]]]:
            _, data, listed = read_listed(self.store, rel, self._kept_manifest(rel))
            return secrets.token_hex(6), data, listed

        token, data, listed = comm.first_answers(listed_manifest)  # 1.
        manifest = Manifest.from_json(data, self.store.url_of(f"{rel}/{MANIFEST_FILENAME}"))  # type: ignore[arg-type]
        in_place = _reads_by_range(manifest) and not cache and not verify_first
        hosts = comm.gather(socket.gethostname())
        downloader = hosts.index(hosts[comm.rank])
        bases = BaseCache(cache_root() / "bases")
        local = bases.entry(bases.key(data)) if cache else cache_root() / "fetch" / token / iteration_dirname(iteration)
        problems: list[str] = []  # the downloaders report the listing's problems with their own (a cache hit: none)
        error = None
        hit = False
        with contextlib.ExitStack() as held:
            if comm.rank == downloader:  # 2.
                try:
                    if cache:
                        local, hit, problems = held.enter_context(bases.use(
                            bases.key(data), lambda into: self._fill(rel, manifest, data, listed, into)))
                    else:
                        problems = self._fill(rel, manifest, data, listed, local, only_small=in_place)
                except (CheckpointError, OSError) as e:
                    error = e
            comm.agree(error)
            bad = sorted({p for ps in comm.gather(problems) for p in ps})
            hit = comm.gather(hit)[downloader]
            copied = None if not cache else 0 if hit or comm.rank != downloader else \
                sum(int(rec["size"]) for rec in manifest.files.values())  # what a fill fetched, on the rank it ran
            files = StoreFiles(local, self.store, rel, listed[0]) if in_place else \
                CheckpointFiles(local, url, hashed=not hit, cached=local if cache else None, fetched=copied)
            try:
                raised = damaged(url, bad)  # type: ignore[arg-type]
                if raised is not None:
                    raised.every_rank = True
                    raise raised
                try:
                    yield files  # 3.
                except BaseException as e:
                    if hit:
                        raise bases.damaged_copy_error(e, local, comm.rank == downloader) from None
                    raise renamed_error(e, local, url) from None
            finally:
                files.close()
                comm.barrier()  # 4.
                if comm.rank == downloader and not cache:
                    shutil.rmtree(local.parent, ignore_errors=True)

    def _fill(self, rel: str, manifest: Manifest, data: bytes, listed: tuple[dict[str, int], dict[str, str]],
              into: Path, only_small: bool = False) -> list[str]:
        """Fetch the checkpoint ``rel`` into ``into``, every object hashed as it streams (``only_small``: not its
        data files), then write its manifest; the objects found bad."""
        problems = fetch_files(self.store, rel, manifest, into, listed,
                               only=(lambda name: not is_data_file(name)) if only_small else None)
        (into / MANIFEST_FILENAME).write_bytes(data)
        return problems

    @contextlib.contextmanager
    def foreign_files(self, comm: Collectives, wanted: Callable[[str], bool], cache: bool = True
                      ) -> Iterator[tuple[Location, bool | None]]:
        if not cache:
            yield self, None
            return
        with cached_foreign(self.store, comm, wanted, BaseCache(cache_root() / "bases")) as (local, hit):
            yield Directory(local), hit

    def copy_committed(self, rel: str, iteration: int, data: bool = True, in_place: bool = False) -> CommittedCopy:
        """Download the committed checkpoint ``rel`` into a fresh local copy, every object verified as it streams
        (``data=False``: the data objects hashed as they stream, not kept; ``in_place``: left where they lie, read
        by ranges, where the format allows); deleted by :meth:`CommittedCopy.release`, or when the process exits."""
        local = cache_root() / "fetch" / secrets.token_hex(6) / iteration_dirname(iteration)
        atexit.register(shutil.rmtree, local.parent, True)
        manifest, data_bytes, listed = read_listed(self.store, rel, self._kept_manifest(rel))
        in_place = in_place and _reads_by_range(manifest)
        copied = data and not in_place
        problems = fetch_files(self.store, rel, manifest, local, listed, only=None if copied else
                               (lambda name: not is_data_file(name)))
        if not data:  # (the listing's problems, said by both calls, once)
            problems = sorted({*problems, *fetch_files(self.store, rel, manifest, None, listed, only=is_data_file)})
        (local / MANIFEST_FILENAME).write_bytes(data_bytes)
        sizes = None if copied else {n: size for n, size in listed[0].items() if is_data_file(n)}
        return CommittedCopy(local, self.store.url_of(rel), iteration, manifest, problems, fetched_into=local.parent,
                             listed=sizes, files=StoreFiles(local, self.store, rel, sizes or {}) if in_place else None)


def _reads_by_range(manifest: Manifest) -> bool:
    """Whether the checkpoint's format reads its data files by ranges (else a load reads a local copy)."""
    try:
        return storage_format(manifest.format, "").reads_by_range
    except CheckpointError:  # unknown: the load says so, from the copy
        return False


def clean_uncommitted(store: ObjectStore | StorePrefix) -> list[str]:
    """Before a save: :func:`~.protocol.clean` of a store location; the names promoted, then those removed."""
    restored, removed = protocol.clean(store if isinstance(store, StorePrefix) else StorePrefix(store))
    return restored + removed


