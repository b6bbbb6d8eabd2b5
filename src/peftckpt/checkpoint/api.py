"""Save and load checkpoints of any ``nn.Module`` chunks + optimizer, in ``torch_dist`` or legacy ``torch``.

The public surface is :class:`Checkpointer` (``save`` / ``async_save`` / ``load`` / ``load_pretrained`` /
``load_base_tensors`` / ``close``). It works with plain modules, DTensor-TP modules, FSDP2-sharded modules and
pipeline chunks; it knows nothing about the trainer. The steps it orchestrates live in their own modules
(commit, async_save, load_checks, integrity, collectives, ...).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..sharding.entries import GlobalTensor
from .async_save import PendingSave
from .checks.integrity import plan_problems
from .checks.load_checks import (
    adapter_mismatch,
    architecture_mismatch,
    base_mismatch,
    damaged,
    optimizer_state_missing,
    shape_mismatch,
)
from .checks.strictness import KeyReport, check_keys
from .collectives import Collectives
from .commit import PendingCommit, commit_checkpoint, upload_after_write
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    UnsafeCheckpointError,
    as_read_error,
    unwrap_dcp_error,
)
from .options import LoadOptions, LoadResult, SaveOptions
from .parallel_layout import parallel_layout
from .remote import fetched, spool_dir
from .state.builder import RankState, build_state
from .state.fingerprint import FINGERPRINT_VERSION, Fingerprinting, base_fingerprint, fingerprint_version
from .state.sections import (
    MODEL,
    OPTIMIZER,
    PARAM_GROUPS,
    RNG_STATE,
    STATES,
    apply_param_groups,
    dcp_key,
    merge_param_groups,
    model_entries,
    model_section_names,
    restore_rng,
    state_key,
)
from .state.trainable import TORCH_DIST
from .storage import remote_layout
from .storage.checksums import (
    files_share,
    is_data_file,
    verify_checksums,
    verify_files,
)
from .storage.dcp_reader import has_block_index
from .storage.formats import StorageFormat, StoredCheckpoint, WriteJob, storage_format
from .storage.manifest import Manifest, read_manifest
from .storage.object_store import ObjectStore, parse_location, store_error
from .storage.remote_lock import RemoteLock, acquire_remote_lock
from .storage.save_lock import SaveDirLock, acquire_save_lock
from .storage.storage_layout import (
    clean_stale_staging,
    iteration_dirname,
    new_staging_dir,
    resolve_checkpoint_dir,
)

__all__ = ["Checkpointer", "SaveOptions", "LoadOptions", "LoadResult", "PendingSave"]


@dataclass
class _Verify:
    """The checksums of this rank's share of a checkpoint's data files, hashed while a load reads them."""

    ckpt: Path
    future: Future[list[str]] | None = None


@dataclass
class _WantedObjects:
    """The stored objects a load reads besides tensors: all their keys, and what each is for."""

    keys: list[str]
    groups: list[str] = field(default_factory=list)
    """The optimizer's param groups, one per saving rank."""
    extra: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    """Extra state: storage key -> (chunk, its state_dict name)."""
    rng: str | None = None
    states: dict[str, str] = field(default_factory=dict)
    """The checkpointer's states: name -> storage key."""


