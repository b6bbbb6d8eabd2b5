"""Async saves: the host snapshot of what training may touch while the background write runs.

Training is blocked only for :func:`host_copy` (or, with a deferred snapshot, for :func:`copy_objects`); DCP
plans and writes in a thread of its own, and the checkpoint is committed once every rank finished writing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from ..sharding.entries import GlobalTensor
from .errors import CheckpointError
from .state.sections import MODEL

__all__ = ["host_copy", "copy_objects", "unchanged_since"]


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


def copy_objects(flat: Mapping[str, Any]) -> dict[str, Any]:
    """What a deferred snapshot (:attr:`~peftckpt.checkpoint.options.SaveOptions.defer_snapshot`) takes before the
    save call returns: ``flat`` with its objects (anything not a tensor entry) deep-copied, and the model's
    buffers copied -- a forward pass may update them (running statistics, counters), and they are small; the
    parameters and the optimizer state, which change only at the optimizer step, are copied later."""
    def now(key: str, v: GlobalTensor) -> bool:
        return key.startswith(MODEL + ".") and not v.frozen and not v.requires_grad
    return {k: (v.snapshot() if now(k, v) else v) if isinstance(v, GlobalTensor) else copy.deepcopy(v)
            for k, v in flat.items()}


def unchanged_since(flat: Mapping[str, Any], fence: str) -> Callable[[], None]:
    """A check, to run once a deferred snapshot is copied, that no tensor training updates (trainable
    parameters, optimizer state, buffers) of ``flat`` was modified in place since this call: else the copy may
    mix two steps, and the save is discarded with an error that says what to call first (``fence``)."""
    return _unmodified(flat, frozen=False, says=lambda count, names: (
        f"{count} tensor(s) were modified in place before an async save had copied them ({names}): the save is "
        f"discarded. Call {fence} before the optimizer step (or anything else that changes them)"))
