"""What a checkpoint entry is: global tensors made of local pieces, fused-layout declarations (no I/O)."""

from .entries import GlobalTensor, Piece, global_tensor_of
from .layout import FUSED_LAYOUTS_ATTR, FusedChunks, declare_fused, fused_layouts, to_canonical

__all__ = [
    "GlobalTensor", "Piece", "global_tensor_of",
    "FUSED_LAYOUTS_ATTR", "FusedChunks", "declare_fused", "fused_layouts", "to_canonical",
]
