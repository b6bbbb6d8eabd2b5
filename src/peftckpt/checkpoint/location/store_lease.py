"""One run at a time per save location on an object store: a lease object taken with a conditional write.

The local run lock (:mod:`~peftckpt.checkpoint.location.dir_lock`) is a ``flock``, which a store has no equivalent
of, and which only ever covered one machine. Here the lock is the object ``<url>/.peftckpt.lock``:

* It is created with ``If-None-Match: *`` (S3 conditional writes): of two runs, exactly one creates it. It holds
  the holder's host, pid and start time, so the other is told who holds the location.
* Its holder renews it every ``lease/4`` seconds in a background thread, each time rewriting it with
  ``If-Match: <its last ETag>`` (and a new sequence number, so the ETag changes). A failed renewal means another
  run took the lease: this run's next commit is refused (:meth:`RemoteLock.check`), nothing is committed.
* A crashed holder stops renewing. A new run that finds the object watches it for ``lease/2`` seconds: if its
  ETag does not change, the holder is gone and the newcomer takes it over with ``If-Match`` on the ETag it saw
  (of two newcomers, one wins); if it changes, the location is in use and the newcomer is refused. So a
  restarted job waits at most half a lease (``PEFTCKPT_STORE_LEASE_S``, default 60 s) after its predecessor died.
* Releasing deletes the object (when it still holds this run's ETag).

Locks are shared, reference counted, within a process (the trainer's start-up check and its checkpointer), as
for the local lock. A store that refuses conditional writes gets a warning and no lock.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import threading
import time
import warnings
from dataclasses import dataclass, field

from peftckpt.checkpoint.location.dir_lock import SaveDirInUseError, SaveDirLock
from peftckpt.checkpoint.location.names import LOCK_FILENAME
from peftckpt.checkpoint.storage.object_store import ObjectStore, store_error

from ...json_text import parse_json

__all__ = ["LEASE_ENV", "RemoteLock", "acquire_remote_lock", "check_lease"]

LEASE_ENV = "PEFTCKPT_STORE_LEASE_S"
_POLL_S = 0.5


def lease_seconds() -> float:
    """The lease of a store lock: ``$PEFTCKPT_STORE_LEASE_S`` seconds, default 60."""
    return max(1.0, float(os.environ.get(LEASE_ENV) or 60))


@dataclass
class _Lease:
    store: ObjectStore
    etag: str
    holder: str
    count: int = 1
    sequence: int = 0
    lost: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    guard: threading.Lock = field(default_factory=threading.Lock)
    """Held while the lease object is rewritten or checked, so a check never sees a renewal half done."""


_HELD: dict[str, _Lease] = {}
_HELD_GUARD = threading.Lock()


def _precondition_failed(e: BaseException) -> bool:
    return isinstance(e, FileExistsError) or "pre-condition" in str(e).lower() or "precondition" in str(e).lower()


def _body(holder: str, sequence: int) -> bytes:
    renewed = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return (json.dumps({"holder": holder, "sequence": sequence, "renewed": renewed,
                        "lease_s": lease_seconds()}) + "\n").encode()


def _put(store: ObjectStore, data: bytes, **condition: str) -> str:
    """Write the lock object under ``condition`` (``mode="create"`` or ``IfMatch=etag``); its new ETag."""
    response = store.fs.pipe_file(store.key(LOCK_FILENAME), data, **condition)
    etag = response.get("ETag") if isinstance(response, dict) else None
    return str(etag or store.fs.info(store.key(LOCK_FILENAME), refresh=True)["ETag"])


def _seen(store: ObjectStore) -> tuple[str, str] | None:
    """The lock object's ETag and holder text, or ``None`` when there is none."""
    key = store.key(LOCK_FILENAME)
    try:
        store.fs.invalidate_cache(key)
        etag = str(store.fs.info(key, refresh=True)["ETag"])
        holder = parse_json(store.fs.cat_file(key)).get("holder", "?")
    except FileNotFoundError:
        return None
    except ValueError:
        holder = "a holder that did not record itself"
    return etag, str(holder)


def check_lease(url: str) -> None:
    """Raise :class:`SaveDirInUseError` if this process held the lease of ``url`` and no longer does: checked
    against the store itself (the lock object still carries this run's last ETag), not only against what the
    renewal thread saw -- a run stopped for longer than its lease (SIGSTOP, a suspended VM) learns it at once,
    before it writes a manifest or cleans anything. Nothing when no lease is held here."""
    lease = _HELD.get(url)
    if lease is None:
        return
    with lease.guard:
        if lease.lost is None:
            seen = _seen(lease.store)
            if seen is None or seen[0] != lease.etag:
                lease.lost = (f"save location {lease.store.url} was taken over by another run "
                              f"({seen[1] if seen else 'its lock object is gone'}) while this one held it; nothing "
                              "more is committed by this run")
    if lease.lost is not None:
        raise SaveDirInUseError(lease.lost)


