"""Async saves: the host snapshot of what training may touch while the background write runs.

Training is blocked only for :func:`host_copy` (or, with a deferred snapshot, for :func:`take_call_state`: the
entries are then built and copied in the save's own thread); DCP plans and writes in a thread of its own, and the
checkpoint is committed once every rank finished writing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..sharding.entries import GlobalTensor, Piece
from .errors import CheckpointError
from .state.sections import MODEL, ensure_optimizer_state

__all__ = ["host_copy", "CallState", "take_call_state", "with_buffers_at_call", "unchanged_since_call"]


def host_copy(flat: Mapping[str, Any], previous: Mapping[str, GlobalTensor]
              ) -> tuple[dict[str, Any], dict[str, GlobalTensor], Callable[[], None]]:
    """The entries of an async save, safe to write while training goes on; the host buffers they use; and a
    check to run once they are written.

    Tensors training updates in place (trainable parameters, optimizer state, buffers) are copied into host
    buffers, reusing ``previous`` ones (the last async save's, free again: at most one save is in flight;
    they stay allocated between saves, the size of the copied state). Frozen parameters are written from
    live memory -- training never writes to them, and with a frozen base they are most of the bytes -- and
    the check raises if any of them was modified in place before the write ended (the save is then
    discarded, the previous checkpoint kept). Other values are deep-copied."""
    buffers = {k: v.snapshot(previous.get(k)) for k, v in flat.items() if isinstance(v, GlobalTensor) and not v.frozen}
    state = {k: v if isinstance(v, GlobalTensor) and v.frozen else
             buffers[k] if isinstance(v, GlobalTensor) else copy.deepcopy(v) for k, v in flat.items()}
    check_frozen_unchanged = _unmodified(
        flat, frozen=True, says=lambda count, names: (
            f"{count} frozen parameter(s) were modified in place while an async save was writing them ({names}): "
            "the save is discarded. Keep frozen weights unchanged (e.g. merge_lora) until Checkpointer.wait() "
            "returns"))
    return state, buffers, check_frozen_unchanged


def _unmodified(flat: Mapping[str, Any], frozen: bool, says: Callable[[int, str], str]) -> Callable[[], None]:
    """A check that no piece of the (``frozen`` or not) tensor entries of ``flat`` was modified in place since
    this call (their version counters); it raises :class:`CheckpointError` with ``says(count, names)``."""
    versions = [(k, p.tensor, p.tensor._version) for k, v in flat.items() if isinstance(v, GlobalTensor)
                and v.frozen == frozen for p in v.pieces]

    def check() -> None:
        changed = sorted({k for k, t, version in versions if t._version != version})
        if changed:
            raise CheckpointError(says(len(changed), f"{', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}"))

    return check


@dataclass
class CallState:
    """What a deferred snapshot (:attr:`~peftckpt.checkpoint.options.SaveOptions.defer_snapshot`) takes before the
    save call returns, so that entries built later in the save's thread still save the state of the call: the
    model's buffers, copied (a forward pass may update them: running statistics, counters; they are small), and
    the version counter of every tensor training updates in place (trainable parameters, optimizer state). The
    parameters and the optimizer state change only at the optimizer step, which waits for the copy
    (:meth:`~peftckpt.checkpoint.api.Checkpointer.snapshot_fence`).

    Only the live tensors are recorded at the call; their storage addresses -- by which the save's thread matches
    them to its entries' pieces (views share their base's storage) -- are looked up there, off the training
    thread. Holding the live tensors keeps those addresses theirs until the save ends."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    """``(live buffer, its copy)`` for each buffer of the model."""
    updated: list[tuple[torch.Tensor, int]]
    """``(live tensor, its version counter)`` for each tensor the optimizer step updates (its parameters --
    without an optimizer, every trainable parameter -- and its state)."""

    def buffer_copies(self) -> dict[tuple[int, int, tuple[int, ...]], torch.Tensor]:
        """The buffers' copies by ``(storage address, storage offset, shape)`` of the live tensor."""
        return {_key(live): copied for live, copied in self.buffers}

    def versions(self) -> dict[int, int]:
        """The version counters at the call by storage address."""
        return {live.untyped_storage().data_ptr(): version for live, version in self.updated}


def _key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t



def take_call_state(chunks: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None) -> CallState:
    """The :class:`CallState` of a deferred snapshot, taken in the save call (one walk over the parameters and
    buffers, no entry built, no storage looked up)."""
    buffers = []
    for chunk in chunks:
        for b in chunk.buffers():
            live = _local(b).detach()
            buffers.append((live, live.clone()))
    # What the optimizer step updates: its parameters and its state (without one, every trainable parameter).
    params: list[torch.Tensor]
    if optimizer is None:
        params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    else:
        ensure_optimizer_state(optimizer)  # (created now, as a save without a step creates them)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        params += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    updated = []
    for t in params:
        live = t._local_tensor if isinstance(t, DTensor) else t
        updated.append((live, live._version))
    return CallState(buffers, updated)


def _is_buffer(key: str, v: GlobalTensor) -> bool:
    return key.startswith(MODEL + ".") and not v.frozen and not v.requires_grad


def with_buffers_at_call(flat: dict[str, Any], call: CallState) -> dict[str, Any]:
    """``flat`` with the pieces of the model's buffers replaced by their copies taken at the call."""
    copies = call.buffer_copies()
    for key, v in flat.items():
        if isinstance(v, GlobalTensor) and _is_buffer(key, v):
            flat[key] = GlobalTensor(v.global_shape, v.dtype, [Piece(p.offsets, copies.get(_key(p.tensor), p.tensor))
                                                                for p in v.pieces], v.requires_grad, v.replicated)
    return flat


def unchanged_since_call(flat: Mapping[str, Any], call: CallState, fence: str) -> Callable[[], None]:
    """A check, to run once a deferred snapshot is copied, that no tensor training updates (trainable
    parameters, optimizer state) of ``flat`` was modified in place since the call: else the copy may mix two
    steps, and the save is discarded with an error that says what to call first (``fence``)."""
    versions = call.versions()
    pieces = [(k, p.tensor, versions.get(p.tensor.untyped_storage().data_ptr()))
              for k, v in flat.items() if isinstance(v, GlobalTensor) and not v.frozen and not _is_buffer(k, v)
              for p in v.pieces]

    def check() -> None:
        changed = sorted({k for k, t, version in pieces if version is not None and t._version != version})
        if changed:
            raise CheckpointError(
                f"{len(changed)} tensor(s) were modified in place before an async save had copied them "
                f"({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}): the save is discarded. Call "
                f"{fence} before the optimizer step (or anything else that changes them)")

    return check
