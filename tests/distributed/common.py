"""Helpers shared by the multi-rank tests: tiny model flags and global (canonical) views of tensors."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from peftckpt.model.gpt import param_generator
from peftckpt.sharding.layout import fused_layouts, to_canonical

TINY = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--ffn-hidden-size", "64", "--vocab-size", "128", "--seq-length", "16", "--micro-batch-size", "2",
    "--global-batch-size", "8", "--mock-data", "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "100",
]


def global_tensor(t: torch.Tensor, name: str, chunk: torch.nn.Module, tp_size: int) -> torch.Tensor:
    """The canonical global value of a parameter-shaped tensor (collective for DTensors)."""
    full = t.full_tensor() if isinstance(t, DTensor) else t
    layout = fused_layouts(chunk).get(name)
    if layout is not None:
        full = to_canonical(full, layout, tp_size)
    return full.detach().clone()


def randomize_lora_b(trainer) -> None:  # type: ignore[no-untyped-def]
    """Give every LoRA B a deterministic non-zero value (B = 0 at init makes A's gradient vanish)."""
    tp = trainer.dims.tp
    for chunk in trainer.chunks:
        for name, p in chunk.named_parameters():
            if name.endswith("lora_B"):
                full = torch.randn(p.shape, generator=param_generator(7, name)) * 0.05
                layout = fused_layouts(chunk).get(name)
                if layout is not None and tp > 1:  # DTensor's global view: each TP rank's slice of every chunk
                    blocks = full.chunk(layout.num_chunks, dim=0)
                    full = torch.cat([torch.cat([b.chunk(tp, dim=0)[t] for b in blocks]) for t in range(tp)])
                local = full
                if isinstance(p, DTensor):  # this rank's region (TP, or TP and FSDP over DP)
                    shape, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                    local = full[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
                with torch.no_grad():
                    (p.to_local() if isinstance(p, DTensor) else p).copy_(local)


def canonical_state(trainer) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Global canonical values of every parameter and optimizer-state tensor of this rank's chunks
    (collective over TP/DP for DTensors): ``model.<name>`` and ``optimizer.<name>.<stat>``."""
    out: dict[str, torch.Tensor] = {}
    tp = trainer.dims.tp
    for chunk in trainer.chunks:
        for name, p in chunk.named_parameters():
            out[f"model.{name}"] = global_tensor(p.detach(), name, chunk, tp)
            for stat, value in trainer.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    out[f"optimizer.{name}.{stat}"] = global_tensor(value, name, chunk, tp)
                elif isinstance(value, torch.Tensor):
                    out[f"optimizer.{name}.{stat}"] = value.detach().clone()
    return out


def reports_state(trainer) -> bool:  # type: ignore[no-untyped-def]
    """Whether this rank returns results (one rank per pipeline stage)."""
    return trainer.meshes.tp_rank == 0 and trainer.meshes.dp_rank == 0


def merge_states(results: list) -> dict:  # type: ignore[type-arg]
    merged: dict = {}
    for r in results:
        if r:
            merged.update(r)
    return merged
