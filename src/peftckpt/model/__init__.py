"""The GPT decoder and LoRA (no file I/O here)."""

from .config import ALL_LORA_TARGETS, LORA_PART_TARGETS, LORA_TARGETS, GPTConfig, LoRAConfig
from .deferred import ShardedInit, init_parameters, materialize
from .fused import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv
from .gpt import GPTModel, TransformerLayer, gpt_loss, param_generator
from .linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from .lora import apply_lora, cast_frozen, freeze, merge_lora, trainable_names, unmerge_lora

__all__ = [
    "ALL_LORA_TARGETS", "LORA_PART_TARGETS", "LORA_TARGETS", "GPTConfig", "LoRAConfig",
    "fuse_gate_up", "fuse_qkv", "split_gate_up", "split_qkv",
    "GPTModel", "TransformerLayer", "gpt_loss", "param_generator",
    "ColumnParallelLinear", "ParallelLinear", "RowParallelLinear",
    "apply_lora", "cast_frozen", "freeze", "merge_lora", "trainable_names", "unmerge_lora",
    "ShardedInit", "init_parameters", "materialize",
]
