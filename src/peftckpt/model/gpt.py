"""A Llama-style GPT decoder with Megatron module names, built one pipeline chunk at a time.

State-dict names (global layer numbers, whatever the pipeline split)::

    embedding.word_embeddings.weight            [vocab, hidden]   (rows split over TP: vocab-parallel)
    embedding.position_embeddings.weight        [max_pos, hidden] (learned_absolute only)
    decoder.layers.N.input_layernorm.weight
    decoder.layers.N.self_attention.linear_qkv.weight   [(heads + 2*groups) * head_dim, hidden]
    decoder.layers.N.self_attention.linear_proj.weight  [hidden, heads * head_dim]
    decoder.layers.N.pre_mlp_layernorm.weight
    decoder.layers.N.mlp.linear_fc1.weight      [2*ffn (SwiGLU: [gate; up]) or ffn, hidden]
    decoder.layers.N.mlp.linear_fc2.weight      [hidden, ffn]
    decoder.final_layernorm.weight
    output_layer.weight                         [vocab, hidden] (untied only; rows split over TP)

With TP the vocabulary is split (:mod:`~peftckpt.model.vocab_parallel`): a last stage returns the logits of this
rank's vocabulary rows, and :func:`gpt_loss` takes the softmax over all of them without gathering the logits.

The fused QKV rows are grouped per query group -- ``[q_g (heads/groups heads), k_g, v_g]`` for each group g
-- so a contiguous TP split hands every rank whole groups and the global tensor does not depend on TP.

Initialisation is a pure function of ``(seed, parameter name)``: every layout (TP, PP, DP) builds exactly
the same global weights without communication, and no rank ever holds more than one full tensor.

A chunk built with ``device="meta"`` has shapes but no storage; :meth:`GPTModel.materialize` then allocates
this rank's shards and initialises the parameters asked for (bit-identical to an eager build), leaving the
others empty for a checkpoint to fill -- a base that is about to be loaded is never randomly initialised.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor_parallel import TensorParallel, copy_to_tp, local_tensor
from .config import GPTConfig, check_vocab_split
from .deferred import ParamFilter, ShardedInit, init_parameters, materialize, sharded_param
from .linear import ColumnParallelLinear, RowParallelLinear, base_linear
from .vocab_parallel import vocab_parallel_cross_entropy, vocab_parallel_embedding

__all__ = ["GPTModel", "TransformerLayer", "param_generator", "gpt_loss"]


def param_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator that depends only on the seed and the parameter's full name."""
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**62))


