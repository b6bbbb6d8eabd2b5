"""Hugging Face Llama <-> peftckpt GPT: the config mapping and the weight-name mapping.

HF Llama keeps separate ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj``; our GPT fuses
them into ``linear_qkv`` (rows grouped per query group) and ``linear_fc1`` (``[gate; up]``), see
:mod:`peftckpt.model.fused`. HF's rotary embedding uses the rotate-half convention on the q/k rows as stored
in HF checkpoints, which is ours too, so q and k rows need no permutation. Only plain Llama maps exactly:
RMSNorm, SiLU-gated MLP, RoPE without scaling, no biases, ``head_dim = hidden / heads``; anything else is
refused with the config key that differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..model.config import GPTConfig
from ..model.fused import fuse_gate_up, fuse_qkv, split_gate_up, split_qkv

__all__ = ["InteropError", "config_from_hf", "config_to_hf", "hf_to_gpt", "gpt_to_hf", "read_hf_dir", "write_hf_dir",
           "HF_PROJECTIONS", "hf_module_of", "our_linear_of", "hf_one_to_one", "CONFIG_FILE", "SAFETENSORS_FILE",
           "SAFETENSORS_INDEX"]

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"

#: HF Llama projection -> (our linear layer, part of it or None).
HF_PROJECTIONS: dict[str, tuple[str, str | None]] = {
    "q_proj": ("linear_qkv", "q"), "k_proj": ("linear_qkv", "k"), "v_proj": ("linear_qkv", "v"),
    "o_proj": ("linear_proj", None),
    "gate_proj": ("linear_fc1", "gate"), "up_proj": ("linear_fc1", "up"), "down_proj": ("linear_fc2", None),
}
_OWNER = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
_HF_OWNER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class InteropError(ValueError):
    """An HF directory, config or adapter that cannot be mapped exactly (the message names the key/file)."""


def hf_module_of(layer: int, projection: str) -> str:
    """``model.layers.<layer>.self_attn.q_proj`` and friends."""
    return f"model.layers.{layer}.{_HF_OWNER[projection]}.{projection}"


def our_linear_of(layer: int, linear: str) -> str:
    """``decoder.layers.<layer>.self_attention.linear_qkv`` and friends."""
    return f"decoder.layers.{layer}.{_OWNER[linear]}.{linear}"


# ------------------------------------------------------------------------------------------- config
def _rope_theta(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise InteropError(f"{CONFIG_FILE}: rope type {kind!r} (rope scaling) is not supported; only plain RoPE")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    return float(theta)


def config_from_hf(hf: Mapping[str, Any]) -> GPTConfig:
    """Our architecture for an HF Llama ``config.json``; refuses what would not compute the same function."""
    if hf.get("model_type") not in ("llama", None):
        raise InteropError(f"{CONFIG_FILE}: model_type {hf.get('model_type')!r}; only Llama-architecture models "
                           "are supported")
    checks = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    for key, expected in checks.items():
        if key in hf and hf[key] != expected:
            raise InteropError(f"{CONFIG_FILE}: {key} = {hf[key]!r} is not supported (needs {expected!r})")
    try:
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        cfg = GPTConfig(
            num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            ffn_hidden_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)), swiglu=True,
            normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
            position_embedding_type="rope", rotary_base=_rope_theta(hf),
            untie_embeddings_and_output_weights=not bool(hf.get("tie_word_embeddings", False)),
            init_method_std=float(hf.get("initializer_range", 0.02)),
        )
    except KeyError as e:
        raise InteropError(f"{CONFIG_FILE}: missing key {e.args[0]!r}") from None
    except ValueError as e:
        raise InteropError(f"{CONFIG_FILE}: {e}") from None
    if hf.get("head_dim") not in (None, cfg.head_dim):
        raise InteropError(f"{CONFIG_FILE}: head_dim = {hf['head_dim']} differs from hidden_size / "
                           f"num_attention_heads = {cfg.head_dim}; not supported")
    return cfg


def config_to_hf(cfg: GPTConfig, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """An HF ``LlamaForCausalLM`` ``config.json`` for our architecture (refuses non-Llama variants)."""
    unsupported = {"swiglu": (cfg.swiglu, True), "normalization": (cfg.normalization, "RMSNorm"),
                   "position_embedding_type": (cfg.position_embedding_type, "rope")}
    for key, (value, needed) in unsupported.items():
        if value != needed:
            raise InteropError(f"the checkpoint's model has {key} = {value!r}; HF Llama needs {needed!r}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.groups,
        "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base},
        "rope_theta": cfg.rotary_base, "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
        "initializer_range": cfg.init_method_std, "torch_dtype": str(dtype).removeprefix("torch."),
    }


# ------------------------------------------------------------------------------------------ weights
def hf_one_to_one(cfg: GPTConfig) -> Iterator[tuple[str, str]]:
    """(our name, HF name) of the tensors that map one to one."""
    yield "embedding.word_embeddings.weight", "model.embed_tokens.weight"
    for n in range(cfg.num_layers):
        yield f"decoder.layers.{n}.input_layernorm.weight", f"model.layers.{n}.input_layernorm.weight"
        yield f"decoder.layers.{n}.pre_mlp_layernorm.weight", f"model.layers.{n}.post_attention_layernorm.weight"
        yield f"{our_linear_of(n, 'linear_proj')}.weight", f"{hf_module_of(n, 'o_proj')}.weight"
        yield f"{our_linear_of(n, 'linear_fc2')}.weight", f"{hf_module_of(n, 'down_proj')}.weight"
    yield "decoder.final_layernorm.weight", "model.norm.weight"
    if cfg.untie_embeddings_and_output_weights:
        yield "output_layer.weight", "lm_head.weight"


def hf_to_gpt(hf: Mapping[str, torch.Tensor], cfg: GPTConfig, source: str) -> dict[str, torch.Tensor]:
    """HF Llama tensors -> our model tensors (fusing q/k/v and gate/up). Every tensor must be used."""
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise InteropError(f"{source}: tensor {name!r} is missing")
        used.add(name)
        return hf[name]

    out = {ours: take(theirs) for ours, theirs in hf_one_to_one(cfg)}
    for n in range(cfg.num_layers):
        q, k, v = (take(f"{hf_module_of(n, p)}.weight") for p in ("q_proj", "k_proj", "v_proj"))
        gate, up = (take(f"{hf_module_of(n, p)}.weight") for p in ("gate_proj", "up_proj"))
        try:
            out[f"{our_linear_of(n, 'linear_qkv')}.weight"] = fuse_qkv(q, k, v, cfg)
            out[f"{our_linear_of(n, 'linear_fc1')}.weight"] = fuse_gate_up(gate, up, cfg)
        except ValueError as e:
            raise InteropError(f"{source}: layer {n}: {e} (as {CONFIG_FILE} describes the model)") from None
    # Rotary inverse frequencies are derived, not weights; anything else unused means a different model.
    extra = sorted(k for k in hf if k not in used and not k.endswith("rotary_emb.inv_freq")
                   and not (k == "lm_head.weight" and not cfg.untie_embeddings_and_output_weights))
    if extra:
        raise InteropError(f"{source}: {len(extra)} tensor(s) do not belong to a Llama of this config: {extra[:5]}")
    return out


def gpt_to_hf(tensors: Mapping[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """Our model tensors -> HF Llama tensors (splitting the fused projections)."""
    out = {theirs: tensors[ours] for ours, theirs in hf_one_to_one(cfg)}
    for n in range(cfg.num_layers):
        q, k, v = split_qkv(tensors[f"{our_linear_of(n, 'linear_qkv')}.weight"], cfg)
        gate, up = split_gate_up(tensors[f"{our_linear_of(n, 'linear_fc1')}.weight"], cfg)
        for proj, t in (("q_proj", q), ("k_proj", k), ("v_proj", v), ("gate_proj", gate), ("up_proj", up)):
            out[f"{hf_module_of(n, proj)}.weight"] = t
    return {k: v.contiguous() for k, v in out.items()}


# ------------------------------------------------------------------------------------------ files
def read_hf_dir(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and every tensor of an HF model directory (one or several safetensors files)."""
    from safetensors.torch import load_file

    root = Path(path)
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise InteropError(f"{root} is not an HF model directory: {CONFIG_FILE} is missing")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise InteropError(f"{config_path} is not valid JSON: {e}") from None
    index = root / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (root / SAFETENSORS_FILE).is_file():
        files = [SAFETENSORS_FILE]
    else:
        raise InteropError(f"{root}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (only safetensors weights are "
                           "read: pickled .bin files could run code)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        f = root / name
        if not f.is_file():
            raise InteropError(f"{SAFETENSORS_INDEX} lists {name}, which is missing from {root}")
        tensors.update(load_file(str(f)))
    return config, tensors


def write_hf_dir(path: str | os.PathLike[str], config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``config.json`` + ``model.safetensors`` (fsynced) into a new directory ``path``."""
    from safetensors.torch import save_file

    from ..checkpoint.storage_layout import fsync_dir, fsync_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / SAFETENSORS_FILE),
              metadata={"format": "pt"})
    (root / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    for name in (SAFETENSORS_FILE, CONFIG_FILE):
        fsync_file(root / name)
    fsync_dir(root)
