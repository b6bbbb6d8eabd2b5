"""How a save's data files reach a store: each streamed into its object as it is written, and what killed saves left
unfinished swept away.

A rank's data file is written through an :class:`~peftckpt.checkpoint.storage.object_writes.ObjectWriter` (parts
uploaded while the next fill, a few held, nothing visible until the object is complete), so no copy of it lands
on local disk. A process killed mid-object leaves a multipart upload nobody will complete -- invisible to every
reader, but stored (and billed) until aborted: :func:`abort_unfinished` aborts those of a location once per process
(the new run sweeps what the killed one left; within a run a failed write aborts its own upload, and only where
that abort failed too is the next save asked to sweep again) -- one listing request per run, not one per save.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from ..faults import fault_point
from ..storage.checksums import StreamTo
from ..storage.object_store import ObjectStore
from ..storage.object_writes import ObjectWriter
from .base import SaveTarget

__all__ = ["object_streams", "abort_unfinished"]

_SWEPT: set[str] = set()
"""The store locations (URLs) whose unfinished uploads this process aborted."""


def object_streams(store: ObjectStore, target: SaveTarget, rank: int) -> StreamTo:
    """Opens each of ``rank``'s data files, by its path under ``target.local``, as its object under ``target``;
    the ``upload`` fault point fires once the rank's first object is complete."""
    first = [True]

    def on_done() -> None:
        if first:
            first.clear()
            fault_point("upload", rank, target.iteration)

    def open_object(path: Path) -> io.RawIOBase:
        rel = f"{target.name}/{path.relative_to(target.local).as_posix()}"
        return ObjectWriter(store, rel, on_done=on_done, on_abandoned=lambda: _SWEPT.discard(store.url))
    return open_object


def abort_unfinished(store: ObjectStore, keep: set[str]) -> int:
    """Abort the multipart uploads below the location whose first name is not in ``keep``, unless this process
    did already (module docstring); how many. Best effort: where the store refuses (credentials without the
    permission to list or abort multipart uploads), one warning says so and saves go on -- what is left costs
    storage, not correctness."""
    if store.url in _SWEPT:
        return 0
    _SWEPT.add(store.url)
    try:
        stale = [(rel, upload) for rel, upload in store.unfinished_uploads() if rel.split("/", 1)[0] not in keep]
        for rel, upload in stale:
            store.abort_upload(rel, upload)
    except Exception as e:  # noqa: BLE001 - reported, never fatal
        warnings.warn(f"{store.url}: unfinished multipart uploads of interrupted saves cannot be listed or aborted "
                      f"({type(e).__name__}: {e}); they stay stored until aborted: allow s3:ListBucketMultipartUploads "
                      "and s3:AbortMultipartUpload, or add a lifecycle rule that aborts incomplete multipart uploads",
                      stacklevel=2)
        return 0
    return len(stale)
