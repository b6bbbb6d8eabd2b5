"""Hugging Face Llama <-> peftckpt GPT: the config mapping and the weight-name mapping.

HF Llama keeps separate ``q_proj`` / ``k_proj`` / ``v_proj`` and ``gate_proj`` / ``up_proj``; our GPT fuses
them into ``linear_qkv`` (rows grouped per query group) and ``linear_fc1`` (``[gate; up]``), see
:mod:`peftckpt.model.fused`. HF's rotary embedding uses the rotate-half convention on the q/k rows as stored
in HF checkpoints, which is ours too, so q and k rows need no permutation. Only plain Llama maps exactly:
RMSNorm, SiLU-gated MLP, RoPE without scaling, no biases, ``head_dim = hidden / heads``; anything else is
refused with the config key that differs.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.storage.byte_sources import ByteSource
from ..json_text import parse_json
from ..model.config import GPTConfig
from ..model.fused import split_gate_up, split_qkv
from .safetensors_io import SafetensorsError, SafetensorsFile, write_safetensors

__all__ = ["InteropError", "open_safetensors", "read_json_object", "parse_json_object", "config_from_hf", "config_to_hf", "hf_export_plan", "write_hf_dir",
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


def open_safetensors(path: str | os.PathLike[str] | ByteSource) -> SafetensorsFile:
    """A safetensors file of an HF model or PEFT adapter directory, its header validated: a truncated file, a
    malformed header or an unknown dtype is one :class:`InteropError` naming the file."""
    try:
        return SafetensorsFile(path)
    except SafetensorsError as e:
        raise InteropError(str(e)) from None


def read_tensor(st: SafetensorsFile, name: str) -> torch.Tensor:
    """Tensor ``name`` of a file opened by :func:`open_safetensors`; a read that fails (the file shrank or became
    unreadable since it was opened) is one :class:`InteropError` naming the file."""
    try:
        return st.read(name)
    except (OSError, ValueError) as e:
        raise InteropError(f"{st.path}: tensor {name!r} cannot be read: {e}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path`` (``config.json``, an index, ``adapter_config.json``); anything else -- unreadable,
    not UTF-8, not JSON, nested too deeply, not an object -- is one :class:`InteropError` naming the file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InteropError(f"{path} is not valid JSON: {e}") from None
    return parse_json_object(data, str(path))


def parse_json_object(data: bytes, where: str) -> dict[str, Any]:
    """:func:`read_json_object` of bytes already read from ``where`` (a file, or an object on a store)."""
    try:
        value = parse_json(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InteropError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise InteropError(f"{where} must hold a JSON object, not {type(value).__name__}")
    return value


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


Split = Callable[[torch.Tensor], list[tuple[str, torch.Tensor]]]


def _as_is(name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, t)]


def _split_qkv(names: Sequence[str], cfg: GPTConfig, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return list(zip(names, split_qkv(t, cfg), strict=True))


def _split_gate_up(names: Sequence[str], cfg: GPTConfig, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return list(zip(names, split_gate_up(t, cfg), strict=True))


def hf_export_plan(cfg: GPTConfig) -> list[tuple[str, Split]]:
    """In HF file order: each of our tensors and how it becomes HF tensors (``[(hf name, tensor)]``):
    one to one, or split into q/k/v and gate/up. Works on meta tensors too (to announce shapes)."""
    plan: list[tuple[str, Split]] = [(ours, functools.partial(_as_is, theirs)) for ours, theirs in hf_one_to_one(cfg)]
    for n in range(cfg.num_layers):
        names = [f"{hf_module_of(n, p)}.weight" for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")]
        plan.append((f"{our_linear_of(n, 'linear_qkv')}.weight", functools.partial(_split_qkv, names[:3], cfg)))
        plan.append((f"{our_linear_of(n, 'linear_fc1')}.weight", functools.partial(_split_gate_up, names[3:], cfg)))
    return plan


# ------------------------------------------------------------------------------------------ files
def write_hf_dir(path: str | os.PathLike[str], config: Mapping[str, Any],
                 specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                 tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Write ``config.json`` + ``model.safetensors`` into directory ``path``, the tensors announced by ``specs``
    and produced one at a time by ``tensors`` (never all in memory); both files fsynced."""
    from ..checkpoint.storage.durable import fsync_dir, fsync_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    write_safetensors(root / SAFETENSORS_FILE, specs, tensors, metadata={"format": "pt"})
    (root / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
    fsync_file(root / CONFIG_FILE)
    fsync_dir(root)
