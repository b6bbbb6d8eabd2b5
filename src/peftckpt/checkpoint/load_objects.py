"""The objects a load reads besides tensors -- extra state, optimizer groups, the checkpointer's states, the RNG
state -- and where each goes (collective where it says so)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checks.load_checks import optimizer_state_missing
from .errors import CheckpointMismatchError
from .options import LoadOptions
from .rank_parts import RankParts
from .state.sections import (
    MODEL,
    OPTIMIZER,
    PARAM_GROUPS,
    RNG_STATE,
    apply_param_groups,
    dcp_key,
    merge_param_groups,
    restore_rng,
    state_key,
)
from .storage.manifest import Manifest

__all__ = ["WantedObjects", "objects_to_read", "apply_objects"]


@dataclass
class WantedObjects:
    """The stored objects a load reads besides tensors: all their keys, and what each is for."""

    keys: list[str]
    groups: list[str] = field(default_factory=list)
    """The optimizer's param groups, one per saving rank."""
    extra: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    """Extra state: storage key -> (chunk, its state_dict name)."""
    rng: str | None = None
    states: dict[str, str] = field(default_factory=dict)
    """The checkpointer's states: name -> storage key."""





def objects_to_read(parts: RankParts, manifest: Manifest, bytes_keys: set[str], object_keys: Sequence[str],
                     options: LoadOptions, model_only: bool, with_optim: bool, same_layout: bool, ckpt: Path
                     ) -> WantedObjects:
    """The stored objects (``bytes_keys``) a load reads besides tensors, and what each is for."""
    wanted = WantedObjects(keys=[k for k in object_keys if k in bytes_keys])
    if with_optim:
        wanted.groups = sorted(k for k in bytes_keys if k.startswith(f"{OPTIMIZER}.{PARAM_GROUPS}."))
    # Extra state (e.g. Transformer Engine's FP8 metadata) of a full checkpoint goes back through
    # `set_extra_state`; a trainable-only checkpoint never holds any.
    if not manifest.trainable_only:
        for chunk in parts.chunks:
            for name, value in chunk.state_dict(keep_vars=True).items():
                if not isinstance(value, torch.Tensor) and dcp_key(MODEL, name) in bytes_keys:
                    wanted.extra[dcp_key(MODEL, name)] = (chunk, name)
    rng_key = f"{RNG_STATE}.{parts.rank}"
    if options.load_rng and not model_only and same_layout and rng_key in bytes_keys:
        wanted.rng = rng_key
    wanted.states = {} if model_only else _state_keys(parts, ckpt, bytes_keys)
    wanted.keys += wanted.groups + list(wanted.extra) + ([wanted.rng] if wanted.rng else []) + list(
        wanted.states.values())
    return wanted

def apply_objects(parts: RankParts, ckpt: Path, objects: dict[str, Any], wanted: WantedObjects, options: LoadOptions,
                   with_optim: bool) -> None:
    """Put the read objects where they belong (taking them out of ``objects``): extra state, optimizer
    groups (collective check), the checkpointer's states, the RNG state."""
    for k, (chunk, name) in wanted.extra.items():
        chunk.load_state_dict({name: objects.pop(k)}, strict=False)
    if with_optim and parts.optimizer is not None:
        saved_groups = merge_param_groups([objects.pop(k) for k in wanted.groups])
        if not saved_groups:
            absent = [f"{OPTIMIZER}.{PARAM_GROUPS}"]
        else:
            absent = [f"{OPTIMIZER}.scalar_state.{n}" for n in
                      apply_param_groups(parts.optimizer, saved_groups, parts.chunks)]
        parts.comm.agree(optimizer_state_missing(absent, options.strictness, parts.rank, ckpt))
    for name, key in wanted.states.items():
        parts.states[name].load_state_dict(objects.pop(key))
    if wanted.rng is not None:
        restore_rng(objects.pop(wanted.rng))

def _state_keys(parts: RankParts, ckpt: Path, stored: set[str]) -> dict[str, str]:
    """The stored key each of :attr:`states` is restored from (collective): this rank's own copy, or rank
    0's when the checkpoint was saved by fewer ranks (said once). A state the checkpoint lacks is an error."""
    keys: dict[str, str] = {}
    absent = []
    for name in parts.states:
        mine, first = state_key(name, parts.rank), state_key(name, 0)
        if mine in stored or first in stored:
            keys[name] = mine if mine in stored else first
        else:
            absent.append(name)
    parts.comm.agree(CheckpointMismatchError(
        f"checkpoint {ckpt} holds no state for {', '.join(map(repr, absent))}: it was saved without them "
        "(another program, or a checkpointer without these states)") if absent else None)
    borrowed = any(parts.comm.gather(any(k != state_key(n, parts.rank) for n, k in keys.items())))
    if borrowed and parts.rank == 0:
        warnings.warn(f"checkpoint {ckpt} was saved by fewer ranks than this job: ranks without their own copy "
                      "of the checkpointer's states restore rank 0's", stacklevel=3)
    return keys

