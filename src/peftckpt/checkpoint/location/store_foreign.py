"""A directory of files peftckpt did not write (an HF model directory) on a store, read from the host's base cache.

An HF safetensors directory has no manifest, so its cache entry is keyed by what the store says of its files: the
names, sizes and ETags of the top-level objects a reader wants (an object rewritten under the same name gets a new
ETag, so a re-uploaded base is a new entry, never a stale copy). Steps (collective):

1. Rank 0 lists the directory once -- one LIST per load, whatever the world size -- and tells every rank.
2. The lowest rank of each host takes the entry (:class:`~.base_cache.BaseCache`: held with a shared lock,
   filled into a fresh directory and renamed into place whole, least recently used entries evicted beyond the
   cap). On a miss it fetches each wanted object, checking its size against the listing and, where the ETag is a
   plain MD5 (a single-part upload), its MD5; an object found wrong fails the load on every rank, named by URL.
3. Every rank reads the entry while its host's downloader holds it.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, CheckpointIntegrityError
from ..storage.object_store import ObjectStore, store_error
from .base_cache import BaseCache
from .store_fetch import fetch_one

if TYPE_CHECKING:
    from ..collectives import Collectives

__all__ = ["cached_foreign"]

_PLAIN_MD5 = re.compile(r'^"?([0-9a-f]{32})"?$')
"""An S3 ETag that is the object's MD5 (single-part uploads; a multipart upload's ends in ``-<parts>``)."""
_FETCH_THREADS = 4
"""Objects fetched at once on a miss."""


@contextlib.contextmanager
def cached_foreign(store: ObjectStore, comm: Collectives, wanted: Callable[[str], bool], bases: BaseCache
                   ) -> Iterator[tuple[Path, bool]]:
    """The host's cached copy of the top-level objects of ``store`` that ``wanted`` accepts, and whether it was
    there already (module docstring)."""
    def listed() -> dict[str, tuple[int, str]]:
        try:
            return {name: tag for name, tag in store.list_tagged().items() if wanted(name)}
        except Exception as e:  # noqa: BLE001 - the store's failure, named once
            raise store_error(e, store.url, "the directory") from None

    objects = comm.first_answers(listed)  # 1.
    key = BaseCache.key(json.dumps([store.url, sorted(objects.items())]).encode())
    hosts = comm.gather(socket.gethostname())
    downloader = hosts.index(hosts[comm.rank])
    error: BaseException | None = None
    hit = False
    with contextlib.ExitStack() as held:
        if comm.rank == downloader:  # 2.
            try:
                _, hit, problems = held.enter_context(bases.use(key, lambda into: _fetch(store, objects, into)))
                if problems:
                    error = CheckpointIntegrityError(f"{store.url}: the base cannot be copied to the host's base "
                                                     "cache:\n  " + "\n  ".join(problems))
            except (CheckpointError, OSError) as e:
                error = e
        comm.agree(error)
        hit = comm.gather(hit)[downloader]
        try:
            yield bases.entry(key), hit  # 3.
        finally:
            comm.barrier()  # (the downloader's hold ends once every rank of its host has read the entry)


def _fetch(store: ObjectStore, objects: dict[str, tuple[int, str]], into: Path) -> list[str]:
    """Fetch ``objects`` into ``into``, each checked against its listed size and plain-MD5 ETag; the problems."""
    into.mkdir(parents=True)

    def fetch(name: str) -> str | None:
        size, etag = objects[name]
        plain = _PLAIN_MD5.match(etag)
        return fetch_one(store, "", name, {"size": size, "checksum": plain and plain.group(1)}, "md5", into)

    with ThreadPoolExecutor(max_workers=max(1, min(_FETCH_THREADS, len(objects)))) as pool:
        return [p for p in pool.map(fetch, sorted(objects)) if p is not None]
