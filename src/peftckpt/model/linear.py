"""Column- and row-parallel linear layers with optional LoRA adapters (TP-aware).

Column-parallel (``linear_qkv``, ``linear_fc1``): weight ``[out, in]`` sharded on ``out``; LoRA A
``[r, in]`` replicated, B ``[out, r]`` sharded like the base output.
Row-parallel (``linear_proj``, ``linear_fc2``): weight sharded on ``in``; LoRA A ``[r, in]`` sharded like
the base input, B ``[out, r]`` replicated.

A fused column-parallel layer (``linear_qkv`` = q, k, v; SwiGLU ``linear_fc1`` = gate, up) takes either one
adapter over the whole fused output (``lora_A`` / ``lora_B``, Megatron's "performant" LoRA) or one adapter per
part (``lora_A_q`` / ``lora_B_q``, ..., "canonical" LoRA, as HF PEFT has on separate ``q_proj`` / ``k_proj`` /
``v_proj`` / ``gate_proj`` / ``up_proj``). A part's B is sharded on its rows like that part of the base
output; the parts' outputs are interleaved back into the fused layout (per query group for QKV).

Adapters are ordinary parameters with ``requires_grad=True`` on a base whose own parameters were frozen
structurally (see :func:`peftckpt.model.lora.apply_lora`); nothing here looks at names.

Weights are created from a shape and an init function (:mod:`peftckpt.model.deferred`), so a layer can be
built on the meta device. The base weight may be stored in a lower precision than the adapters (a bf16
frozen base, fp32 adapters): the base GEMM runs in the weight's dtype, each adapter in its own, and the
adapter output is cast back to the base output's dtype. A frozen base weight can also be held in NF4
(:meth:`ParallelLinear.quantize_nf4`, QLoRA): ``weight`` is then replaced by its codes, block scales and
group factors (:mod:`peftckpt.model.nf4`), dequantized for each product.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor_parallel import TensorParallel, copy_to_tp, local_tensor, reduce_from_tp
from ..sharding.layout import FusedChunks, declare_fused
from . import nf4
from .deferred import ShardedInit, sharded_param

__all__ = ["ParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "sharded_dropout"]


_BACKWARD_BLOCK_ROWS = 1024
"""Rows of a frozen weight upcast at a time by :class:`_FrozenLinear`'s backward (a 1024 x 11008 fp32 block is
45 MB)."""


class _FrozenLinear(torch.autograd.Function):
    """``x @ w.T`` for a frozen low-precision ``w`` on the CPU, whose input gradient ``g @ w`` is computed in fp32.

    torch's CPU bf16 GEMM takes a fallback ~50x slower when the second operand is a row-major matrix, which is
    exactly ``g @ w`` (measured, torch 2.13 on a 2-core AMD EPYC without AVX512-BF16: 4.8 s against 0.09 s for
    the transposed layout, 16 x 4096 @ 4096 x 4096). Upcasting ``w`` one block of rows at a time keeps the
    extra memory to one block and the result at least as accurate. No gradient for ``w``: it is frozen."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(w)
        return F.linear(x, w)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        (w,) = ctx.saved_tensors
        g = grads[0]
        flat = g.reshape(-1, g.shape[-1]).float()
        out = torch.zeros(flat.shape[0], w.shape[1], dtype=torch.float32, device=g.device)
        for start in range(0, w.shape[0], _BACKWARD_BLOCK_ROWS):
            stop = start + _BACKWARD_BLOCK_ROWS
            out.addmm_(flat[:, start:stop], w[start:stop].float())
        return out.reshape(*g.shape[:-1], w.shape[1]).to(g.dtype), None


