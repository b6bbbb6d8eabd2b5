"""``--save-trainable-params-only``: keep what training changes of the model sections, drop the frozen base.

Kept: trainable parameters and persistent buffers (running statistics and other state that is not a
parameter but may change in training: PyTorch DCP's ``ignore_frozen_params`` keeps them too). Dropped:
frozen parameters. The same filter runs on the save state dict and on the load request, so frozen
parameters are never written nor requested. The optimizer section is never filtered: it only holds state
for what the optimizer was given.
"""

from __future__ import annotations

from typing import Any

from ...sharding.entries import GlobalTensor
from ..errors import CheckpointError
from ..storage.manifest import TORCH, TORCH_DIST

__all__ = ["TORCH_DIST", "TORCH", "EXTRA_STATE_SUFFIX", "filter_trainable", "check_format_for_trainable_only"]

EXTRA_STATE_SUFFIX = "_extra_state"


def check_format_for_trainable_only(ckpt_format: str) -> None:
    """The legacy format saves detached tensors (``requires_grad`` lost): filtering would drop everything."""
    if ckpt_format != TORCH_DIST:
        raise CheckpointError(
            f"--save-trainable-params-only needs --ckpt-format torch_dist, but this save would use "
            f"{ckpt_format!r} (legacy torch checkpoints lose requires_grad, so every tensor would be dropped); "
            "nothing was written"
        )


def filter_trainable(section: dict[str, Any], ckpt_format: str) -> tuple[dict[str, Any], dict[str, GlobalTensor]]:
    """Split one model section into (kept, excluded frozen tensors).

    Kept: tensor entries with ``requires_grad=True`` -- a fused entry is one :class:`GlobalTensor` and
    goes as a whole with its owning parameter -- and buffers (tensors that are not parameters). Dropped:
    frozen parameters, every ``_extra_state`` entry (no ``requires_grad`` signal; keeping it beside a
    dropped weight would be inconsistent) and other non-tensor values. Raises for a format that cannot carry the flag (checked where the filter runs,
    because the effective format may change after argument parsing).
    """
    check_format_for_trainable_only(ckpt_format)
    kept: dict[str, Any] = {}
    excluded: dict[str, GlobalTensor] = {}
    for name, entry in section.items():
        if name.endswith(EXTRA_STATE_SUFFIX) or not isinstance(entry, GlobalTensor):
            continue
        if entry.frozen:
            excluded[name] = entry
        else:
            kept[name] = entry
    return kept, excluded
