"""Checkpoints on an object store, for the checkpointer and the tools (collective where it says so).

A save to ``s3://...`` runs the usual save into a node-local *spool* directory (staging, DCP write, checksums
taken while writing), then every rank uploads its own files to the store and the commit follows the store's
protocol (:mod:`~peftckpt.checkpoint.storage.remote_layout`): the manifest object is written last, the tracker
after it. A load from ``s3://...`` resolves the checkpoint on the store, has one rank per host download it into
a node-local directory -- every object hashed as it arrives and checked against the manifest, so a damaged
object is named by its URL -- and then loads that copy like any local checkpoint; the copy is deleted when the
load ends.

Local directories (both under :func:`cache_root`): ``spool/<scheme>/<bucket>/<prefix>/`` (a save's staging,
emptied by each commit) and ``fetch/<token>/`` (one load's copy).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import socket
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checks.load_checks import damaged
from .collectives import Collectives
from .errors import CheckpointError
from .faults import fault_point
from .storage import remote_layout
from .storage.manifest import Manifest, read_manifest
from .storage.object_store import ObjectStore, is_url, parse_location, store_error
from .storage.remote_files import fetch_files, read_remote_manifest
from .storage.remote_layout import resolve
from .storage.storage_layout import MANIFEST_FILENAME, iteration_dirname, read_tracker, resolve_checkpoint_dir

if TYPE_CHECKING:
    from .commit import PendingCommit

__all__ = ["CACHE_ENV", "cache_root", "spool_dir", "fetched", "upload_own_files", "renamed_error", "manifest_at",
           "tracker_at", "join", "FetchedCopy", "fetch_copy"]

CACHE_ENV = "PEFTCKPT_CACHE_DIR"
"""Node-local directory for the spool of saves to, and the copies of loads from, an object store."""


def cache_root() -> Path:
    """``$PEFTCKPT_CACHE_DIR``, else ``$XDG_CACHE_HOME/peftckpt``, else ``~/.cache/peftckpt``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "peftckpt"


def spool_dir(store: ObjectStore) -> Path:
    """The node-local directory a save to ``store`` stages in (also where its run lock lives)."""
    return cache_root() / "spool" / store.scheme / store.root


def renamed_error(e: BaseException, local: Path, url: str) -> BaseException:
    """``e`` with the local copy's path in its message replaced by the URL it came from."""
    if isinstance(e, CheckpointError) and e.args and isinstance(e.args[0], str) and str(local) in e.args[0]:
        e.args = (e.args[0].replace(str(local), url), *e.args[1:])
    return e


@contextlib.contextmanager
def fetched(comm: Collectives, store: ObjectStore) -> Iterator[tuple[Path, str, int]]:
    """Collective: the committed checkpoint ``store`` designates, downloaded and verified on every host; yields
    ``(local directory, its URL, iteration)`` and deletes the copy afterwards.

    Steps:
        1. Rank 0 resolves the checkpoint on the store (tracker, fallbacks) and reads its manifest; all ranks
           get the name and a fresh token.
        2. The lowest rank of each host downloads every recorded object, hashing it as it streams; any damaged,
           missing or unlisted object fails the load on every rank, named by its URL.
        3. The caller loads the local copy; library errors naming the copy name the URL instead.
        4. Once every rank is done, the downloading ranks delete their copies.
    """
    resolved: tuple[str, int, str] | CheckpointError | None = None
    if comm.rank == 0:  # 1.
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                rel, iteration = resolve(store)
            for w in said:
                warnings.warn(w.message, w.category, stacklevel=3)
            resolved = (rel, iteration, secrets.token_hex(6))
        except CheckpointError as e:
            resolved = e
    # Rank 0's own error on every rank, of its type: a caller tells "no checkpoint yet" (CheckpointNotFoundError,
    # e.g. a first --load that starts from scratch) from a real failure the same way on every rank.
    resolved = comm.broadcast_from_first(resolved)
    if isinstance(resolved, CheckpointError):
        resolved.every_rank = True
        raise resolved
    assert resolved is not None
    rel, iteration, token = resolved
    url = store.url_of(rel)
    hosts = comm.gather(socket.gethostname())
    downloads = hosts.index(hosts[comm.rank]) == comm.rank
    local = cache_root() / "fetch" / token / iteration_dirname(iteration)
    problems: list[str] = []
    error = None
    if downloads:  # 2.
        try:
            problems = _download(store, rel, local)[1]
        except (CheckpointError, OSError) as e:
            error = e
    comm.agree(error)
    bad = sorted({p for ps in comm.gather(problems) for p in ps})
    try:
        raised = damaged(url, bad)  # type: ignore[arg-type]
        if raised is not None:
            raised.every_rank = True
            raise raised
        try:
            yield local, url, iteration  # 3.
        except BaseException as e:
            raise renamed_error(e, local, url) from None
    finally:
        comm.barrier()  # 4.
        if downloads:
            shutil.rmtree(local.parent, ignore_errors=True)


