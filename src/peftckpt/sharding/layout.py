"""How a module tells the checkpoint library that a parameter's TP shards are not contiguous.

A fused SwiGLU ``linear_fc1`` holds ``[gate; up]``. Sharded over TP for the matmul, rank r keeps
``[gate_r; up_r]``, so the parameter's DTensor "global" view is the rank-interleaved
``[gate_0; up_0; gate_1; up_1]`` -- a layout that changes with the TP size. A module declares such
parameters with :func:`declare_fused`; the checkpoint library then stores the TP-independent
``[gate_full; up_full]`` and maps each rank's pieces to their real global offsets (on save and load).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["FusedChunks", "FUSED_LAYOUTS_ATTR", "declare_fused", "fused_layouts", "to_canonical"]

#: Attribute (a ``dict[param_name, FusedChunks]``) a module carries to declare fused parameters.
FUSED_LAYOUTS_ATTR = "_peftckpt_fused_layouts"


@dataclass(frozen=True)
class FusedChunks:
    """Along ``dim`` the global tensor is ``num_chunks`` equal blocks; each TP shard holds its slice of each."""

    dim: int
    num_chunks: int


def declare_fused(module: nn.Module, param_name: str, layout: FusedChunks) -> None:
    """Record that ``module.<param_name>`` is TP-sharded block-wise (see module docstring)."""
    layouts: dict[str, FusedChunks] = dict(getattr(module, FUSED_LAYOUTS_ATTR, {}))
    layouts[param_name] = layout
    setattr(module, FUSED_LAYOUTS_ATTR, layouts)


def fused_layouts(root: nn.Module) -> dict[str, FusedChunks]:
    """All fused declarations under ``root``, keyed by the parameter's full state-dict name."""
    found: dict[str, FusedChunks] = {}
    for prefix, module in root.named_modules():
        # (declare_fused sets a plain attribute: read it from the instance dict, not through Module.__getattr__,
        # which raises and catches an AttributeError for every module without one)
        for name, layout in vars(module).get(FUSED_LAYOUTS_ATTR, {}).items():
            found[f"{prefix}.{name}" if prefix else name] = layout
    return found


def to_canonical(interleaved: torch.Tensor, layout: FusedChunks, tp_size: int) -> torch.Tensor:
    """Turn the rank-interleaved DTensor global view (``[gate_0; up_0; gate_1; up_1]``) into the
    canonical ``[gate_full; up_full]``."""
    if tp_size == 1 or layout.num_chunks == 1:
        return interleaved
    pieces = interleaved.chunk(tp_size * layout.num_chunks, dim=layout.dim)  # rank-major order
    ordered = [pieces[r * layout.num_chunks + c] for c in range(layout.num_chunks) for r in range(tp_size)]
    return torch.cat(ordered, dim=layout.dim)
