"""The GPT decoder and LoRA (no file I/O here)."""

from .config import LORA_TARGETS, GPTConfig, LoRAConfig
from .gpt import GPTModel, TransformerLayer, gpt_loss, param_generator
from .linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from .lora import apply_lora, freeze, merge_lora, trainable_names, unmerge_lora

__all__ = [
    "LORA_TARGETS", "GPTConfig", "LoRAConfig", "GPTModel", "TransformerLayer", "gpt_loss", "param_generator",
    "ColumnParallelLinear", "ParallelLinear", "RowParallelLinear",
    "apply_lora", "freeze", "merge_lora", "trainable_names", "unmerge_lora",
]