def _save_location(save_dir: str | os.PathLike[str]) -> tuple[Path, ObjectStore | None]:
    """The local directory a save works in -- ``save_dir`` itself, or for an object-store URL its node-local
    spool -- and the store. A URL of an unsupported scheme is refused before anything is written."""
    try:
        location = parse_location(save_dir, "save directory")
    except CheckpointError as e:
        refused = CheckpointFormatError(f"{e}; nothing was written")
        refused.every_rank = True
        raise refused from None
    if isinstance(location, ObjectStore):
        return spool_dir(location), location
    return location.absolute(), None


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
    ``adapter_config`` is recorded for the exports.
    """

    def __init__(self, model: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer | None = None, *,
                 mesh: DeviceMesh | None = None, process_group: dist.ProcessGroup | None = None,
                 states: Mapping[str, Any] | None = None, model_config: Mapping[str, Any] | None = None,
                 adapter_config: Mapping[str, Any] | None = None, layout: Mapping[str, int] | None = None,
                 coords: Mapping[str, int] | None = None):
        self.chunks = [model] if isinstance(model, nn.Module) else list(model)
        self.optimizer = optimizer
        self.comm = Collectives(process_group)
        self.distributed, self.rank, self.world = self.comm.distributed, self.comm.rank, self.comm.world
        self.layout, self.coords = parallel_layout(self.comm, len(self.chunks), mesh, layout, coords)
        self.states = dict(states or {})
        for name, obj in self.states.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"states[{name!r}] ({type(obj).__name__}) has no state_dict/load_state_dict")
        self.model_config = dict(model_config or {})
        self.adapter_config = None if adapter_config is None else dict(adapter_config)
        self._fingerprints: dict[int, str] = {}
        """The fingerprint of the frozen parameters, per version (the base changes only through a load)."""
        self.base_fingerprint_wait_s: float | None = None
        """How long the last base load waited for its fingerprint after reading its last piece."""
        self._pending: PendingCommit | None = None
        self._last: PendingCommit | None = None
        """The latest save (its handle's state)."""
        self._async_pg: dist.ProcessGroup | None = None
        self._host_buffers: dict[str, GlobalTensor] = {}
        """Host copies of the last async save's mutable tensors, reused by the next one."""
        self._locks: dict[Path, SaveDirLock | RemoteLock] = {}
        """Save directories this checkpointer locked (rank 0 only), held until :meth:`close`."""

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------------- content
    def model_sections(self) -> dict[str, dict[str, Any]]:
        return {name: model_entries(c) for name, c in zip(model_section_names(len(self.chunks)), self.chunks)}

    def fingerprint(self, keys: Sequence[str] | None = None, version: int = FINGERPRINT_VERSION) -> str:
        """Layout-independent fingerprint of the frozen model parameters (or of the model tensors named by
        ``keys``: what a checkpoint recorded as its base), as ``version`` computes it (a checkpoint is checked
        with the version it recorded). The default set is computed once per version, then cached."""
        if keys is None and version in self._fingerprints:
            return self._fingerprints[version]
        tensors = {dcp_key(s, k): v for s, sec in self.model_sections().items() for k, v in sec.items()
                   if isinstance(v, GlobalTensor)}
        frozen_now = {k for k, v in tensors.items() if v.frozen}
        if keys is not None and set(keys) == frozen_now:
            keys = None  # the same set as the default: share the cached value (computed at most once per run)
            if version in self._fingerprints:
                return self._fingerprints[version]
        wanted = frozen_now if keys is None else set(keys)
        value = base_fingerprint({k: v for k, v in tensors.items() if k in wanted}, self.distributed, version,
                                 self.comm.group)
        if keys is None:
            self._fingerprints[version] = value
        return value

    def _build(self, trainable_only: bool, with_optim: bool, objects: Mapping[str, Any] | None = None,
               with_rng: bool = False, sections: dict[str, dict[str, Any]] | None = None) -> RankState:
        """This rank's state (:func:`~peftckpt.checkpoint.state.builder.build_state`): what a save writes, and
        (its tensors) what a load of the same kind requests (``sections``: the model sections, if at hand)."""
        return build_state(self.model_sections() if sections is None else sections, self.optimizer, self.chunks,
                           self.rank, trainable_only=trainable_only, with_optim=with_optim, objects=objects,
                           with_rng=with_rng)

    # -------------------------------------------------------------------------------------- save
    def save(self, save_dir: str | os.PathLike[str], iteration: int, objects: Mapping[str, Any] | None = None,
             options: SaveOptions | None = None, args: Mapping[str, Any] | None = None) -> Path | str:
        """Write a committed checkpoint ``<save_dir>/iter_XXXXXXX`` and move the tracker to it; returns its path
        (its URL when ``save_dir`` is on an object store, see :mod:`peftckpt.checkpoint.remote`).

        Steps:
            1. Build this rank's entries; with ``trainable_only`` filter the model sections (this refuses a
               non-``torch_dist`` format before anything is written). Every rank's pieces must tile each
               tensor exactly once (:func:`~peftckpt.checkpoint.checks.integrity.plan_problems`), or nothing is written.
            2. Rank 0 locks the save directory (one run at a time, see
               :func:`~peftckpt.checkpoint.storage.save_lock.acquire_save_lock`) and removes stale staging
               directories; all ranks agree on a fresh staging directory.
            3. Every rank writes its shards into staging (DCP, or one legacy file per model-parallel rank).
            4. Every rank checksums its own files; rank 0 gathers them with the key records and checks that
               the checkpoint is whole (:func:`~peftckpt.checkpoint.checks.integrity.storage_problems`).
            5. Rank 0 writes the manifest, renames staging to ``iter_XXXXXXX`` and updates the tracker
               (see :func:`~peftckpt.checkpoint.storage.storage_layout.commit_staging`); then applies retention,
               which never deletes the checkpoint just committed.
        """
        options = options or SaveOptions()
        save, remote = _save_location(save_dir)
        self.wait()  # at most one save in flight; an earlier async failure surfaces here
        # 1.
        fmt = storage_format(options.ckpt_format, "SaveOptions.ckpt_format")
        commit, flat = self._save_entries(save, iteration, objects or {}, options, fmt)
        commit.args = dict(args or {})
        commit.remote = remote
        # 2.
        commit.staging, commit.target = self._new_staging(save, iteration, remote)
        commit.lease = self._locks.get(save) if remote is not None else None
        # 3.
        release: threading.Event | None = None
        error: BaseException | None = None
        try:
            release = fmt.write(WriteJob(flat, commit, self.rank, self.comm.group, self.chunks, self.optimizer,
                                         self._host_buffers, self._async_group, self._after_write(commit)))
            self._pending = commit if commit.future is not None else None
        except BaseException as e:  # noqa: BLE001 - reported collectively below
            error = unwrap_dcp_error(e)
            self._pending = None
        try:
            self.comm.agree(error, f"saving iteration {iteration} to {commit.where} failed")
        finally:
            if release is not None:
                release.set()  # the background write may start
        # 4. + 5. (an async save commits in wait(), once every rank finished writing)
        self._last = commit
        if self._pending is None:
            commit_checkpoint(self.comm, commit)
        return save / iteration_dirname(iteration) if remote is None else commit.final

    def _after_write(self, commit: PendingCommit) -> Callable[[], None]:
        """What an async save's thread does once this rank's files are written: upload them (on a store), then
        commit -- the commit's collectives on the background save's own group, so training never waits for the
        manifest, the fsyncs and the rename (an async save of the legacy format is committed by :meth:`save`)."""
        def after_write() -> None:
            if commit.remote is not None:
                upload_after_write(commit, self.rank)
            commit_checkpoint(Collectives(self._async_pg), commit)
        return after_write

    def _save_entries(self, save: Path, iteration: int, objects: Mapping[str, Any], options: SaveOptions,
                      fmt: StorageFormat) -> tuple[PendingCommit, dict[str, Any]]:
        """Save step 1 (collective): this rank's entries and the records of the commit to come, refused on
        every rank -- before anything is written -- unless every rank's pieces tile each tensor exactly once."""
        clash = sorted(set(objects) & set(self.states))
        if clash:
            raise ValueError(f"objects {clash} have the names of the checkpointer's states")
        object_names = list(objects) + [f"{STATES}.{name}" for name in self.states]
        objects = {**objects, **{state_key(name, self.rank): obj.state_dict() for name, obj in self.states.items()}}
        error: BaseException | None = None
        try:
            if self.states and not fmt.holds_states:
                raise CheckpointFormatError(f"the checkpointer's states ({', '.join(self.states)}) need "
                                            f"ckpt_format {TORCH_DIST!r}, not {options.ckpt_format!r}")
            if options.trainable_only and not fmt.holds_trainable_only:  # the format may change after parsing
                raise CheckpointFormatError(
                    f"--save-trainable-params-only needs --ckpt-format torch_dist, but this save would use "
                    f"{fmt.name!r} (legacy torch checkpoints lose requires_grad, so every tensor would be "
                    "dropped); nothing was written")
            held = self.model_sections()
            state = self._build(options.trainable_only, options.save_optim, objects, options.save_rng, held)
            flat, kept, excluded = state.entries, state.kept, state.excluded
            fingerprint = self.fingerprint() if options.trainable_only else None
        except CheckpointError as e:
            error = e
        self.comm.agree(error)
        planned = self.comm.gather({k: (list(v.global_shape), [(list(p.offsets), list(p.tensor.shape))
                                                                for p in v.pieces])
                                    for k, v in flat.items() if isinstance(v, GlobalTensor)})
        problems = plan_problems(planned)
        if problems:  # the same on every rank
            refused = CheckpointIntegrityError(f"saving iteration {iteration} to {save}: the ranks' pieces would not "
                                               "make a whole checkpoint, so nothing was written:\n  "
                                               + "\n  ".join(problems))
            refused.every_rank = True
            raise refused
        if options.trainable_only:
            trainable = any(v.requires_grad for sec in held.values() for v in sec.values()
                            if isinstance(v, GlobalTensor))
            if not any(self.comm.gather(trainable)) and self.rank == 0:
                warnings.warn("--save-trainable-params-only: no model parameter is trainable, so this checkpoint "
                              "holds no model parameters (buffers only, if any)", stacklevel=3)
        sections = model_section_names(len(self.chunks)) + (
            [OPTIMIZER] if options.save_optim and self.optimizer is not None else []) + (
            [RNG_STATE] if options.save_rng else []) + object_names
        # `staging` is set by step 2, once the directory exists.
        commit = PendingCommit(save=save, staging=save, iteration=iteration, options=options, kept=kept,
                               excluded=excluded, planned=planned, sections=sections, fingerprint=fingerprint,
                               layout=self.layout, coords=self.coords, model_config=self.model_config,
                               adapter_config=self.adapter_config)
        return commit, flat

    def _new_staging(self, save: Path, iteration: int, remote: ObjectStore | None) -> tuple[Path, str]:
        """Save step 2 (collective): rank 0 locks ``save`` and clears stale staging (on an object store also
        what earlier saves left uncommitted there); all ranks get one new staging directory, and on a store the
        prefix they upload to."""
        names: tuple[str, str] | None = None
        error: BaseException | None = None
        if self.rank == 0:
            try:
                self.lock(save if remote is None else remote.url)  # no other live run saves here: what is left is stale
                clean_stale_staging(save)
                token = secrets.token_hex(6)
                target = ""
                if remote is not None:
                    try:
                        remote.check_reachable()
                        remote_layout.clean_uncommitted(remote)
                        target = remote_layout.commit_target(remote, iteration, token)
                    except CheckpointError:
                        raise
                    except Exception as e:  # noqa: BLE001 - the store's failure, named once
                        raise store_error(e, remote.url, "the save location") from None
                names = (str(new_staging_dir(save, iteration, token)), target)
            except (CheckpointError, OSError) as e:
                error = e
        where = save if remote is None else remote.url
        self.comm.agree(error, f"saving iteration {iteration} to {where} failed")
        names = self.comm.broadcast_from_first(names)
        assert names is not None
        self.comm.barrier()
        return Path(names[0]), names[1]

    # ------------------------------------------------------------------------------------- async
    def async_save(self, save_dir: str | os.PathLike[str], iteration: int, objects: Mapping[str, Any] | None = None,
                   options: SaveOptions | None = None, args: Mapping[str, Any] | None = None) -> PendingSave:
        """:meth:`save` in the background: returns once this rank's state is copied to host memory (frozen
        parameters excepted, see :func:`~peftckpt.checkpoint.async_save.host_copy`). At most one save is in
        flight: a second one first commits the first. The legacy format is written at once (the handle is done)."""
        self.save(save_dir, iteration, objects, replace(options or SaveOptions(), async_save=True), args)
        assert self._last is not None
        return PendingSave(self._last, lambda c: self.wait() if self._pending is c else None)

    def _async_group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own for the background save, so it never interleaves with training traffic."""
        if not self.distributed:
            return None
        if self._async_pg is None:
            if self.comm.group is None:
                self._async_pg = dist.new_group(backend="gloo")
            else:  # only the group's ranks create it
                self._async_pg = dist.new_group(dist.get_process_group_ranks(self.comm.group), backend="gloo",
                                                use_local_synchronization=True)
        return self._async_pg


    @property
    def save_in_flight(self) -> bool:
        return self._pending is not None

    def poll(self) -> bool:
        """Commit the in-flight async save if every rank finished writing it (collective). True if committed."""
        if self._pending is None:
            return False
        if not self.comm.all_true(self._pending.future is not None and self._pending.future.done()):
            return False
        self.wait()
        return True

    def wait(self) -> None:
        """Wait for the in-flight async save and commit it (collective); its failure is raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        error: BaseException | None = None
        try:
            assert pending.future is not None
            pending.future.result()
        except BaseException as e:  # noqa: BLE001
            error = unwrap_dcp_error(e)
        try:
            if getattr(error, "every_rank", False):  # the background commit's own agreed error: as it is
                self.comm.agree(error)
            self.comm.agree(error, f"async save of iteration {pending.iteration} to {pending.save} failed")
            if not pending.committed:
                commit_checkpoint(self.comm, pending)
        except BaseException as e:
            pending.error = e
            raise

    def snapshot_fence(self) -> None:
        """Return once the in-flight async save with ``SaveOptions(defer_snapshot=True)`` has copied what it
        saves to host memory (at once when there is none): call it before the optimizer step. No collective."""
        pending = self._pending
        if pending is not None and pending.snapshot_taken is not None:
            pending.snapshot_taken.wait()

    # ------------------------------------------------------------------------------------- locks
    def lock(self, save_dir: str | os.PathLike[str]) -> None:
        """Hold ``save_dir``'s run lock from now until :meth:`close` (rank 0 only; a no-op on other ranks
        and when already held). :meth:`save` takes it itself; call it earlier to refuse a concurrent run
        before any work is done.

        Raises:
            SaveDirInUseError: another live process holds it.
            OSError: the directory cannot be created or written."""
        save, remote = _save_location(save_dir)
        if self.rank == 0 and save not in self._locks:
            local = acquire_save_lock(save)
            self._locks[save] = local if remote is None else acquire_remote_lock(remote, local)

    def close(self) -> None:
        """Commit any in-flight async save (collective), then release the save directories' locks, the async
        saves' host buffers and their process group. Also what leaving a ``with Checkpointer(...)`` does."""
        try:
            self.wait()
        finally:
            for held in self._locks.values():
                held.release()
            self._locks.clear()
            self._host_buffers = {}
            if self._async_pg is not None:
                dist.destroy_process_group(self._async_pg)
                self._async_pg = None

    # -------------------------------------------------------------------------------------- load
    def _resolve(self, path: str | os.PathLike[str], options: LoadOptions) -> tuple[Path, int, Manifest, _Verify]:
        """Directory, iteration and manifest of a committed checkpoint, its files verified (collective):
        presence, sizes and the small files now; with ``verify_while_reading`` the checksums of the data
        files in a background thread, finished by :meth:`_read`."""
        ckpt, iteration = resolve_checkpoint_dir(path)
        manifest = read_manifest(ckpt)
        pending = _Verify(ckpt)
        shard = (self.rank, self.world)
        fmt = storage_format(manifest.format, f"checkpoint {ckpt}")
        later = options.verify_while_reading and fmt.hashes_while_reading
        # Presence, type and size of every file always (cheap); the hashing as the options say.
        hash_if = (lambda rel: not is_data_file(rel)) if later else None
        problems = verify_files(ckpt, manifest, shard, hash_if=hash_if if options.verify_checksums else lambda _: False)
        error: UnsafeCheckpointError | None = None
        if self.rank == 0:
            # Always, checksums or not: no storage item may lead outside the checkpoint or past a file's end.
            try:
                problems += fmt.structure_problems(ckpt, manifest)
            except UnsafeCheckpointError as e:
                error = e
        self.comm.agree(error)
        self._raise_if_damaged(pending, problems)
        if options.verify_checksums and later:
            # A data file with a block index is verified by the read itself, block by block, as it is read.
            rels = [rel for rel in files_share(manifest, shard)
                    if is_data_file(rel) and not has_block_index(ckpt / rel)]
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peftckpt-verify")
            pending.future = executor.submit(verify_checksums, ckpt, manifest, rels)
            executor.shutdown(wait=False)
        return ckpt, iteration, manifest, pending

    def _raise_if_damaged(self, v: _Verify, problems: list[str], after_read: bool = False) -> None:
        """Raise :class:`CheckpointIntegrityError` on every rank if any rank found a damaged file."""
        error = damaged(v.ckpt, list(dict.fromkeys(p for ps in self.comm.gather(problems) for p in ps)), after_read)
        if error is not None:
            error.every_rank = True  # every rank raises this same error: said once
            raise error

    def load(self, path: str | os.PathLike[str], options: LoadOptions | None = None,
             model_only: bool = False) -> LoadResult:
        """Load a committed checkpoint into the chunks (and optimizer); returns iteration, objects, report.

        Steps:
            1. Resolve the directory (tracker), read the manifest, verify the files (split over ranks; the
               data files' checksums in a thread, while step 4 reads them).
            2. Check that the checkpoint fits this model: architecture, adapter configuration and, for a
               trainable-only checkpoint, the base fingerprint.
            3. Build the request -- filtered like the save for a trainable-only checkpoint.
            4. Open it in its format (DCP reshards; a legacy file loads only at the layout it was saved at),
               check the stored shapes and the strictness mode against the request, read it, finish the
               checksums; apply extra state, optimizer groups, the checkpointer's states (in place) and the
               RNG state.
        """
        options = options or LoadOptions()
        self.wait()  # an async save in flight is committed first: it may be the checkpoint asked for
        with self._located(path, options) as (local, options, url):
            result = self._load(local, options, model_only)
        return result if url is None else replace(result, path=url)

    @contextlib.contextmanager
    def _located(self, path: str | os.PathLike[str], options: LoadOptions
                 ) -> Iterator[tuple[str | os.PathLike[str], LoadOptions, str | None]]:
        """``path`` to load from, with the options to load it with, and its URL on an object store (collective):
        a checkpoint on a store is fetched to a node-local copy, every object verified as it downloads, so the
        copy's checksums are not taken again (see :func:`~peftckpt.checkpoint.remote.fetched`)."""
        try:
            location = parse_location(path, "checkpoint")
        except CheckpointError as e:
            e.every_rank = True
            raise
        if not isinstance(location, ObjectStore):
            yield path, options, None
            return
        with fetched(self.comm, location) as (local, url, _):
            yield local, replace(options, verify_checksums=False), url

    def _load(self, path: str | os.PathLike[str], options: LoadOptions, model_only: bool) -> LoadResult:
        """:meth:`load` of a local checkpoint."""
        # 1.
        ckpt, iteration, manifest, verification = self._resolve(path, options)
        fmt = storage_format(manifest.format, f"checkpoint {ckpt}")
        if self.states and not model_only and not fmt.holds_states:
            raise CheckpointFormatError(f"checkpoint {ckpt} is in the {fmt.name!r} format, which holds no "
                                        f"states ({', '.join(self.states)})")
        # 2.
        self._check_fits(ckpt, manifest, options, model_only)
        # 3.
        request, with_optim = self._load_request(ckpt, manifest, options, model_only)
        same_layout = {k: manifest.layout.get(k) for k in ("tp", "pp", "dp", "vpp")} == {
            k: self.layout.get(k) for k in ("tp", "pp", "dp", "vpp")}
        object_keys = [] if model_only else list(options.objects)
        if not manifest.trainable_only:
            self._fingerprints.clear()  # a full checkpoint replaces the base too
        # 4.
        stored = self._open(fmt, ckpt, manifest, options)
        self.comm.agree(shape_mismatch(request, stored.tensor_shapes, ckpt))
        report = self._check_keys(ckpt, manifest, stored, request, options, with_optim)
        wanted = self._objects_to_read(manifest, stored.object_keys, object_keys, options, model_only, with_optim,
                                       same_layout, ckpt)
        request.update(dict.fromkeys(wanted.keys))
        self._read(request, stored, verification)
        objects = {k: request[k] for k in wanted.keys}
        self._apply_objects(ckpt, objects, wanted, options, with_optim)
        if options.load_rng and not model_only and not same_layout and self.rank == 0:
            warnings.warn(f"checkpoint layout {manifest.layout} differs from this run's {self.layout}: "
                          "RNG state is re-seeded instead of restored", stacklevel=2)
        return LoadResult(ckpt, iteration, manifest, objects, report, rng_restored=wanted.rng is not None)

    def _check_fits(self, ckpt: Path, manifest: Manifest, options: LoadOptions, model_only: bool) -> None:
        """Load step 2 (collective): refuse a checkpoint made for another architecture, adapter or base."""
        self.comm.agree(architecture_mismatch(self.model_config, manifest, ckpt))
        self.comm.agree(adapter_mismatch(self.adapter_config, manifest, ckpt))
        if manifest.trainable_only and options.verify_base and not model_only:
            # Fingerprint what the checkpoint calls its base (its excluded keys), not what is frozen now: a
            # parameter unfrozen since is reported as an unexpected key, with its own hint.
            mine = self.fingerprint(sorted(manifest.excluded_keys),
                                    fingerprint_version(manifest.base_fingerprint or ""))
            self.comm.agree(base_mismatch(manifest, mine, ckpt))

    def _load_request(self, ckpt: Path, manifest: Manifest, options: LoadOptions, model_only: bool
                      ) -> tuple[dict[str, Any], bool]:
        """Load step 3: this rank's ``{storage key: entry}`` to read, and whether it includes the optimizer."""
        with_optim = options.load_optim and not model_only
        if with_optim and self.optimizer is not None and OPTIMIZER not in manifest.sections:
            # Recorded, not guessed: the manifest says the save left the optimizer out (--no-save-optim,
            # import-peft). Its keys are not "missing"; the optimizer starts fresh, and we say so.
            with_optim = False
            if self.rank == 0:
                warnings.warn(f"checkpoint {ckpt} was saved without optimizer state (--no-save-optim or an "
                              "import): the optimizer starts fresh", stacklevel=3)
        request = self._build(manifest.trainable_only, with_optim).tensors()
        if manifest.trainable_only:  # buffers, which trainable-only saves of earlier releases left out
            for k in set(manifest.excluded_keys) & set(request):
                if not request[k].requires_grad:
                    request.pop(k)
        return request, with_optim

    def _open(self, fmt: StorageFormat, ckpt: Path, manifest: Manifest, options: LoadOptions) -> StoredCheckpoint:
        """Open the checkpoint in its format for this rank (collective: a refusal is every rank's); what it reads
        is verified as it is read unless :meth:`_resolve` hashed every file first (or nothing is verified)."""
        stored: StoredCheckpoint | None = None
        error: BaseException | None = None
        try:
            verify = options.verify_checksums and options.verify_while_reading
            stored = fmt.open(ckpt, manifest, self.layout, self.coords, self.comm.group, verify)
        except BaseException as e:  # noqa: BLE001 - refused, or a file unreadable since it was verified
            error = as_read_error(e, ckpt)
        self.comm.agree(error)
        assert stored is not None
        return stored

    def _check_keys(self, ckpt: Path, manifest: Manifest, stored: StoredCheckpoint, request: dict[str, Any],
                    options: LoadOptions, with_optim: bool) -> KeyReport:
        """The strictness mode against the stored keys (collective); unexpected keys leave the request."""
        saved = set(stored.tensor_shapes)
        hints = {k: ("trainable now but frozen when the checkpoint was saved, so it is not in it: its value must "
                     "come from --pretrained-checkpoint; --dist-ckpt-strictness log_unexpected keeps that value")
                 for k in manifest.excluded_keys}
        all_requested = None
        if options.strictness.needs_missing:
            all_requested = set(request) if stored.per_rank else {
                k for keys in self.comm.gather(sorted(request)) for k in keys}
            saved = {k for k in saved if k.startswith((MODEL + ".", OPTIMIZER + ".")) and
                     (with_optim or not k.startswith(OPTIMIZER + "."))}
        error: BaseException | None = None
        report = KeyReport()
        try:
            report = check_keys(options.strictness, request, saved, self.rank, all_requested, hints,
                                source=f"checkpoint {ckpt}")
        except CheckpointError as e:
            error = e
        self.comm.agree(error)
        for k in report.unexpected:
            request.pop(k, None)
        return report

    def _objects_to_read(self, manifest: Manifest, bytes_keys: set[str], object_keys: Sequence[str],
                         options: LoadOptions, model_only: bool, with_optim: bool, same_layout: bool, ckpt: Path
                         ) -> _WantedObjects:
        """The stored objects (``bytes_keys``) a load reads besides tensors, and what each is for."""
        wanted = _WantedObjects(keys=[k for k in object_keys if k in bytes_keys])
        if with_optim:
            wanted.groups = sorted(k for k in bytes_keys if k.startswith(f"{OPTIMIZER}.{PARAM_GROUPS}."))
        # Extra state (e.g. Transformer Engine's FP8 metadata) of a full checkpoint goes back through
        # `set_extra_state`; a trainable-only checkpoint never holds any.
        if not manifest.trainable_only:
            for chunk in self.chunks:
                for name, value in chunk.state_dict(keep_vars=True).items():
                    if not isinstance(value, torch.Tensor) and dcp_key(MODEL, name) in bytes_keys:
                        wanted.extra[dcp_key(MODEL, name)] = (chunk, name)
        rng_key = f"{RNG_STATE}.{self.rank}"
        if options.load_rng and not model_only and same_layout and rng_key in bytes_keys:
            wanted.rng = rng_key
        wanted.states = {} if model_only else self._state_keys(ckpt, bytes_keys)
        wanted.keys += wanted.groups + list(wanted.extra) + ([wanted.rng] if wanted.rng else []) + list(
            wanted.states.values())
        return wanted

    def _apply_objects(self, ckpt: Path, objects: dict[str, Any], wanted: _WantedObjects, options: LoadOptions,
                       with_optim: bool) -> None:
        """Put the read objects where they belong (taking them out of ``objects``): extra state, optimizer
        groups (collective check), the checkpointer's states, the RNG state."""
        for k, (chunk, name) in wanted.extra.items():
            chunk.load_state_dict({name: objects.pop(k)}, strict=False)
        if with_optim and self.optimizer is not None:
            saved_groups = merge_param_groups([objects.pop(k) for k in wanted.groups])
            if not saved_groups:
                absent = [f"{OPTIMIZER}.{PARAM_GROUPS}"]
            else:
                absent = [f"{OPTIMIZER}.scalar_state.{n}" for n in
                          apply_param_groups(self.optimizer, saved_groups, self.chunks)]
            self.comm.agree(optimizer_state_missing(absent, options.strictness, self.rank, ckpt))
        for name, key in wanted.states.items():
            self.states[name].load_state_dict(objects.pop(key))
        if wanted.rng is not None:
            restore_rng(objects.pop(wanted.rng))

    def _state_keys(self, ckpt: Path, stored: set[str]) -> dict[str, str]:
        """The stored key each of :attr:`states` is restored from (collective): this rank's own copy, or rank
        0's when the checkpoint was saved by fewer ranks (said once). A state the checkpoint lacks is an error."""
        keys: dict[str, str] = {}
        absent = []
        for name in self.states:
            mine, first = state_key(name, self.rank), state_key(name, 0)
            if mine in stored or first in stored:
                keys[name] = mine if mine in stored else first
            else:
                absent.append(name)
        self.comm.agree(CheckpointMismatchError(
            f"checkpoint {ckpt} holds no state for {', '.join(map(repr, absent))}: it was saved without them "
            "(another program, or a checkpointer without these states)") if absent else None)
        borrowed = any(self.comm.gather(any(k != state_key(n, self.rank) for n, k in keys.items())))
        if borrowed and self.rank == 0:
            warnings.warn(f"checkpoint {ckpt} was saved by fewer ranks than this job: ranks without their own copy "
                          "of the checkpointer's states restore rank 0's", stacklevel=3)
        return keys

    def _read(self, request: dict[str, Any], stored: StoredCheckpoint, verification: _Verify,
              fingerprinting: Fingerprinting | None = None) -> None:
        """Read the request in place, then finish the checksums started by :meth:`_resolve`; a
        failure on any rank is raised on every rank (a damaged file first: it explains a failed read).
        ``fingerprinting`` is handed each piece as soon as it is read."""
        error: BaseException | None = None
        problems: list[str] = []
        try:
            problems = stored.read(request, None if fingerprinting is None else fingerprinting.add)
        except BaseException as e:  # noqa: BLE001 - reported collectively
            error = as_read_error(unwrap_dcp_error(e), verification.ckpt)
        if verification.future is not None:
            try:
                problems += verification.future.result()
            except OSError as e:  # a file gone or unreadable since it was checked: still a collective report
                problems.append(f"{getattr(e, 'filename', None) or verification.ckpt}: cannot be read to verify: {e}")
        self._raise_if_damaged(verification, problems, after_read=True)
        self.comm.agree(error)

    def load_base_tensors(self, source: str, shapes: Mapping[str, Sequence[int]],
                          read: Callable[[str, Sequence[int], Sequence[int]], torch.Tensor]) -> list[str]:
        """Load the model sections from a source in another format, piece by piece (collective).

        ``shapes`` maps the storage keys the source holds (``model.<name>``) to their global shapes; ``read(key,
        offsets, sizes)`` returns that region of one. Each rank reads only its own pieces, straight into the
        model. As with :meth:`load_pretrained`, a frozen tensor the source lacks (or holds with another
        shape) is an error naming ``source``; trainable ones it lacks (adapters) keep their values. Returns
        the keys that were not in the source."""
        self.wait()
        request = self._build(False, False).tensors()
        absent = sorted(k for k in request if k not in shapes)
        wrong = [f"  {k}: {source} {list(shapes[k])}, model {list(v.global_shape)}" for k, v in sorted(request.items())
                 if k in shapes and list(shapes[k]) != list(v.global_shape)]
        frozen_absent = [k for k in absent if not request[k].requires_grad]
        error: BaseException | None = None
        if frozen_absent or wrong:
            error = CheckpointMismatchError(
                (f"{source} lacks {len(frozen_absent)} frozen base tensor(s): "
                 + ", ".join(frozen_absent[:10]) + ("" if len(frozen_absent) <= 10 else ", ...") + "\n"
                 if frozen_absent else "")
                + (f"{source} holds tensors of other shapes than this model's:\n" + "\n".join(wrong[:10])
                   if wrong else ""))
        self.comm.agree(error)
        with self._fingerprinting_base(request) as fingerprinting:
            try:
                with torch.no_grad():
                    for key, entry in request.items():
                        if key in shapes:
                            for piece in entry.pieces:
                                piece.tensor.copy_(read(key, piece.offsets, piece.tensor.shape))
                                fingerprinting.add(key, piece.offsets, piece.tensor)
            except CheckpointError as e:
                error = e
            except (OSError, ValueError) as e:  # an unreadable or damaged source file: the source names it
                error = CheckpointIntegrityError(f"{source} cannot be read: {e}")
            self.comm.agree(error)
        return absent

    @contextlib.contextmanager
    def _fingerprinting_base(self, request: Mapping[str, Any]) -> Iterator[Fingerprinting]:
        """The fingerprint of the base a load is writing into the model, fed piece by piece as the load reads
        them (hashing overlaps the reading), and cached once the load succeeded (collective)."""
        self._fingerprints.clear()  # the base changes
        fingerprinting = Fingerprinting({k: v for k, v in request.items() if isinstance(v, GlobalTensor)
                                         and v.frozen}, self.distributed, group=self.comm.group)
        try:
            yield fingerprinting
        except BaseException:
            fingerprinting.close()
            raise
        self._fingerprints[FINGERPRINT_VERSION] = fingerprinting.result()
        self.base_fingerprint_wait_s = fingerprinting.wait_s

    def load_pretrained(self, path: str | os.PathLike[str], options: LoadOptions | None = None) -> LoadResult:
        """Load the base weights (model sections only) from a full checkpoint.

        Trainable parameters the base does not have (the adapters) keep their initial values; a *frozen*
        parameter the base does not have is an error -- it would silently stay random.
        """
        options = options or LoadOptions()
        self.wait()  # the in-flight async save may be writing the base from live memory
        with self._located(path, options) as (local, options, url):
            result = self._load_pretrained(local, options)
        return result if url is None else replace(result, path=url)

    def _load_pretrained(self, path: str | os.PathLike[str], options: LoadOptions) -> LoadResult:
        """:meth:`load_pretrained` of a local checkpoint."""
        ckpt, _, manifest, verification = self._resolve(path, options)
        if manifest.trainable_only:
            raise CheckpointFormatError(
                f"--pretrained-checkpoint {ckpt} is an adapter-only checkpoint (saved with "
                "--save-trainable-params-only); it holds no base weights. Pass it as --load instead")
        self.comm.agree(architecture_mismatch(self.model_config, manifest, ckpt))
        fmt = storage_format(manifest.format, f"--pretrained-checkpoint {ckpt}")
        if not fmt.reshards:
            raise CheckpointFormatError(f"--pretrained-checkpoint {ckpt} must be torch_dist, got {manifest.format!r}")
        stored = self._open(fmt, ckpt, manifest, options)
        request = self._build(False, False).tensors()
        self.comm.agree(shape_mismatch(request, stored.tensor_shapes, ckpt))
        absent = [k for k in request if k not in stored.tensor_shapes]
        frozen_absent = [k for k in absent if not request[k].requires_grad]
        error: BaseException | None = None
        if frozen_absent:
            error = CheckpointMismatchError(
                f"--pretrained-checkpoint {ckpt} lacks {len(frozen_absent)} frozen base tensor(s): "
                + ", ".join(sorted(frozen_absent)[:10]) + ("" if len(frozen_absent) <= 10 else ", ...")
            )
        self.comm.agree(error)
        for k in absent:
            request.pop(k)
        with self._fingerprinting_base(request) as fingerprinting:
            self._read(request, stored, verification, fingerprinting)
        return LoadResult(ckpt, manifest.iteration, manifest, {}, KeyReport(unexpected=sorted(absent)))
