"""State-dict section names and how a model / optimizer becomes checkpoint entries."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...sharding.entries import GlobalTensor, global_tensor_of
from ...sharding.layout import FusedChunks, fused_layouts
from ..errors import CheckpointError

__all__ = [
    "MODEL", "OPTIMIZER", "OPT_PARAM_SCHEDULER", "RNG_STATE", "ITERATION", "DATA", "ARGS", "CHECKPOINT_VERSION",
    "CHECKPOINT_VERSION_VALUE", "PARAM_GROUPS", "merge_param_groups", "apply_param_groups", "model_section_names", "model_entries", "optimizer_entries", "ensure_optimizer_state",
    "rng_entry", "take_rng", "restore_rng", "dcp_key", "STATES", "state_key",
]

MODEL = "model"
OPTIMIZER = "optimizer"
OPT_PARAM_SCHEDULER = "opt_param_scheduler"
RNG_STATE = "rng_state"
ITERATION = "iteration"
DATA = "data"
ARGS = "args"
CHECKPOINT_VERSION = "checkpoint_version"
STATES = "states"
"""Prefix of the checkpointer's states (``states.<name>.<rank>``: each rank saves its own copy)."""
PARAM_GROUPS = "param_groups"
CHECKPOINT_VERSION_VALUE = 3.0


def model_section_names(num_chunks: int) -> list[str]:
    """``["model"]``, or ``["model0", "model1", ...]`` with virtual pipeline chunks."""
    return [MODEL] if num_chunks == 1 else [f"{MODEL}{i}" for i in range(num_chunks)]


def state_key(name: str, rank: int) -> str:
    """The storage key of rank ``rank``'s copy of the state ``name``."""
    return f"{STATES}.{name}.{rank}"


def dcp_key(section: str, name: str) -> str:
    """The storage key. Every model chunk maps to ``model.<name>`` (names carry global layer numbers), so
    keys do not depend on how layers are split into pipeline or virtual stages."""
    if section.startswith(MODEL):
        section = MODEL
    return f"{section}.{name}"


def model_entries(chunk: nn.Module) -> dict[str, Any]:
    """``state_dict(keep_vars=True)`` of a chunk as entries: tensors -> :class:`GlobalTensor` (keeping
    ``requires_grad`` and the canonical layout of fused parameters), other values (extra state, and entries a
    chunk already built itself, e.g. a :class:`~peftckpt.sharding.entries.LazyGlobalTensor`) as is."""
    layouts = fused_layouts(chunk)
    out: dict[str, Any] = {}
    for name, value in chunk.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            out[name] = global_tensor_of(value, layouts.get(name))
        else:
            out[name] = value
    return out


def _param_names(chunks: Sequence[nn.Module]) -> dict[int, tuple[str, FusedChunks | None]]:
    names: dict[int, tuple[str, FusedChunks | None]] = {}
    for chunk in chunks:
        layouts = fused_layouts(chunk)
        for name, p in chunk.named_parameters():
            names[id(p)] = (name, layouts.get(name))
    return names


def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam/AdamW state (zeros, ``step = 0``) for parameters that have none yet, exactly as the
    first ``step()`` would, so a checkpoint taken before the first step has every entry to save and load."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        missing = [p for g in optimizer.param_groups for p in g["params"] if not optimizer.state.get(p)]
        if missing:
            raise CheckpointError(
                f"{type(optimizer).__name__} has no state yet for {len(missing)} parameters and peftckpt only "
                "knows how to create Adam/AdamW state; take one optimizer step before saving"
            )
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            state: dict[str, Any] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state


