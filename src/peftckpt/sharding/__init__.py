"""What a checkpoint entry is: global tensors made of local pieces, fused-layout declarations (no I/O).

Names are imported on first use (see :mod:`peftckpt._lazy`)."""

# ruff: noqa: F401 -- the TYPE_CHECKING imports re-export the lazy names to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .entries import GlobalTensor, Piece, global_tensor_of
    from .layout import FUSED_LAYOUTS_ATTR, FusedChunks, declare_fused, fused_layouts, to_canonical

_EXPORTS = {
    "GlobalTensor": ".entries", "Piece": ".entries", "global_tensor_of": ".entries",
    "FUSED_LAYOUTS_ATTR": ".layout", "FusedChunks": ".layout", "declare_fused": ".layout",
    "fused_layouts": ".layout", "to_canonical": ".layout",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