def base_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, w)`` in ``w``'s dtype; for a frozen bf16/fp16 ``w`` on the CPU, with the fast backward of
    :class:`_FrozenLinear` (GPUs and fp32 weights take ``F.linear`` itself)."""
    x = x.to(w.dtype)
    if w.requires_grad or w.dtype == torch.float32 or w.device.type != "cpu":
        return F.linear(x, w)
    return _FrozenLinear.apply(x, w)


def sharded_dropout(x: torch.Tensor, p: float, tp: TensorParallel, training: bool) -> torch.Tensor:
    """Dropout of an activation sharded over TP on its last dim (a row-parallel layer's input).

    Every TP rank draws the mask of the whole activation -- the same draw, from generators that are equal
    across TP -- and keeps its own slice. So the masks of the ranks differ (each masks other features, as
    one process would), the generators stay equal across TP for the replicated activations' masks, and the
    run is the same at every TP size, dropout included. The price is ``tp`` times the random numbers of
    this one mask."""
    if not training or p == 0.0:
        return x
    n = x.shape[-1]
    keep = torch.empty(*x.shape[:-1], n * tp.size, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p)
    return x * keep[..., tp.rank * n:(tp.rank + 1) * n] / (1.0 - p)


class ParallelLinear(nn.Module):
    """Shared LoRA bookkeeping of the two TP linear flavours (no bias: Llama-style)."""

    weight: nn.Parameter
    weight_nf4: nn.Parameter
    weight_scales: nn.Parameter
    weight_factors: nn.Parameter
    lora_A: nn.Parameter | None
    lora_B: nn.Parameter | None

    def __init__(self, weight_shape: tuple[int, int], weight_init: Callable[[], torch.Tensor], tp: TensorParallel,
                 shard_dim: int, num_chunks: int = 1, parts: tuple[tuple[str, int], ...] = (), local_groups: int = 1,
                 device: torch.device | str | None = None):
        super().__init__()
        self.tp = tp
        self.out_features, self.in_features = weight_shape
        self.num_chunks = num_chunks
        self.shard_dim = shard_dim
        self.nf4: tuple[tuple[int, int], torch.dtype] | None = None
        """Where the base weight is held in NF4 (:meth:`quantize_nf4`): the layout of this rank's shard (first
        block of its rows, blocks per group) and the dtype it is dequantized to."""
        # Output parts of a fused layer, (name, global rows), in fused order; the local output is
        # `local_groups` repetitions of [part_0 block, part_1 block, ...] (see `_assemble`).
        self.parts = dict(parts)
        self.local_groups = local_groups
        self.part_adapters: list[str] = []
        self.weight = sharded_param(self, "weight", weight_shape, ShardedInit(weight_init, tp, shard_dim, num_chunks),
                                    device=device)
        # Only a TP split interleaves the blocks; at TP = 1 the tensor already is [gate; up].
        if num_chunks > 1 and tp.size > 1:
            declare_fused(self, "weight", FusedChunks(dim=shard_dim, num_chunks=num_chunks))
        self.lora_A = None
        self.lora_B = None
        self.lora_scaling = 0.0
        self.lora_dropout: nn.Module = nn.Identity()
        """Dropout of the adapter input (an input sharded over TP -- row-parallel layers -- takes its probability
        to :func:`sharded_dropout`)."""
        self.merged = False

    # Column and row layers differ only in which adapter matrix is sharded.
    _a_shard_dim: int | None
    _b_shard_dim: int | None

    def add_lora(self, rank: int, alpha: float, dropout: float, generator: torch.Generator,
                 part: str | None = None) -> None:
        """Attach a rank-``rank`` adapter: A ~ U(-1/sqrt(in), 1/sqrt(in)) (as PEFT), B = 0 (so step 0 = base).

        ``part`` (``q``, ``k``, ``v``, ``gate``, ``up``) adapts one part of a fused output only; a layer holds
        either one whole-output adapter or per-part adapters, all of the same rank and alpha."""
        if self.lora_A is not None or (part is None and self.part_adapters) or part in self.part_adapters:
            raise RuntimeError("this layer already has a LoRA adapter there")
        if part is not None and part not in self.parts:
            raise ValueError(f"no output part {part!r} in this layer (parts: {sorted(self.parts) or 'none'})")
        if self.part_adapters and self.lora_scaling != alpha / rank:
            raise ValueError("all adapters of one layer need the same rank and alpha")
        bound = 1.0 / math.sqrt(self.in_features)
        # Drawn when the adapter is initialised (at once, or after a meta-device build is materialised);
        # a copy of the generator's state keeps every initialisation the same.
        state = generator.get_state()

        def init_a() -> torch.Tensor:
            g = torch.Generator().set_state(state)
            return torch.empty(rank, self.in_features).uniform_(-bound, bound, generator=g)

        def zeros(rows: int) -> Callable[[], torch.Tensor]:
            return lambda: torch.zeros(rows, rank)

        device = self._base_device()  # adapters are fp32 whatever the base's dtype
        shape_a = (rank, self.in_features)
        if part is None:
            self.lora_A = sharded_param(self, "lora_A", shape_a, ShardedInit(init_a, self.tp, self._a_shard_dim),
                                        device=device)
            b_chunks = self.num_chunks if self._b_shard_dim == 0 else 1
            self.lora_B = sharded_param(self, "lora_B", (self.out_features, rank),
                                        ShardedInit(zeros(self.out_features), self.tp, self._b_shard_dim, b_chunks),
                                        device=device)
            if self.num_chunks > 1 and self._b_shard_dim == 0 and self.tp.size > 1:
                declare_fused(self, "lora_B", FusedChunks(dim=0, num_chunks=self.num_chunks))
        else:
            # A part's rows are contiguous in its own tensor, so a plain row split matches the base's shards.
            sharded_param(self, f"lora_A_{part}", shape_a, ShardedInit(init_a, self.tp, None), device=device)
            rows = self.parts[part]
            sharded_param(self, f"lora_B_{part}", (rows, rank), ShardedInit(zeros(rows), self.tp, 0), device=device)
            self.part_adapters = [p for p in self.parts if p in (*self.part_adapters, part)]
        self.lora_scaling = alpha / rank
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def adapter_pairs(self) -> list[tuple[str | None, nn.Parameter, nn.Parameter]]:
        """``(part or None, A, B)`` of every adapter of this layer."""
        if self.lora_A is not None and self.lora_B is not None:
            return [(None, self.lora_A, self.lora_B)]
        return [(p, getattr(self, f"lora_A_{p}"), getattr(self, f"lora_B_{p}")) for p in self.part_adapters]

    def _assemble(self, deltas: dict[str, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        """Interleave per-part outputs (last dim = the part's local rows) into the fused local layout;
        parts without an adapter contribute zeros (of the outputs' dtype; ``like`` gives the other dims)."""
        g = self.local_groups
        dtype = next(iter(deltas.values())).dtype
        blocks = []
        for name, rows in self.parts.items():
            local_rows = rows // self.tp.size
            d = deltas.get(name)
            if d is None:
                d = like.new_zeros(*like.shape[:-1], local_rows, dtype=dtype)
            blocks.append(d.reshape(*d.shape[:-1], g, local_rows // g))
        out = torch.cat(blocks, dim=-1)
        return out.reshape(*out.shape[:-2], -1)

    def _delta_weight(self) -> torch.Tensor:
        """``B @ A`` of the local shards, in the local layout of the weight (without the scaling)."""
        pairs = self.adapter_pairs()
        if pairs and pairs[0][0] is None:
            _, a, b = pairs[0]
            return local_tensor(b) @ local_tensor(a)
        # [in, rows_p] per part, assembled on the last dim, transposed back to [out_local, in].
        deltas = {p or "": (local_tensor(b) @ local_tensor(a)).t() for p, a, b in pairs}
        like = next(iter(deltas.values()))
        rows = self.tp.local_shape((self.out_features, self.in_features), self.shard_dim, self.num_chunks)[0]
        return self._assemble(deltas, like.new_empty(like.shape[0], rows)).t()

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold ``scaling * B @ A`` into the weight (local shards only: no communication needed)."""
        if not self.adapter_pairs() or self.merged:
            return
        if self.nf4 is not None:
            raise RuntimeError("an adapter cannot be merged into an NF4 base (the merged weight would be "
                               "quantized again: not the model that was trained); merge into the full-precision base")
        local_tensor(self.weight).add_(self._delta_weight(), alpha=self.lora_scaling)
        self.merged = True

    @torch.no_grad()
    def unmerge_lora(self) -> None:
        """Undo :meth:`merge_lora` (exact up to floating-point rounding)."""
        if not self.adapter_pairs() or not self.merged:
            return
        local_tensor(self.weight).sub_(self._delta_weight(), alpha=self.lora_scaling)
        self.merged = False

    def _adapter_active(self) -> bool:
        return (self.lora_A is not None or bool(self.part_adapters)) and not self.merged

    def extra_repr(self) -> str:
        pairs = self.adapter_pairs()
        r = "" if not pairs else f", lora_rank={pairs[0][1].shape[0]}"
        if pairs and pairs[0][0] is not None:
            r += f", lora_parts={self.part_adapters}"
        q = "" if self.nf4 is None else ", base=nf4"
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}{q}{r}"

    # ---------------------------------------------------------------------------------------- the base
    def _base_device(self) -> torch.device:
        return local_tensor(self.weight if self.nf4 is None else self.weight_nf4).device

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` of this rank's shard of the frozen base weight (full precision, or NF4)."""
        if self.nf4 is None:
            return base_linear(x, local_tensor(self.weight))
        layout, dtype = self.nf4
        q = nf4.NF4Weight(local_tensor(self.weight_nf4), local_tensor(self.weight_scales),
                          local_tensor(self.weight_factors), *layout)
        return nf4.nf4_linear(x, q, dtype)

    @torch.no_grad()
    def quantize_nf4(self) -> None:
        """Hold the frozen base weight in NF4 from now on (collective over TP for a row-parallel layer: the
        double-quantization factors of a row split over ranks are its maxima over them). ``weight`` is replaced by
        frozen ``weight_nf4`` (uint8 ``[out, in / 2]``), ``weight_scales`` (uint8 ``[out, in / 64]``) and
        ``weight_factors`` (fp32 ``[out, groups per row]``), sharded like it; products dequantize it into its
        dtype. Raises ``ValueError`` when the weight trains or its TP shards cut NF4's blocks or groups."""
        if self.nf4 is not None:
            return
        columns, start, split = self._nf4_columns()
        groups, per = nf4.groups_of(columns)
        group_max = None
        if split:
            first = start // nf4.BLOCK // per

            def group_max(local: torch.Tensor) -> torch.Tensor:
                whole = local.new_zeros(local.shape[0], groups)
                whole[:, first:first + local.shape[1]] = local
                dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=self.tp.group)
                return whole[:, first:first + local.shape[1]]

        self._hold_nf4(nf4.quantize(local_tensor(self.weight), columns, start, group_max))

    def hold_nf4(self) -> None:
        """Hold the base weight in NF4 from now on, without quantizing it: ``weight_nf4``, ``weight_scales`` and
        ``weight_factors`` as :meth:`quantize_nf4` makes them, uninitialised, for a load of a base stored in NF4
        to fill (``import-hf --base-quantization nf4``). Raises ``ValueError`` as :meth:`quantize_nf4` does."""
        if self.nf4 is not None:
            return
        columns, start, _ = self._nf4_columns()
        w = local_tensor(self.weight)
        self._hold_nf4(nf4.empty_shard(w.shape[0], w.shape[1], columns, start, w.device))

    def _nf4_columns(self) -> tuple[int, int, bool]:
        """``(global columns, this shard's first column, whether TP splits the columns)`` of a weight that can be
        held in NF4."""
        if self.weight.requires_grad or self.merged:
            raise ValueError("only a frozen, unmerged base weight can be held in NF4")
        split = self.shard_dim == 1 and self.tp.size > 1
        start = self.tp.rank * (self.in_features // self.tp.size) if split else 0
        return self.in_features, start, split

    def _hold_nf4(self, q: nf4.NF4Weight) -> None:
        """Replace ``weight`` by the parts of ``q`` (this rank's shard), declared sharded like it."""
        columns, _, split = self._nf4_columns()
        groups, _ = nf4.groups_of(columns)
        factors_dim: int | None = 0 if self.shard_dim == 0 else None
        if split and groups > 1:
            if q.factors.shape[1] * self.tp.size != groups:
                raise ValueError(f"{groups} double-quantization groups per row of {columns} columns cannot be "
                                 f"split over {self.tp.size} tensor-parallel ranks")
            factors_dim = 1
        shapes = nf4.stored_shapes((self.out_features, columns))
        dtype = self.weight.dtype
        del self.weight  # its memory goes with the last reference (a load reading tensor by tensor drops its own)
        for name, local, dim in (("weight_nf4", q.codes, self.shard_dim), ("weight_scales", q.scales, self.shard_dim),
                                 ("weight_factors", q.factors, factors_dim)):
            setattr(self, name, self.tp.wrap_local(local, shapes[name], dim))
            if self.num_chunks > 1 and self.shard_dim == 0 and self.tp.size > 1:
                declare_fused(self, name, FusedChunks(dim=0, num_chunks=self.num_chunks))
        self.nf4 = ((q.first_block, q.per_group), dtype)


class ColumnParallelLinear(ParallelLinear):
    """``y_r = x W_r^T`` with replicated input and output sharded on the last dim."""

    _a_shard_dim = None
    _b_shard_dim = 0

    def __init__(self, weight_shape: tuple[int, int], weight_init: Callable[[], torch.Tensor], tp: TensorParallel,
                 num_chunks: int = 1, parts: tuple[tuple[str, int], ...] = (), local_groups: int = 1,
                 device: torch.device | str | None = None):
        super().__init__(weight_shape, weight_init, tp, shard_dim=0, num_chunks=num_chunks, parts=parts,
                         local_groups=local_groups, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp)
        y = self._base(x)
        if self._adapter_active():
            deltas: dict[str, torch.Tensor] = {}
            for part, a, b in self.adapter_pairs():
                a_local = local_tensor(a)
                # A is replicated but only sees this rank's slice of the output gradient: sum it over TP.
                h = F.linear(self.lora_dropout(x.to(a_local.dtype)), copy_to_tp(a_local, self.tp))
                deltas[part or ""] = F.linear(h, local_tensor(b))
            delta = deltas[""] if "" in deltas else self._assemble(deltas, y)
            y = y + (self.lora_scaling * delta).to(y.dtype)
        return y


class RowParallelLinear(ParallelLinear):
    """``y = sum_r x_r W_r^T`` with input sharded on the last dim and replicated output."""

    _a_shard_dim = 1
    _b_shard_dim = None

    def __init__(self, weight_shape: tuple[int, int], weight_init: Callable[[], torch.Tensor], tp: TensorParallel,
                 device: torch.device | str | None = None):
        super().__init__(weight_shape, weight_init, tp, shard_dim=1, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(self._base(x), self.tp)
        if self._adapter_active():
            assert self.lora_A is not None and self.lora_B is not None
            a = local_tensor(self.lora_A)
            x_a = sharded_dropout(x.to(a.dtype), getattr(self.lora_dropout, "p", 0.0), self.tp, self.training)
            h = reduce_from_tp(F.linear(x_a, a), self.tp)
            y = y + (self.lora_scaling * F.linear(h, local_tensor(self.lora_B))).to(y.dtype)
        return y
