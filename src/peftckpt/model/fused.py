"""The row layout of the fused projections, as global (TP-independent) tensors.

``linear_qkv`` rows are grouped per query group: for each group g, ``[q heads of g; k_g; v_g]`` (each head
``head_dim`` rows). ``linear_fc1`` with SwiGLU is ``[gate; up]``. These helpers split such a tensor (a
weight ``[rows, in]`` or a LoRA B ``[rows, r]``) into the per-projection tensors HF Llama has
(``q_proj`` / ``k_proj`` / ``v_proj``, ``gate_proj`` / ``up_proj``) and fuse them back, exactly.
"""

from __future__ import annotations

import torch

from .config import GPTConfig

__all__ = ["split_qkv", "fuse_qkv", "split_gate_up", "fuse_gate_up"]


def split_qkv(t: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused QKV rows -> ``(q [heads*hd, ...], k [groups*hd, ...], v [groups*hd, ...])``."""
    g, hd = config.groups, config.head_dim
    hpg = config.num_attention_heads // g
    if t.shape[0] != config.qkv_size:
        raise ValueError(f"fused QKV tensor has {t.shape[0]} rows, expected {config.qkv_size}")
    grouped = t.reshape(g, hpg + 2, hd, *t.shape[1:])
    q = grouped[:, :hpg].reshape(g * hpg * hd, *t.shape[1:])
    k = grouped[:, hpg].reshape(g * hd, *t.shape[1:])
    v = grouped[:, hpg + 1].reshape(g * hd, *t.shape[1:])
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Inverse of :func:`split_qkv`."""
    g, hd = config.groups, config.head_dim
    hpg = config.num_attention_heads // g
    rest = q.shape[1:]
    for name, t, rows in (("q", q, g * hpg * hd), ("k", k, g * hd), ("v", v, g * hd)):
        if t.shape[0] != rows or t.shape[1:] != rest:
            raise ValueError(f"{name} has shape {list(t.shape)}, expected [{rows}, {', '.join(map(str, rest))}]")
    grouped = torch.cat([q.reshape(g, hpg, hd, *rest), k.reshape(g, 1, hd, *rest), v.reshape(g, 1, hd, *rest)],
                        dim=1)
    return grouped.reshape(config.qkv_size, *rest).contiguous()


def split_gate_up(t: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU ``linear_fc1`` rows ``[gate; up]`` -> ``(gate, up)``."""
    if t.shape[0] != 2 * config.ffn:
        raise ValueError(f"fused gate/up tensor has {t.shape[0]} rows, expected {2 * config.ffn}")
    gate, up = t.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    """Inverse of :func:`split_gate_up`."""
    for name, t in (("gate", gate), ("up", up)):
        if t.shape[0] != config.ffn:
            raise ValueError(f"{name} has {t.shape[0]} rows, expected {config.ffn}")
    return torch.cat([gate, up], dim=0).contiguous()
