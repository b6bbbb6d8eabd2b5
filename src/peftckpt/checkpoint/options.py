"""The option and result types of :class:`~peftckpt.checkpoint.api.Checkpointer`'s save and load."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .checks.strictness import KeyReport, StrictHandling
from .state.trainable import TORCH_DIST
from .storage.manifest import Manifest

__all__ = ["SaveOptions", "LoadOptions", "LoadResult"]


@dataclass
class SaveOptions:
    ckpt_format: str = TORCH_DIST
    trainable_only: bool = False
    save_optim: bool = True
    save_rng: bool = True
    keep_last_k: int | None = None
    async_save: bool = False
    """Write in a background thread after a blocking copy to host memory, then commit there too (the commit's
    collectives run on the background save's own process group); :meth:`Checkpointer.poll`,
    :meth:`Checkpointer.wait` or the next save report it (at most one save in flight)."""
    defer_snapshot: bool = False
    """With ``async_save`` (``torch_dist``): the call takes only the objects, the RNG state, a copy of the model's
    buffers and the version counters of the tensors training updates, and returns; the entries are built, agreed
    across ranks and copied to host memory in the save's own thread, overlapping the next forward/backward. The
    caller must call :meth:`Checkpointer.snapshot_fence` before anything modifies trainable parameters, the
    optimizer's state or its hyper-parameters (the optimizer step); a tensor modified before the copy finished
    discards the save with an error. What the save refuses is raised by the next save, wait or ``result()``."""


@dataclass
class LoadOptions:
    load_optim: bool = True
    load_rng: bool = True
    strictness: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED
    verify_checksums: bool = True
    verify_while_reading: bool = True
    """Hash the data files while DCP reads them (the read and the hashing overlap; the file is read from disk
    once). A damaged file is still reported, naming it, but after the model and optimizer received values
    from it. False verifies every file before anything is read (e.g. to hot-swap an adapter into a model
    that must stay intact if the new one is damaged; from an object store this downloads the checkpoint, every
    object hashed, before anything is read, instead of reading its objects in place). Presence, sizes and the
    small files (manifest, DCP metadata) are always checked first."""
    verify_base: bool = True
    base_cache: bool = True
    """``load_pretrained`` of a base on an object store keeps a verified copy of it in the host's base cache
    (``$PEFTCKPT_CACHE_DIR/bases``, at most ``$PEFTCKPT_BASE_CACHE_GB`` GB, least recently used evicted first), so
    the next run on the host reads it from local disk; False reads the base where it lies, by ranges, each rank
    fetching only its own pieces. ``load`` never caches (a resumed checkpoint is read once)."""
    objects: Sequence[str] = ()
    """Names of object sections to read back (iteration, opt_param_scheduler, ...)."""

    def __post_init__(self) -> None:
        if not isinstance(self.strictness, StrictHandling):  # a mode's name is accepted too
            try:
                self.strictness = StrictHandling(self.strictness)
            except ValueError:
                raise ValueError(f"LoadOptions.strictness: unknown mode {self.strictness!r} (known: "
                                 f"{', '.join(m.value for m in StrictHandling)})") from None


@dataclass
class LoadResult:
    path: Path | str
    """The checkpoint loaded: its directory, or its URL on an object store."""
    iteration: int
    manifest: Manifest
    objects: dict[str, Any] = field(default_factory=dict)
    report: KeyReport = field(default_factory=KeyReport)
    rng_restored: bool = False
    bytes_fetched: int | None = None
    """Bytes this rank fetched from an object store for the load: its ranged reads, or for a base through the
    host's cache the copy it fetched (the whole base on the rank that fetched it, 0 on the host's other ranks and
    on a cache hit); ``None``: read from a directory, or from a fresh verified copy."""
    cache_hit: bool | None = None
    """For a base loaded through the host's base cache: whether it was there already (``None``: no cache used)."""