class RemoteLock:
    """A reference to this process's lease on one store location; :meth:`release` (or ``with``) drops it."""

    def __init__(self, url: str | None, local: SaveDirLock | None = None):
        self._url = url
        self._local = local
        """The lock of the node-local spool, released with this one."""

    def check(self) -> None:
        """Raise :class:`SaveDirInUseError` if another run took the lease since (before a commit)."""
        check_lease(self._url or "")

    def release(self) -> None:
        """Drop this reference; the last one stops the renewals and deletes the lock object (idempotent)."""
        url, self._url = self._url, None
        local, self._local = self._local, None
        if local is not None:
            local.release()
        if url is None:
            return
        with _HELD_GUARD:
            lease = _HELD.get(url)
            if lease is None:
                return
            lease.count -= 1
            if lease.count:
                return
            del _HELD[url]
        lease.stop.set()
        if lease.thread is not None:
            lease.thread.join()
        if lease.lost is None:
            try:
                seen = _seen(lease.store)
                if seen is not None and seen[0] == lease.etag:
                    lease.store.fs.rm_file(lease.store.key(LOCK_FILENAME))
            except Exception:  # noqa: BLE001 - the lease then simply expires
                pass

    def __enter__(self) -> RemoteLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _renew(lease: _Lease) -> None:
    period = lease_seconds() / 4
    while not lease.stop.wait(period):
        lease.sequence += 1
        with lease.guard:
            if lease.lost is not None:
                return
            try:
                lease.etag = _put(lease.store, _body(lease.holder, lease.sequence), IfMatch=lease.etag)
            except Exception as e:  # noqa: BLE001
                if _precondition_failed(e):
                    seen = _seen(lease.store)
                    lease.lost = (f"save location {lease.store.url} was taken over by another run "
                                  f"({seen[1] if seen else 'gone'}) while this one held it; nothing more is "
                                  "committed by this run")
                    return
                # A transient store error: retried at the next period (the lease is long enough for a few).


def acquire_remote_lock(store: ObjectStore, local: SaveDirLock | None = None) -> RemoteLock:
    """Take the lease of ``store`` for this process, or raise naming the holder (see the module docstring).
    ``local``, the spool's lock, is released with it (and at once if the lease cannot be taken).

    Raises:
        SaveDirInUseError: another live run holds it.
        CheckpointError: the store cannot be written (named by :func:`store_error`).
    """
    try:
        return _acquire(store, local)
    except BaseException:
        if local is not None:
            local.release()
        raise


def _acquire(store: ObjectStore, local: SaveDirLock | None) -> RemoteLock:
    with _HELD_GUARD:
        if store.url in _HELD:
            _HELD[store.url].count += 1
            return RemoteLock(store.url, local)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    holder = f"host {socket.gethostname()}, pid {os.getpid()}, since {started}"
    try:
        etag = _take(store, holder)
    except SaveDirInUseError:
        raise
    except (NotImplementedError, TypeError) as e:
        warnings.warn(f"{store.url}: the store does not support conditional writes ({e}); concurrent runs on this "
                      "location cannot be detected", stacklevel=3)
        return RemoteLock(None, local)
    except Exception as e:  # noqa: BLE001
        raise store_error(e, store.url_of(LOCK_FILENAME), "the run lock") from None
    lease = _Lease(store, etag, holder)
    lease.thread = threading.Thread(target=_renew, args=(lease,), name="peftckpt-lease", daemon=True)
    lease.thread.start()
    with _HELD_GUARD:
        _HELD[store.url] = lease
    return RemoteLock(store.url, local)


def _take(store: ObjectStore, holder: str) -> str:
    """Create the lock object, or take over one whose holder stopped renewing; its ETag."""
    try:
        return _put(store, _body(holder, 0), mode="create")
    except Exception as e:
        if not _precondition_failed(e):
            raise
    first = _seen(store)
    deadline = time.monotonic() + lease_seconds() / 2
    while first is not None and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        now = _seen(store)
        if now is None or now[0] != first[0]:  # released, or renewed: try once more from the start
            if now is not None:
                raise SaveDirInUseError(
                    f"save location {store.url} is in use by another run ({now[1]}); two runs saving into one "
                    "location would delete each other's saves in progress. Wait for it to end, or save to another "
                    "location")
            first = None
    try:
        if first is None:
            return _put(store, _body(holder, 0), mode="create")
        return _put(store, _body(holder, 0), IfMatch=first[0])  # its holder stopped renewing: take it over
    except Exception as e:
        if _precondition_failed(e):
            seen = _seen(store)
            raise SaveDirInUseError(f"save location {store.url} is in use by another run "
                                    f"({seen[1] if seen else 'just taken'})") from None
        raise