def optimizer_entries(optimizer: torch.optim.Optimizer, chunks: Sequence[nn.Module]) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (``state.<param>.<exp_avg|exp_avg_sq>``), so it reshards with
    its parameter; the groups' hyper-parameters and per-parameter scalar state (Adam's ``step``) as one
    object, ``param_groups`` -- a tensor entry per scalar would cost more in storage framing than its data."""
    ensure_optimizer_state(optimizer)
    names = _param_names(chunks)
    state = optimizer.state
    out: dict[str, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        params = group["params"]
        hyper = {k: v for k, v in group.items() if k != "params"}
        named = [names[id(p)] for p in params]
        hyper["param_names"] = [name for name, _ in named]
        scalars: dict[str, dict[str, Any]] = {}
        for p, (name, fused) in zip(params, named):
            own: dict[str, Any] = {}
            for stat, value in state[p].items():
                if not isinstance(value, torch.Tensor):
                    own[stat] = value
                elif value.ndim == 0 and not isinstance(value, DTensor):
                    own[stat] = float(value)
                else:  # (a state tensor shaped like its fused parameter is laid out like it)
                    out[f"state.{name}.{stat}"] = global_tensor_of(
                        value, fused if fused is not None and value.shape == p.shape else None, requires_grad=False)
            if own:
                scalars[name] = own
        hyper["scalar_state"] = scalars
        groups.append(hyper)
    out[PARAM_GROUPS] = groups
    return out


def merge_param_groups(per_rank: Sequence[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Union of the ``param_groups`` objects every rank saved (same hyper-parameters, own parameters)."""
    merged: list[dict[str, Any]] = []
    for groups in per_rank:
        for i, group in enumerate(groups):
            if i == len(merged):
                merged.append({**group, "scalar_state": dict(group.get("scalar_state", {}))})
            else:
                merged[i]["scalar_state"].update(group.get("scalar_state", {}))
    return merged


def apply_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]],
                       chunks: Sequence[nn.Module]) -> list[str]:
    """Restore the hyper-parameters (lr, betas, ...) and scalar state (``step``) saved by
    :func:`optimizer_entries`; returns the names of parameters whose scalar state the checkpoint lacks."""
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint has {len(saved)} optimizer param groups, the optimizer has "
                              f"{len(optimizer.param_groups)}; pass LoadOptions(load_optim=False) to start a fresh optimizer")
    names = _param_names(chunks)
    absent: list[str] = []
    for group, hyper in zip(optimizer.param_groups, saved):
        for k, v in hyper.items():
            if k not in ("param_names", "scalar_state"):
                group[k] = tuple(v) if isinstance(group.get(k), tuple) else v
        scalars = hyper.get("scalar_state", {})
        for p in group["params"]:
            name = names[id(p)][0]
            if name not in scalars:
                absent.append(name)
                continue
            for stat, value in scalars[name].items():
                current = optimizer.state[p].get(stat)
                if isinstance(current, torch.Tensor):
                    current.fill_(value)
                else:
                    optimizer.state[p][stat] = value
    return absent


def rng_entry(taken: dict[str, Any] | None = None) -> dict[str, Any]:
    """This rank's RNG states (or those :func:`take_rng` took earlier) as weights-only-loadable values (python,
    numpy, torch CPU, and the current CUDA device's where this process uses CUDA: each rank restores its own
    GPU's generator)."""
    raw = take_rng() if taken is None else taken
    py, np_state = raw["python"], raw["numpy"]
    return {**raw, "python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}


def take_rng() -> dict[str, Any]:
    """This rank's RNG states as the generators give them (cheap; :func:`rng_entry` makes them loadable)."""
    raw: dict[str, Any] = {"python": random.getstate(),
                           "numpy": cast(tuple[Any, ...], np.random.get_state(legacy=True)),
                           "torch": torch.get_rng_state()}
    if torch.cuda.is_initialized():  # not is_available(): that would start CUDA on every GPU for nothing
        raw["cuda"] = torch.cuda.get_rng_state()
    return raw


def restore_rng(entry: dict[str, Any]) -> None:
    py = entry["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = entry["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(entry["torch"])
    cuda = entry.get("cuda")
    if isinstance(cuda, list):  # earlier releases saved every visible GPU's: this rank's device is its own
        cuda = cuda[torch.cuda.current_device()] if torch.cuda.is_available() and cuda else None
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def tensor_records(entries: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{key: {shape, dtype, requires_grad}}`` of the tensor entries (for the manifest)."""
    return {
        k: {"shape": list(v.global_shape), "dtype": str(v.dtype).removeprefix("torch."),
            "requires_grad": v.requires_grad}
        for k, v in entries.items() if isinstance(v, GlobalTensor)
    }
