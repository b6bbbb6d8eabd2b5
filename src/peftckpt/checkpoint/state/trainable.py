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
from ..storage.manifest import TORCH, TORCH_DIST

__all__ = ["TORCH_DIST", "TORCH", "EXTRA_STATE_SUFFIX", "filter_trainable"]

EXTRA_STATE_SUFFIX = "_extra_state"


def filter_trainable(section: dict[str, Any]) -> tuple[dict[str, Any], dict[str, GlobalTensor]]:
    """Split one model section into (kept, excluded frozen tensors).

    Kept: tensor entries with ``requires_grad=True`` -- a fused entry is one :class:`GlobalTensor` and
    goes as a whole with its owning parameter -- and buffers (tensors that are not parameters). Dropped:
    frozen parameters, every ``_extra_state`` entry (no ``requires_grad`` signal; keeping it beside a
    dropped weight would be inconsistent) and other non-tensor values.
    """
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
