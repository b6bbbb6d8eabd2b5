"""Hugging Face interop: Llama base import/export (merged), PEFT LoRA adapter export/import."""

from .commands import export_hf, export_peft, import_hf, import_peft
from .hf_llama import InteropError, config_from_hf, config_to_hf, gpt_to_hf, hf_to_gpt
from .peft import adapter_to_peft, peft_to_adapter

__all__ = ["export_hf", "export_peft", "import_hf", "import_peft", "InteropError", "config_from_hf", "config_to_hf",
           "gpt_to_hf", "hf_to_gpt", "adapter_to_peft", "peft_to_adapter"]
