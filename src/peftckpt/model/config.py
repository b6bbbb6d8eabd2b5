"""Architecture configuration of the GPT decoder and of its LoRA adapters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GPTConfig", "LoRAConfig", "LORA_TARGETS", "LORA_PART_TARGETS", "ALL_LORA_TARGETS", "HF_LORA_TARGETS"]

#: Linear layers LoRA can be attached to, by their Megatron module name (one adapter per fused GEMM).
LORA_TARGETS: tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

#: Parts of the fused layers that take an adapter of their own ("canonical" LoRA, as HF PEFT's separate
#: q/k/v_proj and gate/up_proj): target -> (fused layer, part).
LORA_PART_TARGETS: dict[str, tuple[str, str]] = {
    "linear_q": ("linear_qkv", "q"), "linear_k": ("linear_qkv", "k"), "linear_v": ("linear_qkv", "v"),
    "linear_fc1_gate": ("linear_fc1", "gate"), "linear_fc1_up": ("linear_fc1", "up"),
}
ALL_LORA_TARGETS: tuple[str, ...] = LORA_TARGETS + tuple(LORA_PART_TARGETS)

#: HF PEFT's names of the Llama projections, accepted as aliases of the targets above.
HF_LORA_TARGETS: dict[str, str] = {
    "q_proj": "linear_q", "k_proj": "linear_k", "v_proj": "linear_v", "o_proj": "linear_proj",
    "gate_proj": "linear_fc1_gate", "up_proj": "linear_fc1_up", "down_proj": "linear_fc2",
}


@dataclass(frozen=True)
class GPTConfig:
    """A Llama-style (by default) GPT decoder. Field names follow Megatron-LM's flags."""

    num_layers: int = 4
    """Number of transformer layers (``--num-layers``)."""
    hidden_size: int = 64
    """Model width (``--hidden-size``)."""
    num_attention_heads: int = 4
    """Query heads (``--num-attention-heads``)."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; ``None`` = one per query head (``--num-query-groups``)."""
    ffn_hidden_size: int | None = None
    """MLP width; ``None`` = 4 x hidden (``--ffn-hidden-size``). With SwiGLU this is the width of gate and of up."""
    vocab_size: int = 512
    """Embedding rows (``--vocab-size``)."""
    max_position_embeddings: int = 128
    """Longest sequence the position encoding supports (``--max-position-embeddings``)."""
    swiglu: bool = True
    """Fused SwiGLU MLP (one ``linear_fc1`` GEMM for gate and up) instead of GELU (``--swiglu``)."""
    normalization: str = "RMSNorm"
    """``RMSNorm`` or ``LayerNorm`` (``--normalization``)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers (``--norm-epsilon``)."""
    position_embedding_type: str = "rope"
    """``rope`` (rotary) or ``learned_absolute`` (``--position-embedding-type``)."""
    rotary_base: float = 10000.0
    """RoPE base frequency (``--rotary-base``)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate ``output_layer`` instead of reusing the word embeddings (``--untie-embeddings-and-output-weights``)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights (``--init-method-std``)."""

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def groups(self) -> int:
        assert self.num_query_groups is not None  # set in __post_init__
        return self.num_query_groups

    @property
    def ffn(self) -> int:
        assert self.ffn_hidden_size is not None  # set in __post_init__
        return self.ffn_hidden_size

    @property
    def qkv_size(self) -> int:
        """Output width of the fused QKV projection: queries plus one key and one value per group."""
        return (self.num_attention_heads + 2 * self.groups) * self.head_dim

    def validate(self) -> None:
        """Raise ``ValueError`` naming the flag of the first inconsistent field."""
        positive = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
                f"({self.num_attention_heads})"
            )
        if self.head_dim % 2 and self.position_embedding_type == "rope":
            raise ValueError(f"rotary embeddings need an even head dim, got {self.head_dim} (--hidden-size / heads)")
        if self.groups <= 0 or self.num_attention_heads % self.groups:
            raise ValueError(
                f"--num-attention-heads ({self.num_attention_heads}) must be divisible by --num-query-groups "
                f"({self.num_query_groups})"
            )
        if self.ffn <= 0:
            raise ValueError(f"--ffn-hidden-size must be positive, got {self.ffn_hidden_size}")
        if self.normalization not in ("RMSNorm", "LayerNorm"):
            raise ValueError(f"--normalization must be RMSNorm or LayerNorm, got {self.normalization!r}")
        if self.position_embedding_type not in ("rope", "learned_absolute"):
            raise ValueError(
                f"--position-embedding-type must be rope or learned_absolute, got {self.position_embedding_type!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def check_vocab_split(vocab_size: int, tp_size: int) -> None:
    """``ValueError`` naming the flags unless every TP rank gets rows of the (vocab-parallel) embedding table
    (``torch.chunk`` semantics: ``ceil(vocab / tp)`` rows per rank, the last ranks the rest)."""
    if tp_size > 1 and -(-vocab_size // tp_size) * (tp_size - 1) >= vocab_size:
        raise ValueError(f"--vocab-size ({vocab_size}) is too small to split over --tensor-model-parallel-size "
                         f"({tp_size}): every rank needs rows of the embedding table")


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the named linear layers of every (or the listed) transformer layer."""

    rank: int = 8
    """Adapter rank r (``--lora-rank``)."""
    alpha: float = 16.0
    """Scaling numerator: the adapter output is multiplied by alpha / r (``--lora-alpha``)."""
    dropout: float = 0.0
    """Dropout on the adapter input (``--lora-dropout``)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Which linear layers get an adapter (``--lora-target-modules``): whole layers (``linear_qkv``, ...) or
    parts of the fused ones (``linear_q``, ``linear_fc1_gate``, ...; see ``LORA_PART_TARGETS``)."""
    layers: tuple[int, ...] | None = None
    """Global layer numbers that get adapters; ``None`` = all (``--lora-layers``)."""
    train_params: tuple[str, ...] = field(default_factory=tuple)
    """Extra base parameters (full names) left trainable, e.g. ``decoder.final_layernorm.weight``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "train_params", tuple(self.train_params))
        if self.rank <= 0:
            raise ValueError(f"--lora-rank must be positive, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.target_modules if t not in ALL_LORA_TARGETS]
        if unknown:
            raise ValueError(
                f"--lora-target-modules: unknown target(s) {unknown}; choose from {list(ALL_LORA_TARGETS)} "
                f"(or HF PEFT's names {list(HF_LORA_TARGETS)})"
            )
        for t in self.target_modules:
            if t in LORA_PART_TARGETS and LORA_PART_TARGETS[t][0] in self.target_modules:
                raise ValueError(f"--lora-target-modules: {t} is a part of {LORA_PART_TARGETS[t][0]}; "
                                 "adapt the whole layer or its parts, not both")
        if not self.target_modules:
            raise ValueError("--lora-target-modules must name at least one module")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_modules"] = list(self.target_modules)
        d["layers"] = None if self.layers is None else list(self.layers)
        d["train_params"] = list(self.train_params)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoRAConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
