"""LoRA on the GPT: freeze the base structurally, attach adapters, merge/unmerge.

The base is frozen by clearing ``requires_grad`` on every parameter that exists *before* adapters are
attached; adapters are new parameters with ``requires_grad=True``. Which parameters are trainable is
therefore a property of the tensors, which is exactly what the checkpoint filter reads.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from .config import LORA_PART_TARGETS, LoRAConfig
from .gpt import TransformerLayer, param_generator
from .linear import ParallelLinear

__all__ = ["apply_lora", "merge_lora", "unmerge_lora", "freeze", "trainable_names", "target_linear"]


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
