"""HF PEFT LoRA adapters <-> peftckpt adapters: key names, shapes, config, exactly.

PEFT adapts HF Llama's separate projections; ours may adapt a fused layer as a whole (one A, one B over
``[q; k; v]`` rows, Megatron style) or per part (``lora_A_q`` ... , see :mod:`peftckpt.model.linear`).

* Export: a per-part adapter maps one to one. A whole-layer adapter on ``linear_qkv`` becomes q/k/v
  adapters that share its A, each with its rows of B -- ``B_q A = (B A)_q`` exactly -- and likewise
  gate/up for ``linear_fc1``.
* Import: always per part (``linear_q``, ``linear_fc1_gate``, ...), so the imported adapter is PEFT's own
  parametrisation and keeps training the way PEFT would.

PEFT's scaling is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with rsLoRA); ours is ``alpha / r``, so an
rsLoRA adapter imports with ``alpha = lora_alpha * sqrt(r)``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..model.config import LORA_PART_TARGETS, GPTConfig, LoRAConfig
from ..model.fused import split_gate_up, split_qkv
from .hf_llama import (
    HF_PROJECTIONS,
    InteropError,
    hf_module_of,
    open_safetensors,
    our_linear_of,
    read_json_object,
    read_tensor,
)
from .safetensors_io import write_safetensors

__all__ = ["PEFT_CONFIG_FILE", "PEFT_WEIGHTS_FILE", "is_adapter_name", "adapter_to_peft", "peft_to_adapter", "read_peft_dir",
           "write_peft_dir"]

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
#: our target name of each HF projection (imports are always per part).
_TARGET_OF: dict[str, str] = {
    "q_proj": "linear_q", "k_proj": "linear_k", "v_proj": "linear_v", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1_gate", "up_proj": "linear_fc1_up", "down_proj": "linear_fc2",
}
_PROJ_OF_PART = {part: proj for proj, (_, part) in HF_PROJECTIONS.items() if part is not None}


def is_adapter_name(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in ("lora_A", "lora_B") or leaf.startswith(("lora_A_", "lora_B_"))


# -------------------------------------------------------------------------------------------- export
def adapter_to_peft(tensors: Mapping[str, torch.Tensor], cfg: GPTConfig, lora: LoRAConfig,
                    base_model_name_or_path: str | None = None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Our adapter tensors (model names) -> PEFT's ``adapter_model`` tensors and ``adapter_config``."""
    others = sorted(k for k in tensors if not is_adapter_name(k))
    if others:
        raise InteropError(f"the checkpoint also trains base parameter(s) {others[:5]}, which a PEFT LoRA adapter "
                           "cannot hold; use export-hf to export the merged model")
    out: dict[str, torch.Tensor] = {}
    projections: set[str] = set()
    layers: set[int] = set()

    def put(layer: int, proj: str, a: torch.Tensor, b: torch.Tensor) -> None:
        module = _PREFIX + hf_module_of(layer, proj)
        out[f"{module}.lora_A.weight"] = a.clone()  # shared by q/k/v (gate/up): one copy each
        out[f"{module}.lora_B.weight"] = b.clone()
        projections.add(proj)
        layers.add(layer)

    for n in range(cfg.num_layers):
        for linear in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
            base = our_linear_of(n, linear)
            if f"{base}.lora_A" in tensors:
                a, b = tensors[f"{base}.lora_A"], tensors[f"{base}.lora_B"]
                if linear == "linear_qkv":
                    for proj, rows in zip(("q_proj", "k_proj", "v_proj"), split_qkv(b, cfg)):
                        put(n, proj, a, rows)
                elif linear == "linear_fc1" and cfg.swiglu:
                    for proj, rows in zip(("gate_proj", "up_proj"), split_gate_up(b, cfg)):
                        put(n, proj, a, rows)
                elif linear == "linear_fc1":
                    raise InteropError("a GELU MLP (--no-swiglu) has no HF Llama counterpart")
                else:
                    put(n, "o_proj" if linear == "linear_proj" else "down_proj", a, b)
            for part, proj in _PROJ_OF_PART.items():
                if f"{base}.lora_A_{part}" in tensors:
                    put(n, proj, tensors[f"{base}.lora_A_{part}"], tensors[f"{base}.lora_B_{part}"])
    if not out:
        raise InteropError("the checkpoint holds no LoRA adapter tensors")
    config: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
        "target_modules": sorted(projections), "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
        "inference_mode": True, "init_lora_weights": True, "modules_to_save": None,
        "layers_to_transform": None if layers == set(range(cfg.num_layers)) else sorted(layers),
        "rank_pattern": {}, "alpha_pattern": {},
    }
    return out, config


