"""Save and load checkpoints of any ``nn.Module`` chunks + optimizer, in ``torch_dist`` or legacy ``torch``.

The public surface is :class:`Checkpointer` (``save`` / ``async_save`` / ``load`` / ``load_pretrained`` /
``load_base_tensors`` / ``close``). It works with plain modules, DTensor-TP modules, FSDP2-sharded modules and
pipeline chunks, in a directory or on an object store; it knows nothing about the trainer. The steps live in
their own modules: :mod:`~peftckpt.checkpoint.save` (and :mod:`~peftckpt.checkpoint.commit`),
:mod:`~peftckpt.checkpoint.load`, the locations and their protocol in :mod:`peftckpt.checkpoint.location`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..sharding.entries import GlobalTensor
from .gc_pause import gc_paused
from .load_base import BaseLoads
from .options import LoadOptions, LoadResult, SaveOptions
from .rank_parts import RankParts
from .save import PendingSave, Saves
from .state.fingerprint import FINGERPRINT_VERSION

__all__ = ["Checkpointer", "SaveOptions", "LoadOptions", "LoadResult", "PendingSave"]


class Checkpointer:
    """Checkpoints of this rank's model ``chunks`` (one module, or one per virtual pipeline stage), its
    ``optimizer`` and any ``states`` (objects with ``state_dict``/``load_state_dict``: an LR scheduler, a
    data loader, ...; saved with every checkpoint and restored in place by every full load).

    The parallel layout is recorded in the manifest and decides whether per-rank RNG state can be restored.
    It comes from ``mesh``, a :class:`~torch.distributed.device_mesh.DeviceMesh` whose dimensions are named
    ``tp``, ``pp`` and ``dp`` (``dp_replicate``/``dp_shard`` count as ``dp``; absent ones are 1), or without
    one, every rank of the group is a data-parallel replica. ``layout`` (``tp``, ``pp``, ``dp``, ``vpp``) and
    ``coords`` (this rank's ``tp``/``pp``/``dp`` ranks) may instead be given as dicts.

    All methods are collective over ``process_group`` (default: every rank) when ``torch.distributed`` is
    initialised. ``model_config`` (optional) is recorded and checked against a checkpoint on load;
    ``adapter_config`` is recorded for the exports. A save location or checkpoint is a local path or an
    object-store URL (``s3://bucket/prefix``).
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer | None = None, *,
                 mesh: DeviceMesh | None = None, process_group: dist.ProcessGroup | None = None,
                 states: Mapping[str, Any] | None = None, model_config: Mapping[str, Any] | None = None,
                 adapter_config: Mapping[str, Any] | None = None, layout: Mapping[str, int] | None = None,
                 coords: Mapping[str, int] | None = None):
        self.parts = RankParts(model, optimizer, mesh, process_group, states, model_config, adapter_config, layout,
                               coords)
        p = self.parts
        self.chunks, self.optimizer, self.comm, self.states = p.chunks, p.optimizer, p.comm, p.states
        self.distributed, self.rank, self.world = p.comm.distributed, p.rank, p.world
        self.layout, self.coords = p.layout, p.coords
        self.model_config, self.adapter_config = p.model_config, p.adapter_config
        self._saves = Saves(p)
        self._loads = BaseLoads(p)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- content
    def model_sections(self) -> dict[str, dict[str, Any]]:
        """``{section: {name: entry}}`` of the model chunks (``model``, or ``model0``, ``model1``, ...)."""
        return self.parts.model_sections()

    def fingerprint(self, keys: Sequence[str] | None = None, version: int = FINGERPRINT_VERSION) -> str:
        """Layout-independent fingerprint of the frozen model parameters (or of the model tensors named by
        ``keys``: what a checkpoint recorded as its base), as ``version`` computes it (a checkpoint is checked
        with the version it recorded). The default set is computed once per version, then cached."""
        return self.parts.fingerprint(keys, version)

    @property
    def _fingerprints(self) -> dict[int, str]:
        return self.parts.fingerprints

    @property
    def base_fingerprint_wait_s(self) -> float | None:
        """How long the last base load waited for its fingerprint after reading its last piece."""
        return self._loads.base_fingerprint_wait_s

    # -------------------------------------------------------------------------------------- save
    @gc_paused
    def save(self, save_dir: str | os.PathLike[str], iteration: int, objects: Mapping[str, Any] | None = None,
             options: SaveOptions | None = None, args: Mapping[str, Any] | None = None) -> Path | str:
        """Write a committed checkpoint ``<save_dir>/iter_XXXXXXX`` and move the tracker to it; returns its path
        (its URL when ``save_dir`` is on an object store). ``objects`` (picklable values) and ``args`` (recorded in
        the manifest) go with it. The steps: :meth:`peftckpt.checkpoint.save.Saves.save`."""
        return self._saves.save(save_dir, iteration, objects or {}, options or SaveOptions(), args or {})

    @gc_paused
    def async_save(self, save_dir: str | os.PathLike[str], iteration: int, objects: Mapping[str, Any] | None = None,
                   options: SaveOptions | None = None, args: Mapping[str, Any] | None = None) -> PendingSave:
        """:meth:`save` in the background: returns once this rank's state is copied to host memory (frozen
        parameters excepted, see :func:`~peftckpt.checkpoint.snapshot.host_copy`; with
        ``SaveOptions(defer_snapshot=True)`` at once, its entries built and copied in the save's own thread, see
        :meth:`snapshot_fence`), and is committed in its own thread once every rank has written it. At most one save is in flight: a second one first commits the
        first. The legacy format is written at once (the handle is done)."""
        return self._saves.async_save(save_dir, iteration, objects or {}, options or SaveOptions(), args or {})

    @property
    def save_in_flight(self) -> bool:
        return self._saves.pending is not None

    @property
    def _host_buffers(self) -> dict[str, GlobalTensor]:
        return self._saves.host_buffers

    @gc_paused
    def poll(self) -> bool:
        """Commit the in-flight async save if every rank finished writing it (collective). True if committed."""
        return self._saves.poll()

    @gc_paused
    def wait(self) -> None:
        """Wait for the in-flight async save and commit it (collective); its failure is raised here."""
        self._saves.wait()

    def snapshot_fence(self) -> None:
        """Return once the in-flight async save with ``SaveOptions(defer_snapshot=True)`` has copied what it
        saves to host memory (at once when there is none): call it before the optimizer step. No collective."""
        self._saves.snapshot_fence()

    def lock(self, save_dir: str | os.PathLike[str]) -> None:
        """Hold ``save_dir``'s run lock from now until :meth:`close` (rank 0 only; a no-op on other ranks
        and when already held). :meth:`save` takes it itself; call it earlier to refuse a concurrent run
        before any work is done.

        Raises:
            SaveDirInUseError: another live process holds it.
            OSError: the directory cannot be created or written."""
        self._saves.lock(save_dir)

    @gc_paused
    def close(self) -> None:
        """Commit any in-flight async save (collective), then release the save locations' locks, the async
        saves' host buffers and their process group. Also what leaving a ``with Checkpointer(...)`` does."""
        self._saves.close()

    # -------------------------------------------------------------------------------------- load
    @gc_paused
    def load(self, path: str | os.PathLike[str], options: LoadOptions | None = None,
             model_only: bool = False) -> LoadResult:
        """Load a committed checkpoint (a save location: the one its tracker names; or a checkpoint) into the
        chunks (and optimizer, states and RNG); returns iteration, objects, key report. The steps:
        :meth:`peftckpt.checkpoint.load.Loads.load`."""
        self.wait()  # an async save in flight is committed first: it may be the checkpoint asked for
        return self._loads.load(path, options, model_only)

    @gc_paused
    def load_pretrained(self, path: str | os.PathLike[str], options: LoadOptions | None = None,
                        then: Callable[[str], None] | None = None) -> LoadResult:
        """Load the base weights (model sections only) from a full checkpoint.

        Trainable parameters the base does not have (the adapters) keep their initial values; a *frozen*
        parameter the base does not have is an error -- it would silently stay random. ``then(key)``, where
        given, is called as in :meth:`load_base_tensors` (the base is then read a few tensors at a time).
        """
        self.wait()  # the in-flight async save may be writing the base from live memory
        return self._loads.load_pretrained(path, options, then)

    def base_changed(self) -> None:
        """Say that the frozen parameters changed since they were loaded (quantized, say): the base fingerprint
        the load took is dropped, and taken again from the parameters when a save or a load needs it."""
        self.parts.base_changed()

    @gc_paused
    def load_base_tensors(self, source: str, shapes: Mapping[str, Sequence[int]],
                          read: Callable[[str, Sequence[int], Sequence[int]], torch.Tensor],
                          read_into: Callable[[str, Sequence[int], torch.Tensor], None] | None = None,
                          then: Callable[[str], None] | None = None) -> list[str]:
        """Load the model sections from a source in another format, piece by piece (collective).

        ``shapes`` maps the storage keys the source holds (``model.<name>``) to their global shapes; ``read(key,
        offsets, sizes)`` returns that region of one; ``read_into(key, offsets, out)``, where given, is used
        instead and fills ``out`` (a view of the model's memory) with the region of its size. Each rank reads
        only its own pieces. As with :meth:`load_pretrained`, a frozen tensor the source lacks (or holds with
        another shape) is an error naming ``source``; trainable ones it lacks (adapters) keep their values.
        Returns the keys that were not in the source. ``then(key)``, where given, is called (on every rank, in the
        same order) once this rank's pieces of ``key`` are in place -- to transform the tensor before the next is
        read, e.g. quantize it and release its full-precision memory; the base fingerprint is then taken from the
        parameters when a save or a load needs it, not from what was read."""
        self.wait()
        return self._loads.load_base_tensors(source, shapes, read, read_into, then)