class _Init:
    """Deterministic full-size initial values, one generator per parameter name, drawn on demand."""

    def __init__(self, config: GPTConfig, seed: int, tp: TensorParallel, device: torch.device | str | None):
        self.config = config
        self.seed = seed
        self.tp = tp
        self.device = device
        """Where the parameters are created (``"meta"``: no storage, initialised by ``materialize``)."""

    def normal(self, name: str, shape: tuple[int, ...], std: float | None = None) -> Callable[[], torch.Tensor]:
        value = self.config.init_method_std if std is None else std
        # `param_generator` is looked up when the tensor is drawn, not when the model is built.
        return lambda: torch.randn(shape, generator=param_generator(self.seed, name)) * value

    def output_proj(self, name: str, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        # Megatron's scaled init for the projections that feed the residual stream.
        return self.normal(name, shape, self.config.init_method_std / math.sqrt(2.0 * self.config.num_layers))

    def replicated(self, module: nn.Module, name: str, shape: tuple[int, ...],
                   full: Callable[[], torch.Tensor]) -> nn.Parameter:
        """A parameter every TP rank holds whole (norms, position embeddings)."""
        return sharded_param(module, name, shape, ShardedInit(full, self.tp, None), device=self.device)


class Norm(nn.Module):
    """RMSNorm or LayerNorm with replicated parameters, computed in fp32."""

    def __init__(self, config: GPTConfig, init: _Init):
        super().__init__()
        self.kind = config.normalization
        self.eps = config.norm_epsilon
        h = config.hidden_size
        self.weight = init.replicated(self, "weight", (h,), lambda: torch.ones(h))
        self.bias = init.replicated(self, "bias", (h,), lambda: torch.zeros(h)) if self.kind == "LayerNorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        w = local_tensor(self.weight).to(xf.dtype)
        if self.kind == "RMSNorm":
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w
        else:
            assert self.bias is not None
            y = F.layer_norm(xf, (xf.shape[-1],), w, local_tensor(self.bias).to(xf.dtype), self.eps)
        return y.type_as(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(seq_len: int, head_dim: int, base: float, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables of shape [seq, head_dim] (rotate-half convention, as HF Llama), on ``device``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


class SelfAttention(nn.Module):
    """Causal grouped-query attention over this rank's query groups."""

    def __init__(self, config: GPTConfig, tp: TensorParallel, init: _Init, prefix: str):
        super().__init__()
        self.config = config
        hd, h = config.head_dim, config.hidden_size
        self.heads_per_group = config.num_attention_heads // config.groups
        self.local_groups = config.groups // tp.size
        heads, groups = config.num_attention_heads, config.groups
        qkv_shape = (config.qkv_size, h)
        self.linear_qkv = ColumnParallelLinear(
            qkv_shape, init.normal(f"{prefix}.linear_qkv.weight", qkv_shape), tp,
            parts=(("q", heads * hd), ("k", groups * hd), ("v", groups * hd)), local_groups=self.local_groups,
            device=init.device,
        )
        proj_shape = (h, config.num_attention_heads * hd)
        self.linear_proj = RowParallelLinear(
            proj_shape, init.output_proj(f"{prefix}.linear_proj.weight", proj_shape), tp, device=init.device
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd, hpg, g = self.config.head_dim, self.heads_per_group, self.local_groups
        qkv = self.linear_qkv(x).view(b, s, g, hpg + 2, hd)
        q = qkv[:, :, :, :hpg, :].reshape(b, s, g * hpg, hd).transpose(1, 2)
        k = qkv[:, :, :, hpg, :].transpose(1, 2)
        v = qkv[:, :, :, hpg + 1, :].transpose(1, 2)
        if self.config.position_embedding_type == "rope":
            cos, sin = rope_cos_sin(s, hd, self.config.rotary_base, q.dtype, q.device)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        if hpg > 1:
            k = k.repeat_interleave(hpg, dim=1)
            v = v.repeat_interleave(hpg, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.linear_proj(out.transpose(1, 2).reshape(b, s, g * hpg * hd))


class MLP(nn.Module):
    """Fused SwiGLU (``linear_fc1`` = ``[gate; up]`` in one GEMM) or GELU."""

    def __init__(self, config: GPTConfig, tp: TensorParallel, init: _Init, prefix: str):
        super().__init__()
        self.swiglu = config.swiglu
        h, f = config.hidden_size, config.ffn
        rows = 2 * f if self.swiglu else f
        self.linear_fc1 = ColumnParallelLinear(
            (rows, h), init.normal(f"{prefix}.linear_fc1.weight", (rows, h)), tp,
            num_chunks=2 if self.swiglu else 1, parts=(("gate", f), ("up", f)) if self.swiglu else (),
            device=init.device,
        )
        self.linear_fc2 = RowParallelLinear((h, f), init.output_proj(f"{prefix}.linear_fc2.weight", (h, f)), tp,
                                            device=init.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)  # local [gate_r; up_r]
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return self.linear_fc2(y)


class TransformerLayer(nn.Module):
    """Pre-norm decoder layer; ``layer_number`` is global (0-based)."""

    def __init__(self, config: GPTConfig, tp: TensorParallel, init: _Init, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        prefix = f"decoder.layers.{layer_number}"
        self.input_layernorm = Norm(config, init)
        self.self_attention = SelfAttention(config, tp, init, f"{prefix}.self_attention")
        self.pre_mlp_layernorm = Norm(config, init)
        self.mlp = MLP(config, tp, init, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class WeightHolder(nn.Module):
    """A module that only holds a ``weight`` (gives Megatron's ``<name>.weight`` keys): replicated over TP, or
    with ``dim`` sharded on that dimension."""

    weight: nn.Parameter

    def __init__(self, init: _Init, name: str, shape: tuple[int, ...], dim: int | None = None):
        super().__init__()
        sharded_param(self, "weight", shape, ShardedInit(init.normal(name, shape), init.tp, dim), device=init.device)


class Embedding(nn.Module):
    """The word (and learned position) embeddings; ``positions=False``: the word embeddings only, as the last
    pipeline stage holds them when they are tied to the output layer."""

    def __init__(self, config: GPTConfig, tp: TensorParallel, init: _Init, positions: bool = True):
        super().__init__()
        self.tp = tp
        self.vocab_size = config.vocab_size
        self.word_embeddings = WeightHolder(init, "embedding.word_embeddings.weight",
                                            (config.vocab_size, config.hidden_size), dim=0)
        self.position_embeddings: WeightHolder | None = None
        if positions and config.position_embedding_type == "learned_absolute":
            self.position_embeddings = WeightHolder(init, "embedding.position_embeddings.weight",
                                                    (config.max_position_embeddings, config.hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = vocab_parallel_embedding(tokens, local_tensor(self.word_embeddings.weight), self.tp, self.vocab_size)
        if self.position_embeddings is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + F.embedding(pos, local_tensor(self.position_embeddings.weight))
        return x


class Decoder(nn.Module):
    def __init__(self, config: GPTConfig, tp: TensorParallel, init: _Init, layer_numbers: Iterable[int],
                 post_process: bool):
        super().__init__()
        # Keyed by the *global* layer number so state-dict keys do not depend on the pipeline split.
        self.layers = nn.ModuleDict({str(n): TransformerLayer(config, tp, init, n) for n in layer_numbers})
        self.final_layernorm = Norm(config, init) if post_process else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        if self.final_layernorm is not None:
            x = self.final_layernorm(x)
        return x


class GPTModel(nn.Module):
    """One pipeline chunk of the GPT: optional embedding, some layers, optional head.

    ``pre_process`` chunks take token ids ``[b, s]``; the others take hidden states ``[b, s, hidden]``.
    ``post_process`` chunks return logits ``[b, s, vocab]``; the others return hidden states.

    ``device="meta"`` builds the chunk without storage (and without drawing any initial value); then
    :meth:`materialize` it. Otherwise every parameter is initialised on ``device`` (default: CPU) at once.
    Activations take the dtype of the embedding weight (bf16 for a bf16 base); each linear layer computes
    in its weight's dtype, adapters in theirs.
    """

    def __init__(
        self,
        config: GPTConfig,
        tp: TensorParallel | None = None,
        layer_numbers: Iterable[int] | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        seed: int = 1234,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        tp = tp or TensorParallel()
        if config.groups % tp.size:
            raise ValueError(
                f"--num-query-groups ({config.groups}) must be divisible by --tensor-model-parallel-size ({tp.size})"
            )
        if config.ffn % tp.size:
            raise ValueError(
                f"--ffn-hidden-size ({config.ffn}) must be divisible by --tensor-model-parallel-size ({tp.size})"
            )
        check_vocab_split(config.vocab_size, tp.size)
        tied = not config.untie_embeddings_and_output_weights
        self.config = config
        self.tp = tp
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer_numbers = list(range(config.num_layers) if layer_numbers is None else layer_numbers)
        init = _Init(config, seed, tp, device)
        self.embedding: Embedding | None = None
        if pre_process:
            self.embedding = Embedding(config, tp, init)
        elif post_process and tied:  # the output layer's copy of the first stage's table (same key, same values)
            self.embedding = Embedding(config, tp, init, positions=False)
        self.decoder = Decoder(config, tp, init, self.layer_numbers, post_process)
        self.output_layer: WeightHolder | None = None
        if post_process and not tied:
            self.output_layer = WeightHolder(init, "output_layer.weight", (config.vocab_size, config.hidden_size),
                                             dim=0)

    def init_weights(self, include: ParamFilter | None = None) -> list[str]:
        """(Re-)initialise the parameters ``include(name, param)`` accepts (default: all, adapters included)
        to their deterministic initial values; returns their names (see
        :func:`~peftckpt.model.deferred.init_parameters`)."""
        return init_parameters(self, include)

    def materialize(self, device: torch.device | str = "cpu", include: ParamFilter | None = None) -> list[str]:
        """Give a chunk built with ``device="meta"`` (adapters and dtype changes may have been applied since)
        this rank's storage, then initialise the parameters ``include`` accepts (default: all); the others
        stay uninitialised until a checkpoint is loaded into them. Returns the names initialised."""
        return materialize(self, device, include)

    def shared_embedding(self) -> nn.Parameter | None:
        """The word embeddings where another pipeline stage holds them too (tied to the output layer with
        PP > 1: the first and the last stage); their gradients must be summed over the two."""
        tied = not self.config.untie_embeddings_and_output_weights
        if not tied or self.embedding is None or self.pre_process == self.post_process:
            return None
        return self.embedding.word_embeddings.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_process:
            assert self.embedding is not None
            x = self.embedding(x)
        x = self.decoder(x)
        if not self.post_process:
            return x
        if self.output_layer is not None:
            w = local_tensor(self.output_layer.weight)
        else:
            assert self.embedding is not None
            w = local_tensor(self.embedding.word_embeddings.weight)
        return base_linear(copy_to_tp(x, self.tp), w)  # column-parallel: this rank's vocabulary rows


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel | None = None,
             vocab_size: int | None = None) -> torch.Tensor:
    """Mean next-token cross entropy (fp32) of the logits a last stage returns: with ``tp``, those of this
    rank's rows of the ``vocab_size`` vocabulary (see :mod:`~peftckpt.model.vocab_parallel`)."""
    if tp is None or tp.size == 1:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    assert vocab_size is not None, "a vocabulary split over TP needs its size"
    return vocab_parallel_cross_entropy(logits, targets, tp, vocab_size).mean()
