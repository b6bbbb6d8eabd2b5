"""The legacy ``torch`` format: one ``mp_rank_XX[_YYY]/model_optim_rng.pt`` per model-parallel rank.

Tensors are the ranks' local shards from ``state_dict`` (detached: ``requires_grad`` is lost), so a
legacy checkpoint loads only at the TP/PP layout it was saved at. Data-parallel replicas do not write.
Loading uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...sharding.entries import GlobalTensor
from ..errors import CheckpointFormatError, CheckpointMismatchError
from ..state.sections import MODEL, dcp_key, model_section_names
from .manifest import Manifest

__all__ = ["rank_file", "save_rank_file", "LegacyRankFile"]

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
        raise CheckpointFormatError("ckpt_format 'torch' cannot hold a data-parallel-sharded optimizer "
                                    "(a distributed optimizer); use ckpt_format 'torch_dist'")
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


class LegacyRankFile:
    """This rank's legacy file, opened for a load at the layout it was saved at (a
    :class:`~peftckpt.checkpoint.storage.formats.StoredCheckpoint`)."""

    per_rank = True
    unindexed: list[str] = []  # (hashed whole before the read)

    def __init__(self, root: Path, manifest: Manifest, layout: Mapping[str, int], coords: Mapping[str, int]) -> None:
        saved = {k: manifest.layout.get(k, 1) for k in ("tp", "pp", "vpp")}
        now = {k: layout.get(k, 1) for k in ("tp", "pp", "vpp")}
        if saved != now:
            raise CheckpointMismatchError(
                f"legacy ckpt_format 'torch' checkpoint {root} was saved at {saved} and loads only at that layout "
                f"(this run: {now}); convert it to torch_dist to reshard (peftckpt train ... "
                "--ckpt-convert-format torch_dist)")
        self.path = rank_file(root, coords, layout)
        state = torch.load(self.path, map_location="cpu", weights_only=True)
        self._stored: dict[str, Any] = {}
        for section in model_section_names(layout.get("vpp", 1)):
            for k, v in state.pop(section, {}).items():
                self._stored[dcp_key(section, k)] = v
        self._stored.update(state)
        # Local shards: the file does not know the global shapes.
        self.tensor_shapes: dict[str, list[int] | None] = {
            k: None for k, v in self._stored.items() if isinstance(v, torch.Tensor)}
        self.object_keys = {k for k, v in self._stored.items() if not isinstance(v, torch.Tensor)}

    def read(self, request: dict[str, Any], on_piece: Callable[[str, tuple[int, ...], torch.Tensor], None] | None = None
             ) -> list[str]:
        """Copy the stored local tensors into the request's pieces and put the stored objects in it.

        A tensor was saved as the local tensor of its parameter (fused pieces concatenated in local order),
        which is exactly the order of the request's pieces. Its file was hashed before the read: no damage is
        found while reading."""
        with torch.no_grad():
            for k, entry in request.items():
                if not isinstance(entry, GlobalTensor):
                    if k in self.object_keys:
                        request[k] = self._stored[k]
                    continue
                value = self._stored[k].reshape(-1)
                offset = 0
                for p in entry.pieces:
                    n = p.tensor.numel()
                    p.tensor.copy_(value[offset:offset + n].view_as(p.tensor))
                    offset += n
        return []
