"""One builder of a rank's checkpoint state: a save writes exactly the entries a load of the same kind requests.

:func:`build_state` gathers the model sections (trainable-only: filtered, see
:mod:`~peftckpt.checkpoint.state.trainable`), the optimizer's entries, the caller's objects, the format
version and the RNG state under their storage keys (:mod:`~peftckpt.checkpoint.state.sections`). A save writes
:attr:`RankState.entries`; a load requests :meth:`RankState.tensors` of the same build and reads the objects it
wants by key.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...sharding.entries import GlobalTensor
from .sections import (
    CHECKPOINT_VERSION,
    CHECKPOINT_VERSION_VALUE,
    MODEL,
    OPTIMIZER,
    PARAM_GROUPS,
    RNG_STATE,
    dcp_key,
    optimizer_entries,
    rng_entry,
    tensor_records,
)
from .trainable import filter_trainable

__all__ = ["RankState", "build_state"]


@dataclass
class RankState:
    entries: dict[str, Any]
    """``{storage key: entry}``: tensors (:class:`GlobalTensor`) and objects."""
    kept: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Records (shape, dtype, requires_grad) of the model tensors in it: the manifest's ``saved_keys``."""
    excluded: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Records of the frozen model tensors a trainable-only state leaves out: the manifest's ``excluded_keys``."""

    def tensors(self) -> dict[str, GlobalTensor]:
        """The tensor entries (what a load requests)."""
        return {k: v for k, v in self.entries.items() if isinstance(v, GlobalTensor)}


def build_state(sections: Mapping[str, Mapping[str, Any]], optimizer: torch.optim.Optimizer | None,
                chunks: Sequence[nn.Module], rank: int, *, trainable_only: bool, with_optim: bool,
                objects: Mapping[str, Any] | None = None, with_rng: bool = False,
                rng: dict[str, Any] | None = None) -> RankState:
    """This rank's state from its model ``sections`` (``{section: {name: entry}}``) and ``optimizer`` (over the
    parameters of ``chunks``); ``with_rng``: with the RNG state (``rng``: as :func:`take_rng` took it earlier, else
    taken now)."""
    entries: dict[str, Any] = {}
    excluded: dict[str, Any] = {}
    for section, section_entries in sections.items():
        if trainable_only:
            section_entries, frozen = filter_trainable(dict(section_entries))
            excluded.update(tensor_records({dcp_key(section, k): v for k, v in frozen.items()}))
        for k, v in section_entries.items():
            entries[dcp_key(section, k)] = v
    kept = tensor_records({k: v for k, v in entries.items() if k.startswith(MODEL + ".")})
    if with_optim and optimizer is not None:
        for k, v in optimizer_entries(optimizer, chunks).items():
            # Each rank's groups name only its own parameters: keep every rank's copy.
            entries[dcp_key(OPTIMIZER, f"{k}.{rank}" if k == PARAM_GROUPS else k)] = v
    entries.update(objects or {})
    entries[CHECKPOINT_VERSION] = CHECKPOINT_VERSION_VALUE
    if with_rng:
        entries[f"{RNG_STATE}.{rank}"] = rng_entry(rng)
    return RankState(entries, kept, excluded)
