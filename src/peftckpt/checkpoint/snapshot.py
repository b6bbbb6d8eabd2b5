"""Async saves: the host snapshot of what training may touch while the background write runs.

Training is blocked only for :func:`host_copy` (or, with a deferred snapshot, for :func:`take_call_state`: the
entries are then built and copied in the save's own thread); DCP plans and writes in a thread of its own, and the
checkpoint is committed once every rank finished writing.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils.hooks import RemovableHandle

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
    the version counter of every parameter the optimizer step updates. The parameters and the optimizer state
    change only at that step, which waits for the copy (:meth:`~peftckpt.checkpoint.api.Checkpointer.snapshot_fence`);
    a step taken too early changes a parameter together with its state, so the parameters' counters tell it
    (the state's, three times as many tensors, are not read on the training thread).

    Only the live tensors are recorded at the call; their storage addresses -- by which the save's thread matches
    them to its entries' pieces (views share their base's storage) -- and the optimizer state of each are looked
    up there, off the training thread. Holding the live tensors keeps those addresses theirs until the save ends."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    """``(live buffer, its copy)`` for each buffer of the model."""
    updated: list[tuple[torch.Tensor, torch.Tensor, int]]
    """``(parameter, its live tensor, its version counter)`` for each parameter the optimizer step updates
    (without an optimizer, every trainable parameter)."""
    optimizer: torch.optim.Optimizer | None = None

    def buffer_copies(self) -> dict[tuple[int, int, tuple[int, ...]], torch.Tensor]:
        """The buffers' copies by ``(storage address, storage offset, shape)`` of the live tensor."""
        return {_key(live): copied for live, copied in self.buffers}

    def owners(self) -> dict[int, int]:
        """The parameter each updated storage moves with, by storage address: a parameter's own, and its
        optimizer state's."""
        out: dict[int, int] = {}
        for param, live, _ in self.updated:
            ptr = live.untyped_storage().data_ptr()
            out[ptr] = ptr
            state = self.optimizer.state.get(param, {}) if self.optimizer is not None else {}
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    out[_local(v).untyped_storage().data_ptr()] = ptr
        return out

    def moved(self) -> set[int]:
        """The storage addresses of the parameters modified in place since the call."""
        return {live.untyped_storage().data_ptr() for _, live, version in self.updated if live._version != version}


def _key(t: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t



def take_call_state(chunks: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None) -> CallState:
    """The :class:`CallState` of a deferred snapshot, taken in the save call (one walk over the parameters and
    buffers, no entry built, no storage looked up)."""
    buffers = [(live, live.clone()) for live in (_local(b).detach() for b in _buffers(chunks))]
    # What the optimizer step updates: its parameters (without one, every trainable parameter).
    params: list[torch.Tensor]
    if optimizer is None:
        params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    else:
        ensure_optimizer_state(optimizer)  # (created now, as a save without a step creates them)
        params = [p for group in optimizer.param_groups for p in group["params"]]
    lives = [_local(p) for p in params]
    return CallState(buffers, [(p, live, live._version) for p, live in zip(params, lives)], optimizer)


def _buffers(chunks: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Every buffer of ``chunks`` as it is now (``Module.to`` and the like replace buffer tensors, so they are
    looked up at every call), from module lists kept while no submodule is registered anywhere."""
    global _HOOK
    if _HOOK is None:
        _HOOK = register_module_module_registration_hook(_tree_changed)
    out: list[torch.Tensor] = []
    for chunk in chunks:
        known = _TREES.get(chunk)
        if known is None or known[0] != _TREE_CHANGES[0]:
            known = _TREES[chunk] = (_TREE_CHANGES[0], list(chunk.modules()))
        for m in known[1]:
            if m._buffers:
                out.extend(b for b in m._buffers.values() if b is not None)
    return out


_TREES: weakref.WeakKeyDictionary[nn.Module, tuple[int, list[nn.Module]]] = weakref.WeakKeyDictionary()
"""Each chunk's modules, as of the count of :data:`_TREE_CHANGES` they were listed at."""
_TREE_CHANGES = [0]
"""Submodules registered in this process since it started (counted by a global registration hook)."""
_HOOK: RemovableHandle | None = None


def _tree_changed(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
    _TREE_CHANGES[0] += 1


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
    owners = call.owners()
    pieces = [(k, owners.get(p.tensor.untyped_storage().data_ptr()))
              for k, v in flat.items() if isinstance(v, GlobalTensor) and not v.frozen and not _is_buffer(k, v)
              for p in v.pieces]

    def check() -> None:
        moved = call.moved()
        changed = sorted({k for k, owner in pieces if owner is not None and owner in moved})
        if changed:
            raise CheckpointError(
                f"{len(changed)} tensor(s) were modified in place before an async save had copied them "
                f"({', '.join(changed[:5])}{', ...' if len(changed) > 5 else ''}): the save is discarded. Call "
                f"{fence} before the optimizer step (or anything else that changes them)")

    return check