def upload_own_files(c: PendingCommit, rank: int, files: list[Path], records: dict[str, Any], keep: bool = False
                     ) -> None:
    """Upload this rank's written ``files`` (recorded as ``records``) from the spool to ``c.target`` on the
    store, then delete them locally (unless ``keep``: rank 0's ``.metadata``, which its commit checks read);
    ``c.uploaded`` holds the records afterwards. Failures name the object."""
    assert c.remote is not None
    for n, path in enumerate(files):
        rel = path.relative_to(c.staging).as_posix()
        url = c.remote.url_of(f"{c.target}/{rel}")
        try:
            c.remote.upload(path, f"{c.target}/{rel}")
        except Exception as e:  # noqa: BLE001 - one message naming the object
            raise store_error(e, url, "the upload") from None
        if n == 0:
            fault_point("upload", rank, c.iteration)
    if keep:
        return
    for path in files:
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # the last rank of a node (other than rank 0's) leaves no empty directory
        c.staging.rmdir()
    c.uploaded = records


# ------------------------------------------------------------------------------ either kind of location
def manifest_at(value: str | os.PathLike[str]) -> Manifest:
    """The manifest of the committed checkpoint a local path or a URL designates (as a load would resolve it)."""
    location = parse_location(value, "checkpoint")
    if isinstance(location, Path):
        return read_manifest(resolve_checkpoint_dir(location)[0])
    return read_remote_manifest(location, resolve(location)[0])[0]


def tracker_at(value: str | os.PathLike[str]) -> int | None:
    """The iteration the tracker of a save location (local or a URL) names, ``None`` without one."""
    location = parse_location(value, "save directory")
    if isinstance(location, Path):
        return read_tracker(location)
    try:
        return remote_layout.read_tracker(location)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise store_error(e, location.url, "the tracker") from None


def join(value: str | os.PathLike[str], name: str) -> str:
    """``name`` inside the location ``value`` (a path or a URL), as text for messages."""
    text = os.fspath(value)
    return f"{text.rstrip('/')}/{name}" if is_url(text) else str(Path(text) / name)


# ------------------------------------------------------------------------------------ one-process tools
@dataclass
class FetchedCopy:
    """A committed checkpoint of a store, downloaded for a one-process tool (deleted at exit)."""

    local: Path
    url: str
    iteration: int
    manifest: Manifest
    problems: list[str]
    """Objects that were missing, resized, damaged or unlisted (named by URL); the copy lacks them."""

    def rename(self, text: str) -> str:
        """``text`` with the local copy's path replaced by the URL."""
        return text.replace(str(self.local), self.url)

    def with_local_problems(self, found: list[str]) -> list[str]:
        """The download's problems, then ``found`` on the local copy (renamed to URLs) except those about an
        object the download already reported: absent from the copy, its local "missing" adds nothing."""
        bad = {p.split(": ", 1)[0] for p in self.problems}
        return self.problems + [p for p in map(self.rename, found) if p.split(": ", 1)[0] not in bad]


def fetch_copy(store: ObjectStore) -> FetchedCopy:
    """Resolve ``store`` (a checkpoint or a save location) and download its committed checkpoint into a fresh
    local copy, every object verified as it streams; the copy is deleted when the process exits."""
    rel, iteration = resolve(store)
    local = cache_root() / "fetch" / secrets.token_hex(6) / iteration_dirname(iteration)
    atexit.register(shutil.rmtree, local.parent, True)
    manifest, problems = _download(store, rel, local)
    return FetchedCopy(local, store.url_of(rel), iteration, manifest, problems)


def _download(store: ObjectStore, rel: str, local: Path) -> tuple[Manifest, list[str]]:
    """The checkpoint ``rel`` of ``store`` into ``local``: its recorded objects, verified as they stream, then its
    manifest; returns the manifest and the bad objects (named by URL)."""
    manifest, data = read_remote_manifest(store, rel)
    problems = fetch_files(store, rel, manifest, local)
    (local / MANIFEST_FILENAME).write_bytes(data)
    return manifest, problems
