"""Saves: a checkpoint of the rank parts written, checked whole and committed into a location.

:class:`Saves` keeps what lives between saves -- the save in flight, the host buffers async saves reuse, their
process group, the run locks held -- and runs :meth:`Saves.save` as its numbered steps against a
:class:`~peftckpt.checkpoint.location.base.Location`; :class:`PendingSave` is an async save's handle.
"""

from __future__ import annotations

import copy
import os
import secrets
import threading
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..sharding.entries import GlobalTensor
from .background import one_core
from .checks.integrity import plan_problems
from .collectives import Collectives
from .commit import PendingCommit, commit_checkpoint, hand_over_files
from .errors import CheckpointError, CheckpointFormatError, CheckpointIntegrityError, unwrap_dcp_error
from .gc_pause import paused_gc
from .location import protocol
from .location.base import Held, Location, SaveTarget
from .location.locate import locate
from .location.names import iteration_dirname
from .options import SaveOptions
from .rank_parts import RankParts
from .snapshot import take_call_state, unchanged_since_call, with_buffers_at_call
from .state.sections import OPTIMIZER, RNG_STATE, STATES, model_section_names, state_key, take_rng
from .state.trainable import TORCH_DIST
from .storage.formats import StorageFormat, WriteJob, Written, storage_format
from .storage.plan_memo import PlanMemo, layout_of

__all__ = ["Saves", "PendingSave"]


class PendingSave:
    """An async save (:meth:`~peftckpt.checkpoint.api.Checkpointer.async_save`): training goes on while it is
    written.

    :meth:`result` waits for it, commits it (collective, like every checkpointer call: every rank calls it)
    and returns the committed checkpoint, or raises why it failed. The next save or load and the
    checkpointer's ``wait``, ``poll`` and ``close`` commit it too; :meth:`result` then answers at once.
    """

    def __init__(self, commit: PendingCommit, finish: Callable[[PendingCommit], None]):
        self._commit = commit
        self._finish = finish
        """Waits for and commits ``commit`` if it is still the checkpointer's save in flight."""
        self.path = commit.location.ref(iteration_dirname(commit.iteration))
        """Where it is committed (it does not exist before): a path, or a URL."""

    def done(self) -> bool:
        """Committed or failed (this rank's view; no collective)."""
        return self._commit.committed or self._commit.error is not None

    def result(self) -> Path | str:
        if not self.done():
            self._finish(self._commit)
        if self._commit.error is not None:
            raise self._commit.error
        if not self._commit.committed:
            raise CheckpointError(f"the async save of iteration {self._commit.iteration} was never committed")
        return self.path


def _save_location(save_dir: str | os.PathLike[str] | Location) -> Location:
    """The location a save goes to; an unsupported URL is refused (on every rank) before anything is written."""
    try:
        return locate(save_dir, "save directory").absolute()
    except CheckpointError as e:
        refused = CheckpointFormatError(f"{e}; nothing was written")
        refused.every_rank = True
        raise refused from None


