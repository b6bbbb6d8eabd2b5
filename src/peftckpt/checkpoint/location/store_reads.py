"""A committed checkpoint on a store, read where it lies: no copy of its data on any host.

:class:`StoreFiles` is what :meth:`~peftckpt.checkpoint.location.store.StorePrefix.fetched` hands a load of a
format that reads by ranges (``torch_dist``). Its small files (manifest, ``.metadata``) are in a local directory,
fetched and hashed by one rank per host; its data files stay objects, which every rank reads by ranged GETs of
exactly the items it needs (:class:`~peftckpt.checkpoint.storage.object_ranges.ObjectSource`):

* presence and size of every object come from the one listing rank 0 made for the whole load;
* a data file with a block index is verified by the reads themselves, block by block (its index first, by its
  own digest); one without (written by stock DCP or an earlier peftckpt: the read finds out, with no request of
  its own) is hashed whole after the read, streamed through the checksum by each rank that read it -- the only
  case where an object is read beyond what a rank needs;
* damage is named by the object's URL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peftckpt.checkpoint.storage.byte_sources import ByteSource
from peftckpt.checkpoint.storage.checkpoint_files import CheckpointFiles
from peftckpt.checkpoint.storage.manifest import Manifest
from peftckpt.checkpoint.storage.object_ranges import ObjectSource
from peftckpt.checkpoint.storage.object_store import ObjectStore

from .store_fetch import fetch_one

__all__ = ["StoreFiles", "GET_THREADS", "shared_pool"]

GET_THREADS = 8
"""Ranged GETs in flight per rank."""


_SHARED: ThreadPoolExecutor | None = None
_SHARED_GUARD = threading.Lock()


def shared_pool() -> ThreadPoolExecutor:
    """The pool of every ranged GET of this process (checkpoint loads, an HF base's safetensors files),
    :data:`GET_THREADS` in flight, made once."""
    global _SHARED
    with _SHARED_GUARD:
        if _SHARED is None:
            _SHARED = ThreadPoolExecutor(max_workers=GET_THREADS, thread_name_prefix="peftckpt-get")
        return _SHARED


class StoreFiles(CheckpointFiles):
    """The checkpoint ``rel`` of ``store``: small files under ``root``, data files read as objects of the listed
    ``sizes`` (module docstring)."""

    verified_while_read = True

    def __init__(self, root: Path, store: ObjectStore, rel: str, sizes: Mapping[str, int]) -> None:
        super().__init__(root)
        self.url = store.url_of(rel)
        self._store = store
        self._rel = rel
        self._sizes = dict(sizes)
        self._opened: dict[str, ObjectSource] = {}
        self._lock = threading.Lock()

    @property
    def listed(self) -> Mapping[str, int]:
        return self._sizes

    @property
    def sources(self) -> Callable[[str], ByteSource]:
        return self.source

    def source(self, name: str) -> ObjectSource:
        """The data file ``name`` as an object read by ranges (one per name: its tail, once read, is kept)."""
        with self._lock:
            if name not in self._opened:
                if name not in self._sizes:
                    raise FileNotFoundError(2, "not listed in the checkpoint", self._store.url_of(self._key(name)))
                self._opened[name] = ObjectSource(self._store, self._key(name), self._sizes[name], shared_pool())
            return self._opened[name]

    def _key(self, name: str) -> str:
        return f"{self._rel}/{name}" if self._rel else name

    def file_problems(self, manifest: Manifest, shard: tuple[int, int], hash_if: Callable[[str], bool] | None
                      ) -> list[str]:
        return []  # checked from the listing, small files hashed as they were fetched (StorePrefix.fetched)

    def checksum_problems(self, manifest: Manifest, rels: list[str]) -> list[str]:
        found = [fetch_one(self._store, self._rel, name, manifest.files[name], manifest.checksum_algorithm, None,
                           listed=True) for name in sorted(rels)]  # (listed at the recorded size for this load)
        return [p for p in found if p is not None]

    @property
    def bytes_fetched(self) -> int:
        with self._lock:
            return sum(s.fetched for s in self._opened.values())

    @property
    def bytes_asked(self) -> int:
        """Bytes the reads asked for (each range once): :attr:`bytes_fetched` over this is what merging ranges
        into few requests cost."""
        with self._lock:
            return sum(s.asked for s in self._opened.values())

    @property
    def requests(self) -> int:
        """Ranged GETs made so far."""
        with self._lock:
            return sum(s.requests for s in self._opened.values())

    def close(self) -> None:
        for source in self._opened.values():
            source.close()
