"""The checkpointer's collectives, all on one explicit process group (by default the whole job).

Every rank of the group calls each of them in the same order. :meth:`Collectives.agree` is how a step that
may fail on some ranks ends: every rank learns whether any failed, so none is left waiting in the next
collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from .errors import CheckpointError

__all__ = ["Collectives"]

T = TypeVar("T")


def _host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group`` if its backend has gloo (``gloo``, ``cpu:gloo,cuda:nccl``), else a new gloo group of the same
    ranks (collective over them)."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    if group is None:
        return dist.new_group(backend="gloo")
    return dist.new_group(dist.get_process_group_ranks(group), backend="gloo", use_local_synchronization=True)


class Collectives:
    """``rank``/``world`` within ``group`` and the few collectives a checkpoint needs (no-ops in one process)."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.distributed = dist.is_available() and dist.is_initialized()
        if group is not None and not self.distributed:
            raise ValueError("process_group was given but torch.distributed is not initialised")
        self.group = _host_group(group) if self.distributed else group
        """``group``, or where its backend cannot move CPU tensors and objects (NCCL alone), a gloo group of its
        ranks: what a checkpoint exchanges lives in host memory."""
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_from_first(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, group_src=0, group=self.group)
        return holder[0]

    def first_answers(self, ask: Callable[[], T]) -> T:
        """``ask()`` run by rank 0 alone, its answer on every rank; a :class:`CheckpointError` it raises is raised
        on every rank with its type (and said once: ``every_rank``)."""
        answer: T | CheckpointError | None = None
        if self.rank == 0:
            try:
                answer = ask()
            except CheckpointError as e:
                answer = e
        answer = self.broadcast_from_first(answer)
        if isinstance(answer, CheckpointError):
            answer.every_rank = True
            raise answer
        return cast(T, answer)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank."""
        value = torch.tensor([1 if flag else 0])
        if self.distributed:
            dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(int(value))

    def agree(self, error: BaseException | None, context: str | None = None, outcome: str | None = None) -> None:
        """Raise on every rank if any rank failed (never leaves a rank waiting in a collective).

        With ``context`` (a save step), any failure becomes a :class:`CheckpointError` that says what the
        failure left committed: the failing rank's ``outcome``, by default that nothing was; otherwise this
        rank's own error is re-raised, and a rank that did not fail raises one naming the rank that did."""
        reports = self.gather(None if error is None else (f"{type(error).__name__}: {error}", outcome))
        failed = [(r, e) for r, e in enumerate(reports) if e is not None]
        if not failed:
            return
        rank, (message, said) = failed[0]
        if context is not None:
            said = said or "nothing was committed: the previously committed checkpoint and the tracker are unchanged"
            agreed = CheckpointError(f"{context} (rank {rank}: {message}); {said}")
            agreed.every_rank = True
            raise agreed from error
        # Every rank raises, so the error is marked said-by-one: the lowest failing rank's own error on that
        # rank and on every rank that failed alike; elsewhere one naming that rank.
        raised = error if error is not None else CheckpointError(f"rank {rank} failed: {message}")
        with contextlib.suppress(AttributeError):  # an exception type with __slots__ cannot take the mark
            raised.every_rank = True  # type: ignore[attr-defined]
        raise raised