class Saves:
    """The saves of one checkpointer (see the module docstring)."""

    def __init__(self, parts: RankParts):
        self.parts = parts
        self.comm = parts.comm
        self.pending: PendingCommit | None = None
        """The async save in flight (written in the background, or committing)."""
        self.last: PendingCommit | None = None
        """The latest save (its handle's state)."""
        self.async_pg: dist.ProcessGroup | None = None
        self.host_buffers: dict[str, GlobalTensor] = {}
        """Host copies of the last async save's mutable tensors, reused by the next one."""
        self.locks: dict[Location, Held] = {}
        """Save locations this checkpointer locked (rank 0 only), held until :meth:`close`."""
        self.worker: ThreadPoolExecutor | None = None
        """The thread deferred async saves run in (started by the first, ended by :meth:`close`)."""

    def save(self, save_dir: str | os.PathLike[str], iteration: int, objects: Mapping[str, Any],
             options: SaveOptions, args: Mapping[str, Any]) -> Path | str:
        """Steps:
            1. Build this rank's entries; with ``trainable_only`` filter the model sections (this refuses a
               non-``torch_dist`` format before anything is written). Every rank's pieces must tile each
               tensor exactly once (:func:`~peftckpt.checkpoint.checks.integrity.plan_problems`), or nothing
               is written.
            2. Rank 0 locks the location (one run at a time) and cleans what interrupted saves left
               (:func:`~peftckpt.checkpoint.location.protocol.clean`); all ranks agree on where this save writes.
            3. Every rank writes its shards (DCP, or one legacy file per model-parallel rank).
            4. Every rank checksums its own files and hands them to the location; rank 0 gathers them with the
               key records and checks that the checkpoint is whole (:mod:`~peftckpt.checkpoint.commit`).
            5. Rank 0 commits it (the manifest last, then the tracker), then applies retention, which never
               deletes the checkpoint just committed. An async save runs steps 4-5 in its own thread.
        """
        location = _save_location(save_dir)
        self.wait()  # at most one save in flight; an earlier async failure surfaces here
        fmt = storage_format(options.ckpt_format, "SaveOptions.ckpt_format")
        commit = self._commit_record(location, iteration, options, args)
        objects, object_names = self._objects(objects)
        if options.async_save and options.defer_snapshot and fmt.writes_async:
            return self._save_in_background(commit, objects, object_names, fmt)
        # 1.
        flat = self._entries(commit, objects, object_names, fmt, self.comm, self.last)
        # 2.
        commit.target = self._begin(location, iteration, self.comm)
        # 3.
        p = self.parts
        error: BaseException | None = None
        try:
            commit.written = fmt.write(WriteJob(
                flat, commit.staging, iteration, options, p.rank, p.coords, p.layout, self.comm.group, p.chunks,
                p.optimizer, self.host_buffers, self._async_group, self._after_write(commit), commit.plans,
                stream_to=commit.location.stream_to(commit.target, p.rank)))
            self.pending = commit if commit.written.future is not None else None
        except BaseException as e:  # noqa: BLE001 - reported collectively below
            error = unwrap_dcp_error(e)
            self.pending = None
        try:
            self.comm.agree(error, f"saving iteration {iteration} to {location.text} failed")
        except BaseException:  # this rank's write, or another's, failed: the save is abandoned
            protocol.unclaim(location, commit.target.name)
            protocol.unclaim(location, commit.target.local.name)
            raise
        finally:
            if commit.written.release is not None:
                commit.written.release.set()  # the background write may start
        # 4. + 5. (an async save commits in its own thread, see _after_write)
        self.last = commit
        if self.pending is None:
            commit_checkpoint(self.comm, commit)
        return location.ref(iteration_dirname(iteration))

    def _save_in_background(self, commit: PendingCommit, objects: dict[str, Any], object_names: list[str],
                            fmt: StorageFormat) -> Path | str:
        """A deferred async save (``SaveOptions(defer_snapshot=True)``): the call takes only what training may
        change before the optimizer step -- the objects, the RNG state, the model's buffers, the version of
        every tensor the step updates (:func:`~peftckpt.checkpoint.snapshot.take_call_state`) -- and returns.
        Steps 1-5 run in the save's own thread, their collectives on its own group: the entries are built and
        copied to host memory before :meth:`snapshot_fence` returns, then written and committed."""
        p = self.parts
        last = self.last
        group = self._async_group()  # (created here: a new group is a collective of the main thread's)
        objects = copy.deepcopy(objects)  # as they are now: the caller may change them once the call returns
        call = take_call_state(p.chunks, p.optimizer)
        rng = take_rng() if commit.options.save_rng else None
        after_write = self._after_write(commit)
        taken = threading.Event()
        commit.written = Written(snapshot_taken=taken)

        def save() -> None:
            try:
                comm = Collectives(group)
                flat = with_buffers_at_call(self._entries(commit, objects, object_names, fmt, comm, last, rng), call)
                commit.target = self._begin(commit.location, commit.iteration, comm)
                unchanged = unchanged_since_call(flat, call, "Checkpointer.snapshot_fence()")

                def on_snapshot() -> None:  # what was copied must be what the call saw; then the fence opens
                    try:
                        unchanged()
                    finally:
                        taken.set()

                with paused_gc():
                    written = fmt.write(WriteJob(
                        flat, commit.staging, commit.iteration, commit.options, p.rank, p.coords, p.layout, comm.group,
                        p.chunks, p.optimizer, self.host_buffers, plans=commit.plans, on_snapshot=on_snapshot,
                        stream_to=commit.location.stream_to(commit.target, p.rank)))
                    commit.written.checksums, commit.written.metadata = written.checksums, written.metadata
                    after_write()
            finally:
                taken.set()  # (a failure before the copy must not hold the fence)

        if self.worker is None:  # one thread for every deferred save (starting one per save blocked ~1 ms)
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peftckpt-async-save",
                                             initializer=one_core)  # (its torch work on one core: background.py)
        commit.written.future = self.worker.submit(save)
        self.pending = self.last = commit
        return commit.location.ref(iteration_dirname(commit.iteration))

    def _after_write(self, commit: PendingCommit) -> Callable[[], None]:
        """What an async save's thread does once this rank's files are written: hand them over (a store uploads
        them), then commit -- the commit's collectives on the background save's own group, so training never waits
        for the manifest, the fsyncs and the rename (an async save of the legacy format is committed by
        :meth:`save`)."""
        def after_write() -> None:
            hand_over_files(commit, self.parts.rank)
            commit_checkpoint(Collectives(self.async_pg), commit)
        return after_write

    def _commit_record(self, location: Location, iteration: int, options: SaveOptions,
                       args: Mapping[str, Any]) -> PendingCommit:
        """The record of the save about to start; step 1 fills in its entries' records, step 2 its target."""
        p = self.parts
        return PendingCommit(location=location, target=SaveTarget(iteration, "", Path()), options=options,
                             kept={}, excluded={}, plans=PlanMemo(({}, [])), sections=[], fingerprint=None,
                             layout=p.layout, coords=p.coords, model_config=p.model_config,
                             adapter_config=p.adapter_config, args=dict(args))

    def _objects(self, objects: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """The caller's objects and the checkpointer's states (their state as of now), and their section names."""
        p = self.parts
        clash = sorted(set(objects) & set(p.states))
        if clash:
            raise ValueError(f"objects {clash} have the names of the checkpointer's states")
        names = list(objects) + [f"{STATES}.{name}" for name in p.states]
        return {**objects, **{state_key(name, p.rank): obj.state_dict() for name, obj in p.states.items()}}, names

    def _entries(self, commit: PendingCommit, objects: dict[str, Any], object_names: list[str], fmt: StorageFormat,
                 comm: Collectives, last: PendingCommit | None, rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """Save step 1 (collective over ``comm``): this rank's entries, their records filled into ``commit``,
        refused on every rank -- before anything is written -- unless every rank's pieces tile each tensor
        exactly once. ``last``: the previous save, whose plans are reused where the layout is the same; ``rng``:
        the RNG state taken at the call (else it is taken now)."""
        p = self.parts
        options = commit.options
        error: BaseException | None = None
        flat: dict[str, Any] = {}
        held: dict[str, dict[str, Any]] = {}
        try:
            if p.states and not fmt.holds_states:
                raise CheckpointFormatError(f"the checkpointer's states ({', '.join(p.states)}) need "
                                            f"ckpt_format {TORCH_DIST!r}, not {options.ckpt_format!r}")
            if options.trainable_only and not fmt.holds_trainable_only:  # the format may change after parsing
                raise CheckpointFormatError(
                    f"SaveOptions(trainable_only=True) needs ckpt_format 'torch_dist', but this save would use "
                    f"{fmt.name!r} (legacy torch checkpoints lose requires_grad, so every tensor would be "
                    "dropped); nothing was written")
            held = p.model_sections()
            state = p.build(options.trainable_only, options.save_optim, objects, options.save_rng, held, rng)
            flat, commit.kept, commit.excluded = state.entries, state.kept, state.excluded
            commit.fingerprint = p.fingerprint() if options.trainable_only else None
            commit.base_sums = p.base_sums
        except CheckpointError as e:
            error = e
        comm.agree(error)
        plans = commit.plans = self._plans(flat, fmt, comm, last)
        if not plans.planned:  # a layout not saved (and committed) just before: the ranks' pieces are checked
            plans.planned = comm.gather(plans.layout[0])
            problems = plan_problems(plans.planned)
            if problems:  # the same on every rank
                refused = CheckpointIntegrityError(f"saving iteration {commit.iteration} to {commit.where}: the "
                                                   "ranks' pieces would not make a whole checkpoint, so nothing was "
                                                   "written:\n  " + "\n  ".join(problems))
                refused.every_rank = True
                raise refused
            if options.trainable_only:
                trainable = any(v.requires_grad for sec in held.values() for v in sec.values()
                                if isinstance(v, GlobalTensor))
                if not any(comm.gather(trainable)) and p.rank == 0:
                    warnings.warn("SaveOptions(trainable_only=True): no model parameter is trainable, so this "
                                  "checkpoint holds no model parameters (buffers only, if any)", stacklevel=4)
        commit.sections = model_section_names(len(p.chunks)) + (
            [OPTIMIZER] if options.save_optim and p.optimizer is not None else []) + (
            [RNG_STATE] if options.save_rng else []) + object_names
        return flat

    @staticmethod
    def _plans(flat: dict[str, Any], fmt: StorageFormat, comm: Collectives, last: PendingCommit | None) -> PlanMemo:
        """The last save's plan memo if every rank's entries are laid out as they were in it and it committed
        (collective), else an empty one for this save (:mod:`~peftckpt.checkpoint.storage.plan_memo`)."""
        layout = layout_of(flat)
        same = (last is not None and last.committed and last.error is None and last.options.ckpt_format == fmt.name
                and last.plans.layout == layout)
        if comm.all_true(same):
            assert last is not None
            return last.plans
        return PlanMemo(layout)

    def _begin(self, location: Location, iteration: int, comm: Collectives) -> SaveTarget:
        """Save step 2 (collective): rank 0 locks the location and cleans what interrupted saves left; all ranks
        get where this save writes."""
        target: SaveTarget | None = None
        error: BaseException | None = None
        if self.parts.rank == 0:
            try:
                self.lock(location)  # no other live run saves here: what is left is stale ...
                location.check_held()  # ... as long as this run still holds the location
                protocol.clean(location)
                target = location.begin_save(iteration, secrets.token_hex(6))
                protocol.claim(location, target.name)
                protocol.claim(location, target.local.name)  # on a store, its node-local spool too
            except (CheckpointError, OSError) as e:
                error = e
        comm.agree(error, f"saving iteration {iteration} to {location.text} failed")
        target = comm.broadcast_from_first(target)
        assert target is not None
        if not target.local.is_dir():  # another host's ranks: their own node-local staging
            target.local.mkdir(parents=True, exist_ok=True)
        comm.barrier()
        return target

    def _async_group(self) -> dist.ProcessGroup | None:
        """A gloo group of its own for the background save, so it never interleaves with training traffic."""
        if not self.comm.distributed:
            return None
        if self.async_pg is None:
            if self.comm.group is None:
                self.async_pg = dist.new_group(backend="gloo")
            else:  # only the group's ranks create it
                self.async_pg = dist.new_group(dist.get_process_group_ranks(self.comm.group), backend="gloo",
                                               use_local_synchronization=True)
        return self.async_pg

    def async_save(self, save_dir: str | os.PathLike[str], iteration: int, objects: Mapping[str, Any],
                   options: SaveOptions, args: Mapping[str, Any]) -> PendingSave:
        self.save(save_dir, iteration, objects, replace(options, async_save=True), args)
        assert self.last is not None
        return PendingSave(self.last, lambda c: self.wait() if self.pending is c else None)

    def poll(self) -> bool:
        """Commit the in-flight async save if every rank finished writing it (collective). True if committed."""
        if self.pending is None:
            return False
        future = self.pending.written.future
        if not self.comm.all_true(future is not None and future.done()):
            return False
        self.wait()
        return True

    def wait(self) -> None:
        """Wait for the in-flight async save and commit it (collective); its failure is raised here."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        error: BaseException | None = None
        try:
            assert pending.written.future is not None
            pending.written.future.result()
        except BaseException as e:  # noqa: BLE001
            error = unwrap_dcp_error(e)
        try:
            if getattr(error, "every_rank", False):  # the background commit's own agreed error: as it is
                self.comm.agree(error)
            self.comm.agree(error, f"async save of iteration {pending.iteration} to {pending.where} failed")
            if not pending.committed:
                commit_checkpoint(self.comm, pending)
        except BaseException as e:
            pending.error = e
            protocol.unclaim(pending.location, pending.target.name)
            protocol.unclaim(pending.location, pending.target.local.name)
            raise

    def snapshot_fence(self) -> None:
        pending = self.pending
        if pending is not None and pending.written.snapshot_taken is not None:
            pending.written.snapshot_taken.wait()

    def lock(self, save_dir: str | os.PathLike[str] | Location) -> None:
        location = _save_location(save_dir)
        if self.parts.rank == 0 and location not in self.locks:
            self.locks[location] = location.lock()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for held in self.locks.values():
                held.release()
            self.locks.clear()
            self.host_buffers = {}
            if self.worker is not None:
                self.worker.shutdown(wait=False)  # (idle: wait() above finished its save)
                self.worker = None
            if self.async_pg is not None:
                dist.destroy_process_group(self.async_pg)
                self.async_pg = None
