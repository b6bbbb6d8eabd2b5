"""Hugging Face interop: Llama base import/export (merged), PEFT LoRA adapter export/import.

Names are imported on first use (see :mod:`peftckpt._lazy`)."""

# ruff: noqa: F401 -- the TYPE_CHECKING imports re-export the lazy names to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .commands import export_hf, export_peft, import_hf, import_peft
    from .hf_dir import HFModelDir, is_hf_dir
    from .hf_llama import InteropError, config_from_hf, config_to_hf
    from .peft import adapter_to_peft, peft_to_adapter

_EXPORTS = {
    "export_hf": ".commands", "export_peft": ".commands", "import_hf": ".commands",
    "import_peft": ".commands", "HFModelDir": ".hf_dir", "is_hf_dir": ".hf_dir", "InteropError": ".hf_llama",
    "config_from_hf": ".hf_llama", "config_to_hf": ".hf_llama", "adapter_to_peft": ".peft",
    "peft_to_adapter": ".peft",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
