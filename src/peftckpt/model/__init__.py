"""The GPT decoder and LoRA (no file I/O here).

Names are imported on first use (see :mod:`peftckpt._lazy`)."""

# ruff: noqa: F401 -- the TYPE_CHECKING imports re-export the lazy names to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .config import ALL_LORA_TARGETS, LORA_PART_TARGETS, LORA_TARGETS, GPTConfig, LoRAConfig
    from .deferred import ShardedInit, init_parameters, materialize
    from .fused import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
    from .gpt import GPTModel, TransformerLayer, gpt_loss, param_generator
    from .linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear
    from .lora import apply_lora, cast_frozen, freeze, merge_lora, trainable_names, unmerge_lora

_EXPORTS = {
    "ALL_LORA_TARGETS": ".config", "LORA_PART_TARGETS": ".config", "LORA_TARGETS": ".config",
    "GPTConfig": ".config", "LoRAConfig": ".config", "ShardedInit": ".deferred",
    "init_parameters": ".deferred", "materialize": ".deferred", "fuse_gate_up": ".fused",
    "fuse_qkv": ".fused", "split_gate_up": ".fused", "split_qkv": ".fused", "GPTModel": ".gpt",
    "TransformerLayer": ".gpt", "gpt_loss": ".gpt", "param_generator": ".gpt",
    "ColumnParallelLinear": ".linear", "ParallelLinear": ".linear", "RowParallelLinear": ".linear",
    "apply_lora": ".lora", "cast_frozen": ".lora", "freeze": ".lora", "merge_lora": ".lora",
    "trainable_names": ".lora", "unmerge_lora": ".lora",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
