"""The peers our checkpoints are measured against, each saving and loading the same adapter.

* plain DCP: ``get_state_dict(..., ignore_frozen_params=True)`` + ``dcp.save`` / ``dcp.load`` +
  ``set_state_dict`` (what a user of torch.distributed.checkpoint writes by hand);
* ``torch.save`` of the filtered state dict (trainable model entries + ``optimizer.state_dict()``), single
  process, with and without an fsync of the file;
* HF PEFT ``save_pretrained`` / ``PeftModel.from_pretrained`` on an HF Llama of the same dimensions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from _timing import fsync_paths
from peftckpt.checkpoint.storage.durable import fsync_dir

__all__ = ["PlainDCP", "TorchSave", "HFPeft", "HF_TARGETS", "hf_available"]


class PlainDCP:
    """Adapter + optimizer through DCP's own state-dict API, as its docs show."""

    def __init__(self, chunks: Sequence[nn.Module], optimizer: torch.optim.Optimizer, with_optim: bool = True):
        self.module: nn.Module = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        self.optimizer = optimizer
        self.with_optim = with_optim
        self.options = StateDictOptions(ignore_frozen_params=True)

    def _state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd} if self.with_optim else {"model": model_sd}

    def save(self, path: Path) -> None:
        dcp.save(self._state(), checkpoint_id=str(path))

    def load(self, path: Path) -> None:
        state = self._state()
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state.get("optim", {}),
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))


class TorchSave:
    """One ``torch.save`` file of the trainable model entries and the optimizer (single process only)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}

    def _state(self) -> dict[str, Any]:
        model_sd = {k: v for k, v in self.model.state_dict().items() if k in self.trainable}
        return {"model": model_sd, "optimizer": self.optimizer.state_dict()}

    def save(self, path: Path, fsync: bool) -> None:
        with open(path, "wb") as f:
            torch.save(self._state(), f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        if fsync:
            fsync_dir(path.parent)  # the directory entry of the new file

    def load(self, path: Path) -> None:
        state = torch.load(path, weights_only=True)
        self.model.load_state_dict(state["model"], strict=False)
        self.optimizer.load_state_dict(state["optimizer"])


# Our LoRA targets -> HF Llama module names (a fused target maps to the parts it fuses: not the same
# adapter, which the report says).
HF_TARGETS: dict[str, tuple[str, ...]] = {
    "linear_q": ("q_proj",), "linear_k": ("k_proj",), "linear_v": ("v_proj",), "linear_proj": ("o_proj",),
    "linear_fc1_gate": ("gate_proj",), "linear_fc1_up": ("up_proj",), "linear_fc2": ("down_proj",),
    "linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_fc1": ("gate_proj", "up_proj"),
}


def hf_available() -> bool:
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


class HFPeft:
    """An HF ``LlamaForCausalLM`` of the same dimensions with the same LoRA, via PEFT.

    The base is built on the meta device and given uninitialised CPU storage (``to_empty``): its values
    play no part in an adapter save or load, and untouched pages cost neither time nor resident memory.
    """

    def __init__(self, model_config: dict[str, Any], lora: dict[str, Any]):
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig

        c = model_config
        self.config = LlamaConfig(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["ffn_hidden_size"],
            num_hidden_layers=c["num_layers"], num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c["num_query_groups"], max_position_embeddings=c["max_position_embeddings"],
            rms_norm_eps=c["norm_epsilon"], tie_word_embeddings=not c["untie_embeddings_and_output_weights"],
        )
        targets = sorted({t for name in lora["target_modules"] for t in HF_TARGETS[name]})
        self.same_adapter = all(len(HF_TARGETS[name]) == 1 for name in lora["target_modules"])
        self.lora_config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                      target_modules=targets, layers_to_transform=lora["layers"])
        self.model = get_peft_model(self.base(), self.lora_config)

    def base(self) -> nn.Module:
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(self.config)
        return model.to_empty(device="cpu")

    @property
    def adapter_numel(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def save(self, path: Path, fsync: bool) -> None:
        self.model.save_pretrained(str(path))
        if fsync:
            fsync_paths([p for p in path.rglob("*") if p.is_file()])

    def load(self, path: Path, base: nn.Module) -> nn.Module:
        from peft import PeftModel

        return PeftModel.from_pretrained(base, str(path))