# -------------------------------------------------------------------------------------------- import
def peft_to_adapter(tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
                    cfg: GPTConfig, source: str) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """PEFT ``adapter_model`` tensors + ``adapter_config`` -> our per-part LoRA config and adapter tensors."""
    if config.get("peft_type", "LORA") != "LORA":
        raise InteropError(f"{source}: peft_type {config.get('peft_type')!r}; only LORA adapters are supported")
    refusals = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (fully trained modules)",
                "rank_pattern": "rank_pattern (per-module ranks)", "alpha_pattern": "alpha_pattern (per-module alphas)"}
    for key, what in refusals.items():
        if config.get(key):
            raise InteropError(f"{source}: {PEFT_CONFIG_FILE} sets {key}; {what} is not supported")
    if config.get("bias", "none") != "none":
        raise InteropError(f"{source}: bias = {config['bias']!r}; only bias = 'none' is supported")
    rank, alpha, dropout = _lora_numbers(config, f"{source}/{PEFT_CONFIG_FILE}")
    if config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # rsLoRA scales by alpha / sqrt(r); ours by alpha / r
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    unknown = []
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in _TARGET_OF:
            unknown.append(key)
            continue
        pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = t
    if unknown:
        raise InteropError(f"{source}: {len(unknown)} tensor(s) are not LoRA A/B of a Llama projection "
                           f"(q/k/v/o/gate/up/down_proj): {sorted(unknown)[:5]}")
    if not pairs:
        raise InteropError(f"{source}: no LoRA tensors found")
    layers = sorted({n for n, _ in pairs})
    projections = sorted({p for _, p in pairs})
    if any(n >= cfg.num_layers for n in layers):
        raise InteropError(f"{source}: adapter for layer {max(layers)}, the base has {cfg.num_layers} layers")
    holes = [f"layer {n} {p}" for n in layers for p in projections if (n, p) not in pairs]
    if holes:
        raise InteropError(f"{source}: the adapter is not the same set of projections on every adapted layer "
                           f"(missing {holes[:5]}); not supported")
    out: dict[str, torch.Tensor] = {}
    for (n, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise InteropError(f"{source}: layer {n} {proj} lacks lora_{'A' if 'A' not in ab else 'B'}")
        linear, part = HF_PROJECTIONS[proj]
        a, b = ab["A"], ab["B"]
        out_rows = {"q": cfg.num_attention_heads * cfg.head_dim, "k": cfg.groups * cfg.head_dim,
                    "v": cfg.groups * cfg.head_dim, "gate": cfg.ffn, "up": cfg.ffn, None: cfg.hidden_size}[part]
        in_cols = cfg.ffn if proj == "down_proj" else cfg.hidden_size
        if tuple(a.shape) != (rank, in_cols) or tuple(b.shape) != (out_rows, rank):
            raise InteropError(f"{source}: layer {n} {proj}: lora_A {list(a.shape)} / lora_B {list(b.shape)}, "
                               f"expected [{rank}, {in_cols}] / [{out_rows}, {rank}] (r = {rank} and the base's sizes)")
        suffix = "" if part is None else f"_{part}"
        out[f"{our_linear_of(n, linear)}.lora_A{suffix}"] = a.float().contiguous()
        out[f"{our_linear_of(n, linear)}.lora_B{suffix}"] = b.float().contiguous()
    targets = tuple(_TARGET_OF[p] for p in projections)
    assert all(t in LORA_PART_TARGETS or t in ("linear_proj", "linear_fc2") for t in targets)
    lora = LoRAConfig(rank=rank, alpha=alpha, dropout=dropout,
                      target_modules=targets, layers=None if layers == list(range(cfg.num_layers)) else tuple(layers))
    return lora, out


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _lora_numbers(config: Mapping[str, Any], where: str) -> tuple[int, float, float]:
    """``r``, ``lora_alpha`` (default ``r``) and ``lora_dropout`` (default 0) of an ``adapter_config``, each
    refused by name unless it is what PEFT means by it: a positive int rank, a positive finite alpha (NaN or
    infinity would only surface later as a mismatch between adapters, or an unwritable manifest), a dropout
    probability in [0, 1)."""
    rank = config.get("r")
    if "r" not in config:
        raise InteropError(f"{where}: missing key 'r' (the LoRA rank)")
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
        raise InteropError(f"{where}: r must be a positive integer (the LoRA rank), got {rank!r}")
    alpha = config.get("lora_alpha", rank)
    if not (_is_number(alpha) and math.isfinite(alpha) and alpha > 0):
        raise InteropError(f"{where}: lora_alpha must be a positive finite number, got {alpha!r}")
    dropout = config.get("lora_dropout", 0.0)
    if dropout is None:
        dropout = 0.0
    if not (_is_number(dropout) and 0.0 <= dropout < 1.0):
        raise InteropError(f"{where}: lora_dropout must be a number in [0, 1), got {dropout!r}")
    return rank, float(alpha), float(dropout)


# --------------------------------------------------------------------------------------------- files
def read_peft_dir(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``adapter_config.json`` and ``adapter_model.safetensors`` of a PEFT adapter directory (read by our own
    safetensors reader: no optional dependency, and a damaged file is one message naming it)."""
    root = Path(path)
    cfg_path, weights = root / PEFT_CONFIG_FILE, root / PEFT_WEIGHTS_FILE
    if not cfg_path.is_file():
        raise InteropError(f"{root} is not a PEFT adapter directory: {PEFT_CONFIG_FILE} is missing")
    if not weights.is_file():
        raise InteropError(f"{root}: {PEFT_WEIGHTS_FILE} is missing (only safetensors adapters are read: a "
                           "pickled adapter_model.bin could run code)")
    config = read_json_object(cfg_path)
    stored = open_safetensors(weights)
    return config, {name: read_tensor(stored, name) for name in stored.tensors}


def write_peft_dir(path: str | os.PathLike[str], config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write a PEFT adapter directory (fsynced; the weights by our own safetensors writer, which PEFT's
    ``from_pretrained`` reads)."""
    from ..checkpoint.storage.durable import fsync_dir, fsync_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(root / PEFT_WEIGHTS_FILE, {n: (t.dtype, t.shape) for n, t in tensors.items()},
                      iter(tensors.items()), metadata={"format": "pt"})
    (root / PEFT_CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    umask = os.umask(0)
    os.umask(umask)
    for name in (PEFT_WEIGHTS_FILE, PEFT_CONFIG_FILE):
        os.chmod(root / name, 0o666 & ~umask)  # as save_pretrained leaves them, whatever the process's umask
        fsync_file(root / name)
    fsync_dir(root)
