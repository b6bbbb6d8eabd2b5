"""The legacy ``torch`` format: one ``mp_rank_XX[_YYY]/model_optim_rng.pt`` per model-parallel rank.

Tensors are the ranks' local shards from ``state_dict`` (detached: ``requires_grad`` is lost), so a
legacy checkpoint loads only at the TP/PP layout it was saved at. Data-parallel replicas do not write.
Loading uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...sharding.entries import GlobalTensor
from ..checks.strictness import KeyReport, check_keys
from ..errors import CheckpointFormatError, CheckpointMismatchError
from ..options import LoadOptions, LoadResult
from ..state.sections import (
    MODEL,
    OPTIMIZER,
    PARAM_GROUPS,
    RNG_STATE,
    apply_param_groups,
    model_section_names,
    restore_rng,
)
from .manifest import Manifest

__all__ = ["rank_file", "save_rank_file", "load_legacy"]

FILENAME = "model_optim_rng.pt"


def rank_file(root: Path, coords: Mapping[str, int], layout: Mapping[str, int]) -> Path:
    name = f"mp_rank_{coords['tp']:02d}" + (f"_{coords['pp']:03d}" if layout.get("pp", 1) > 1 else "")
    return root / name / FILENAME


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def save_rank_file(staging: Path, chunks: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None,
                   coords: Mapping[str, int], layout: Mapping[str, int], flat: Mapping[str, Any],
                   save_optim: bool) -> list[Path]:
    """Write this rank's file (data-parallel rank 0 only); returns the files written."""
    if coords.get("dp", 0) != 0:
        return []
    if save_optim and optimizer is not None and layout.get("dp", 1) > 1 and any(
            isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp",)
            for g in optimizer.param_groups for p in g["params"]):
        raise CheckpointFormatError("--ckpt-format torch cannot hold a data-parallel-sharded optimizer "
                                    "(--use-distributed-optimizer); use --ckpt-format torch_dist")
    state: dict[str, Any] = {}
    for section, chunk in zip(model_section_names(len(chunks)), chunks):
        state[section] = {k: _local(v) if isinstance(v, torch.Tensor) else v
                          for k, v in chunk.state_dict(keep_vars=False).items()}
    for key, value in flat.items():
        if key.startswith(MODEL + "."):
            continue
        if isinstance(value, GlobalTensor):
            value = torch.cat([p.tensor.reshape(-1) for p in value.pieces]).clone() if len(value.pieces) > 1 \
                else value.pieces[0].tensor.clone()
        state[key] = value
    path = rank_file(staging, coords, layout)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return [path]


def load_legacy(chunks: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None, layout: Mapping[str, int],
                coords: Mapping[str, int], rank: int, root: Path, iteration: int, manifest: Manifest,
                request: dict[str, Any], options: LoadOptions, object_keys: Sequence[str],
                same_layout: bool) -> LoadResult:
    """Load this rank's legacy file into the request's live tensors (``chunks``/``optimizer`` at ``layout``,
    this rank at ``coords``)."""
    saved = {k: manifest.layout.get(k, 1) for k in ("tp", "pp", "vpp")}
    now = {k: layout.get(k, 1) for k in ("tp", "pp", "vpp")}
    if saved != now:
        raise CheckpointMismatchError(
            f"legacy --ckpt-format torch checkpoint {root} was saved at {saved} and loads only at that layout "
            f"(this run: {now}); convert it with --ckpt-convert-format torch_dist to reshard")
    path = rank_file(root, coords, layout)
    state = torch.load(path, map_location="cpu", weights_only=True)
    flat_saved: dict[str, Any] = {}
    for section in model_section_names(len(chunks)):
        for k, v in state.get(section, {}).items():
            flat_saved[f"{MODEL}.{k}"] = v
    for k, v in state.items():
        if not k.startswith(MODEL):
            flat_saved[k] = v
    report = check_keys(options.strictness, request, flat_saved.keys(), rank, source=f"checkpoint {path}")
    with torch.no_grad():
        for k, entry in request.items():
            if k in report.unexpected or not isinstance(entry, GlobalTensor):
                continue
            value = flat_saved[k]
            if len(entry.pieces) == 1:
                entry.pieces[0].tensor.copy_(value.view_as(entry.pieces[0].tensor))
            else:
                offset = 0
                for p in entry.pieces:
                    n = p.tensor.numel()
                    p.tensor.copy_(value.reshape(-1)[offset:offset + n].view_as(p.tensor))
                    offset += n
    # Model tensors were saved as the local tensor of the parameter (fused pieces concatenated in local
    # order), which is exactly the order of the pieces above.
    objects = {k: flat_saved[k] for k in object_keys if k in flat_saved}
    # The file's writer (data-parallel rank 0 of this model-parallel rank) keyed its groups by its rank.
    group_keys = [k for k in flat_saved if k.startswith(f"{OPTIMIZER}.{PARAM_GROUPS}.")]
    if options.load_optim and optimizer is not None and group_keys:
        apply_param_groups(optimizer, flat_saved[group_keys[0]], chunks)
    rng_key = f"{RNG_STATE}.{rank}"
    restored = options.load_rng and same_layout and rng_key in flat_saved
    if restored:
        restore_rng(flat_saved[rng_key])
    return LoadResult(root, iteration, manifest, objects, KeyReport(unexpected=report.unexpected), restored)
