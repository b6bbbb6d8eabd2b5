"""LoRA on the GPT: freeze the base structurally, attach adapters, merge/unmerge.

The base is frozen by clearing ``requires_grad`` on every parameter that exists *before* adapters are
attached; adapters are new parameters with ``requires_grad=True``. Which parameters are trainable is
therefore a property of the tensors, which is exactly what the checkpoint filter reads.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .config import LORA_PART_TARGETS, LoRAConfig
from .gpt import TransformerLayer, param_generator
from .linear import ParallelLinear

__all__ = ["apply_lora", "merge_lora", "unmerge_lora", "freeze", "trainable_names", "target_linear", "cast_frozen"]


def target_linear(layer: TransformerLayer, target: str) -> ParallelLinear:
    """The linear layer of ``layer`` that a LoRA target names (a part target names its fused layer)."""
    target = LORA_PART_TARGETS.get(target, (target, ""))[0]
    owners = {
        "linear_qkv": layer.self_attention,
        "linear_proj": layer.self_attention,
        "linear_fc1": layer.mlp,
        "linear_fc2": layer.mlp,
    }
    module = getattr(owners[target], target)
    assert isinstance(module, ParallelLinear)
    return module


def freeze(module: nn.Module) -> None:
    """Clear ``requires_grad`` on every parameter of ``module``."""
    for p in module.parameters():
        p.requires_grad_(False)


def apply_lora(chunks: Iterable[nn.Module], config: LoRAConfig, seed: int) -> list[str]:
    """Freeze every parameter of ``chunks``, then attach adapters per ``config``; returns adapted module names.

    Adapter init depends only on ``(seed, module name)``, so every layout gets the same adapters.
    ``config.train_params`` re-enables training of named base parameters; a name found on no chunk
    is left for the caller to report (with pipeline parallelism it may live on another stage).
    """
    adapted: list[str] = []
    chunks = list(chunks)
    for chunk in chunks:
        freeze(chunk)
    for chunk in chunks:
        for name, module in chunk.named_modules():
            if not isinstance(module, TransformerLayer):
                continue
            if config.layers is not None and module.layer_number not in config.layers:
                continue
            for target in config.target_modules:
                layer_name, part = LORA_PART_TARGETS.get(target, (target, None))
                linear = target_linear(module, target)
                owner = "self_attention" if layer_name in ("linear_qkv", "linear_proj") else "mlp"
                full_name = f"{name}.{owner}.{layer_name}"
                a_name = f"{full_name}.lora_A" + ("" if part is None else f"_{part}")
                try:
                    linear.add_lora(config.rank, config.alpha, config.dropout, param_generator(seed, a_name),
                                    part=part)
                except ValueError as e:
                    raise ValueError(f"--lora-target-modules {target}: {e} (linear_fc1_gate / linear_fc1_up "
                                     "need --swiglu)") from None
                if full_name not in adapted:
                    adapted.append(full_name)
        params = dict(chunk.named_parameters())
        for pname in config.train_params:
            if pname in params:
                params[pname].requires_grad_(True)
    return adapted


def cast_frozen(module: nn.Module, dtype: torch.dtype) -> list[str]:
    """Store every frozen parameter (``requires_grad=False``) of ``module`` in ``dtype`` -- e.g. a bf16 base
    under fp32 adapters; trainable parameters keep theirs. Returns the names cast.

    Cheapest before the parameters have storage (a meta-device build): then nothing is converted, and the
    initialisation or checkpoint load that follows writes the values straight in ``dtype``. Parameters are
    replaced by new ones, so call it before an optimizer or FSDP holds them."""
    cast: list[str] = []
    for prefix, owner in module.named_modules():
        for name, p in list(owner._parameters.items()):
            if p is None or p.requires_grad or p.dtype == dtype:
                continue
            setattr(owner, name, nn.Parameter(p.detach().to(dtype), requires_grad=False))
            cast.append(f"{prefix}.{name}" if prefix else name)
    return cast


def merge_lora(module: nn.Module) -> None:
    """Fold every adapter under ``module`` into its base weight."""
    for m in module.modules():
        if isinstance(m, ParallelLinear):
            m.merge_lora()


def unmerge_lora(module: nn.Module) -> None:
    """Undo :func:`merge_lora`."""
    for m in module.modules():
        if isinstance(m, ParallelLinear):
            m.unmerge_lora()


def trainable_names(module: nn.Module) -> list[str]:
    """Names of the parameters with ``requires_grad=True``."""
    return [n for n, p in module.named_parameters() if p.requires_grad]
