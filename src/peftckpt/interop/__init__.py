"""Hugging Face interop: Llama base import/export (merged), PEFT LoRA adapter export/import."""

from .commands import export_hf, export_peft, import_hf, import_peft
from .hf_dir import HFModelDir, is_hf_dir
from .hf_llama import InteropError, config_from_hf, config_to_hf
from .peft import adapter_to_peft, peft_to_adapter

__all__ = ["export_hf", "export_peft", "import_hf", "import_peft", "HFModelDir", "is_hf_dir", "InteropError",
           "config_from_hf", "config_to_hf", "adapter_to_peft", "peft_to_adapter"]
