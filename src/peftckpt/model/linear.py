"""Column- and row-parallel linear layers with optional LoRA adapters (TP-aware).

Column-parallel (``linear_qkv``, ``linear_fc1``): weight ``[out, in]`` sharded on ``out``; LoRA A
``[r, in]`` replicated, B ``[out, r]`` sharded like the base output.
Row-parallel (``linear_proj``, ``linear_fc2``): weight sharded on ``in``; LoRA A ``[r, in]`` sharded like
the base input, B ``[out, r]`` replicated.

Adapters are ordinary parameters with ``requires_grad=True`` on a base whose own parameters were frozen
structurally (see :func:`peftckpt.model.lora.apply_lora`); nothing here looks at names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor_parallel import TensorParallel, copy_to_tp, local_tensor, reduce_from_tp
from ..sharding.layout import FusedChunks, declare_fused

__all__ = ["ParallelLinear", "ColumnParallelLinear", "RowParallelLinear"]


class ParallelLinear(nn.Module):
    """Shared LoRA bookkeeping of the two TP linear flavours (no bias: Llama-style)."""

    weight: nn.Parameter
    lora_A: nn.Parameter | None
    lora_B: nn.Parameter | None

    def __init__(self, full_weight: torch.Tensor, tp: TensorParallel, shard_dim: int, num_chunks: int = 1):
        super().__init__()
        self.tp = tp
        self.out_features, self.in_features = full_weight.shape
        self.num_chunks = num_chunks
        self.weight = tp.make_param(full_weight, shard_dim, num_chunks)
        # Only a TP split interleaves the blocks; at TP = 1 the tensor already is [gate; up].
        if num_chunks > 1 and tp.size > 1:
            declare_fused(self, "weight", FusedChunks(dim=shard_dim, num_chunks=num_chunks))
        self.lora_A = None
        self.lora_B = None
        self.lora_scaling = 0.0
        self.lora_dropout: nn.Module = nn.Identity()
        self.merged = False

    # Column and row layers differ only in which adapter matrix is sharded.
    _a_shard_dim: int | None
    _b_shard_dim: int | None

    def add_lora(self, rank: int, alpha: float, dropout: float, generator: torch.Generator) -> None:
        """Attach a rank-``rank`` adapter: A ~ U(-1/sqrt(in), 1/sqrt(in)) (as PEFT), B = 0 (so step 0 = base)."""
        if self.lora_A is not None:
            raise RuntimeError("this layer already has a LoRA adapter")
        bound = 1.0 / math.sqrt(self.in_features)
        full_a = torch.empty(rank, self.in_features).uniform_(-bound, bound, generator=generator)
        full_b = torch.zeros(self.out_features, rank)
        self.lora_A = self.tp.make_param(full_a, self._a_shard_dim)
        self.lora_B = self.tp.make_param(full_b, self._b_shard_dim, self.num_chunks if self._b_shard_dim == 0 else 1)
        if self.num_chunks > 1 and self._b_shard_dim == 0 and self.tp.size > 1:
            declare_fused(self, "lora_B", FusedChunks(dim=0, num_chunks=self.num_chunks))
        self.lora_scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold ``scaling * B @ A`` into the weight (local shards only: no communication needed)."""
        if self.lora_A is None or self.lora_B is None or self.merged:
            return
        w = local_tensor(self.weight)
        w.add_(local_tensor(self.lora_B) @ local_tensor(self.lora_A), alpha=self.lora_scaling)
        self.merged = True

    @torch.no_grad()
    def unmerge_lora(self) -> None:
        """Undo :meth:`merge_lora` (exact up to floating-point rounding)."""
        if self.lora_A is None or self.lora_B is None or not self.merged:
            return
        w = local_tensor(self.weight)
        w.sub_(local_tensor(self.lora_B) @ local_tensor(self.lora_A), alpha=self.lora_scaling)
        self.merged = False

    def _adapter_active(self) -> bool:
        return self.lora_A is not None and not self.merged

    def extra_repr(self) -> str:
        r = "" if self.lora_A is None else f", lora_rank={self.lora_A.shape[0]}"
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}{r}"


class ColumnParallelLinear(ParallelLinear):
    """``y_r = x W_r^T`` with replicated input and output sharded on the last dim."""

    _a_shard_dim = None
    _b_shard_dim = 0

    def __init__(self, full_weight: torch.Tensor, tp: TensorParallel, num_chunks: int = 1):
        super().__init__(full_weight, tp, shard_dim=0, num_chunks=num_chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        y = F.linear(x, local_tensor(self.weight))
        if self._adapter_active():
            assert self.lora_A is not None and self.lora_B is not None
            # A is replicated but only sees this rank's slice of the output gradient: sum it over TP.
            a = copy_to_tp(local_tensor(self.lora_A), self.tp)
            h = F.linear(self.lora_dropout(x), a)
            y = y + self.lora_scaling * F.linear(h, local_tensor(self.lora_B))
        return y


class RowParallelLinear(ParallelLinear):
    """``y = sum_r x_r W_r^T`` with input sharded on the last dim and replicated output."""

    _a_shard_dim = 1
    _b_shard_dim = None

    def __init__(self, full_weight: torch.Tensor, tp: TensorParallel):
        super().__init__(full_weight, tp, shard_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, local_tensor(self.weight)), self.tp)
        if self._adapter_active():
            assert self.lora_A is not None and self.lora_B is not None
            h = reduce_from_tp(F.linear(self.lora_dropout(x), local_tensor(self.lora_A)), self.tp)
            y = y + self.lora_scaling * F.linear(h, local_tensor(self.lora_B))
        return y
