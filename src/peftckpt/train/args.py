"""``peftckpt train`` flags (Megatron-LM names) and the validation that runs before any process group.

Every combination that cannot work is refused here with a message naming the flags; the CLI turns that
into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..checkpoint.storage.manifest import Manifest
from ..cli.parsing import FlagParser, HelpFormatter
from ..model.config import (
    ALL_LORA_TARGETS,
    HF_LORA_TARGETS,
    LORA_PART_TARGETS,
    LORA_TARGETS,
    GPTConfig,
    LoRAConfig,
    check_vocab_split,
)
from ..parallel.device import DEVICES
from .checkpoint_flags import add_checkpoint_args, refuse_urls, validate_checkpoint_args
from .errors import ArgumentError
from .logging_flags import add_logging_backend_args, validate_logging_args

if TYPE_CHECKING:
    from ..parallel.dims import ParallelDims

__all__ = ["ArgumentError", "build_parser", "parse_train_args", "model_config", "lora_config", "parallel_dims"]


def _add_model(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden (SwiGLU: per half)")
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--num-query-groups", type=int, default=None, help="KV heads (GQA); default: one per head")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: --seq-length")
    g.add_argument("--vocab-size", type=int, default=512)
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=True,
                   help="fused SwiGLU MLP (one linear_fc1 GEMM for gate and up); --no-swiglu = GELU")
    g.add_argument("--normalization", choices=["RMSNorm", "LayerNorm"], default="RMSNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute"], default="rope")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--untie-embeddings-and-output-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="separate output layer (default); --no-untie-embeddings-and-output-weights ties them")
    g.add_argument("--init-method-std", type=float, default=0.02)


def _add_lora(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (the base is frozen when --lora-rank > 0)")
    g.add_argument("--lora-rank", type=int, default=0, help="0 = no adapters, train every parameter")
    g.add_argument("--lora-alpha", type=float, default=None, help="default: 2 x rank")
    g.add_argument("--lora-dropout", type=float, default=0.0)
    g.add_argument("--lora-target-modules", nargs="+", default=list(LORA_TARGETS), metavar="MODULE",
                   help=f"any of {' '.join(ALL_LORA_TARGETS)}; linear_q/k/v and linear_fc1_gate/up give "
                   "the parts of the fused layers an adapter each, as HF PEFT has; HF PEFT's names "
                   f"({' '.join(HF_LORA_TARGETS)}) are accepted too (default: {' '.join(LORA_TARGETS)})")
    g.add_argument("--lora-layers", nargs="+", type=int, default=None, metavar="N",
                   help="global layer numbers that get adapters (default: all)")
    g.add_argument("--lora-train-params", nargs="+", default=[], metavar="NAME",
                   help="base parameters to keep trainable, e.g. decoder.final_layernorm.weight")


def _add_parallel(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism (data parallel = world / (tp * pp))")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved pipeline: layers per virtual stage")
    g.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to compute: auto is cuda when a GPU is visible (the rank's GPU is LOCAL_RANK; "
                   "NCCL for tensors, gloo for the rest), else cpu (gloo)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard parameters, gradients and optimizer state over data parallel (FSDP2)")


def _add_training(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 = no clipping")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels only (torch.use_deterministic_algorithms), so that a resumed run "
                   "repeats an uninterrupted one bit for bit on GPUs too (CPU runs are deterministic anyway)")
    g.add_argument("--bf16", action="store_true",
                   help="store and compute the frozen base in bf16; trainable parameters (adapters, "
                   "--lora-train-params) and their Adam state stay fp32 (needs --lora-rank > 0)")
    g.add_argument("--fp16", action="store_true", help="not supported (refused): use --bf16")
    g.add_argument("--base-quantization", choices=("none", "nf4"), default="none",
                   help="nf4: hold the frozen base's linear weights in 4-bit NormalFloat (QLoRA: blocks of 64, "
                   "double-quantized scales), quantized once the base is loaded, identically at every layout; "
                   "embeddings, norms and the output layer stay in their dtype (needs --lora-rank > 0)")


def _add_data(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true", help="deterministic synthetic task (no files)")
    g.add_argument("--data-path", default=None, help=".txt or .jsonl ({\"text\": ...} or {\"input_ids\": [...]})")
    g.add_argument("--eval-interval", type=int, default=0, help="0 = no evaluation")
    g.add_argument("--eval-iters", type=int, default=2)
    g.add_argument("--eval-fraction", type=float, default=0.05, help="held-out share of the data for eval")


def _add_logging(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=1)
    g.add_argument("--metrics-file", default=None, help="append one JSON line per iteration")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="live progress line (default: when stdout is a terminal)")
    add_logging_backend_args(g)  # TensorBoard, W&B: see train/logging_flags.py


def build_parser(prog: str = "peftckpt train") -> argparse.ArgumentParser:
    p = FlagParser(prog=prog, description="Train a GPT (optionally with LoRA) with TP x PP x DP.",
                                formatter_class=HelpFormatter)
    for add in (_add_model, _add_lora, _add_parallel, _add_training, _add_data, _add_logging):
        add(p)
    # Checkpoint flags: see train/checkpoint_flags.py.
    add_checkpoint_args(p)
    return p


def model_config(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings, swiglu=args.swiglu,
        normalization=args.normalization, norm_epsilon=args.norm_epsilon,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        init_method_std=args.init_method_std,
    )


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    if args.lora_rank <= 0:
        return None
    alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    return LoRAConfig(rank=args.lora_rank, alpha=alpha, dropout=args.lora_dropout,
                      target_modules=tuple(args.lora_target_modules),
                      layers=None if args.lora_layers is None else tuple(args.lora_layers),
                      train_params=tuple(args.lora_train_params))


def parallel_dims(args: argparse.Namespace, world_size: int) -> ParallelDims:
    from ..parallel.dims import ParallelDims  # torch: not needed to parse flags or print --help

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vpp = 1
    if args.num_layers_per_virtual_pipeline_stage is not None:
        lpv = args.num_layers_per_virtual_pipeline_stage
        if pp < 2:
            raise ArgumentError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        if lpv < 1 or args.num_layers % (pp * lpv):
            raise ArgumentError(
                f"--num-layers ({args.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp}) x "
                f"--num-layers-per-virtual-pipeline-stage ({lpv})"
            )
        vpp = args.num_layers // (pp * lpv)
    return ParallelDims.from_world(world_size, tp, pp, vpp)


def validate(args: argparse.Namespace, world_size: int) -> None:
    """Refuse every flag combination that cannot work (``ArgumentError`` naming the flags)."""
    args.lora_target_modules = [HF_LORA_TARGETS.get(t, t) for t in args.lora_target_modules]  # q_proj -> linear_q
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    try:
        cfg = model_config(args)
        lora_config(args)
        dims = parallel_dims(args, world_size)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if args.lora_rank <= 0:
        given = [flag for flag, value in (
            ("--lora-alpha", args.lora_alpha), ("--lora-layers", args.lora_layers),
            ("--lora-train-params", args.lora_train_params or None), ("--lora-dropout", args.lora_dropout or None),
            ("--lora-target-modules",
             None if list(args.lora_target_modules) == list(LORA_TARGETS) else args.lora_target_modules),
        ) if value is not None]
        if given:
            raise ArgumentError(f"{', '.join(given)} need --lora-rank > 0 (LoRA is off at --lora-rank 0)")
    gate_up = [t for t in args.lora_target_modules if LORA_PART_TARGETS.get(t, ("",))[0] == "linear_fc1"]
    if args.lora_rank > 0 and gate_up and not cfg.swiglu:
        raise ArgumentError(f"--lora-target-modules {' '.join(gate_up)} need --swiglu (a GELU linear_fc1 has "
                            "no gate/up parts); target linear_fc1 instead")
    tp, pp = dims.tp, dims.pp
    if cfg.num_layers % dims.num_stages:
        raise ArgumentError(
            f"--num-layers ({cfg.num_layers}) must be divisible by --pipeline-model-parallel-size ({pp})"
            + (" x virtual stages" if dims.vpp > 1 else "")
        )
    for flag, value in (("--num-attention-heads", cfg.num_attention_heads), ("--num-query-groups", cfg.groups),
                        ("--ffn-hidden-size", cfg.ffn)):
        if value % tp:
            raise ArgumentError(f"{flag} ({value}) must be divisible by --tensor-model-parallel-size ({tp})")
    try:
        check_vocab_split(cfg.vocab_size, tp)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    if args.seq_length > cfg.max_position_embeddings:
        raise ArgumentError(
            f"--seq-length ({args.seq_length}) exceeds --max-position-embeddings ({cfg.max_position_embeddings})"
        )
    if args.micro_batch_size < 1 or args.global_batch_size % (args.micro_batch_size * dims.dp):
        raise ArgumentError(
            f"--global-batch-size ({args.global_batch_size}) must be divisible by --micro-batch-size "
            f"({args.micro_batch_size}) x data-parallel size ({dims.dp})"
        )
    num_micro = args.global_batch_size // (args.micro_batch_size * dims.dp)
    if pp > 1 and num_micro < pp:
        raise ArgumentError(
            f"pipeline parallelism needs at least --pipeline-model-parallel-size ({pp}) micro-batches per step; "
            f"--global-batch-size / (--micro-batch-size x data-parallel size) = {num_micro}"
        )
    if dims.vpp > 1 and num_micro % max(1, num_micro // pp):
        raise ArgumentError(f"interleaved pipeline: {num_micro} micro-batches per step must be a multiple of "
                            f"{max(1, num_micro // pp)} (micro-batches // --pipeline-model-parallel-size)")
    if args.fp16:
        raise ArgumentError("--fp16 is not supported (it would need loss scaling); use --bf16, which stores the "
                            "frozen base in bf16 and keeps the trainable parameters in fp32")
    if args.bf16 and args.lora_rank <= 0:
        raise ArgumentError("--bf16 stores the frozen base in bf16 and keeps trainable parameters in fp32; with "
                            "--lora-rank 0 every parameter trains, so nothing would be bf16: drop --bf16 or "
                            "fine-tune with --lora-rank > 0")
    _check_base_quantization(args, cfg, tp)
    if bool(args.mock_data) == bool(args.data_path):
        raise ArgumentError("pass exactly one of --mock-data and --data-path")
    if args.train_iters < 0:
        raise ArgumentError(f"--train-iters must be >= 0, got {args.train_iters}")
    if args.eval_interval < 0 or args.eval_iters < 1:
        raise ArgumentError("--eval-interval must be >= 0 and --eval-iters >= 1")
    if args.log_interval < 1:
        raise ArgumentError(f"--log-interval must be >= 1, got {args.log_interval}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    validate_checkpoint_args(args)
    validate_logging_args(args)


#: Flags (argparse dests) that describe the architecture: the GPTConfig fields.
MODEL_DESTS = tuple(f.name for f in dataclasses.fields(GPTConfig))
#: LoRA flag dest -> LoRAConfig field.
LORA_DESTS = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
              "lora_target_modules": "target_modules", "lora_layers": "layers", "lora_train_params": "train_params"}
_UNSET = object()


def _given(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The dests the command line sets explicitly (parsed again with every default replaced by a marker)."""
    parser.set_defaults(**{a.dest: _UNSET for a in parser._actions if a.dest != "help"})
    marked = parser.parse_args(argv)
    return {k for k, v in vars(marked).items() if v is not _UNSET}


def _manifest_of(path: str | None) -> Manifest | None:
    """The manifest of the committed checkpoint ``path`` designates, or ``None`` if there is none (yet)."""
    if not path:
        return None
    from ..checkpoint.errors import CheckpointError
    from ..interop.architecture import ArchitectureMismatchError, checked_manifest

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return checked_manifest(path)  # its architecture held to the stored tensors before anything is built
    except ArchitectureMismatchError:
        raise
    except CheckpointError:
        return None  # the load itself reports a missing or bad checkpoint, with its own flag semantics


def _model_config_of(path: str | None, flag: str = "") -> dict[str, Any]:
    """The architecture recorded by a checkpoint's manifest, or given by an HF directory's config.json (which is
    held to its safetensors headers: a directory that does not fit is refused now, before any model is built)."""
    from ..checkpoint.errors import CheckpointFormatError
    from ..interop import HFModelDir, InteropError, is_hf_dir

    if path and is_hf_dir(path):
        try:
            return HFModelDir(path).config.to_dict()
        except InteropError as e:
            raise CheckpointFormatError(f"{flag}: {e}" if flag else str(e)) from None
    manifest = _manifest_of(path)
    return manifest.model_config if manifest is not None else {}


def apply_checkpoint_defaults(args: argparse.Namespace, given: set[str]) -> list[str]:
    """Architecture flags not on the command line come from the manifest of ``--pretrained-checkpoint`` (or
    its ``config.json`` when it is an HF directory; else from ``--load``'s manifest); LoRA flags, when ``--lora-rank`` is not given, from the ``--load`` checkpoint's
    adapter config. Returns one note per source used. A flag given explicitly always wins (and a
    mismatch with the checkpoint is then reported by the load)."""
    notes = []
    args.inherited = {}  # dest -> where its value came from: errors about it say so (see validate)
    for flag, path in (("--pretrained-checkpoint", args.pretrained_checkpoint), ("--load", args.load)):
        config = _model_config_of(path, flag)
        taken = [d for d in MODEL_DESTS if d not in given and d in config]
        if taken:
            for d in taken:
                setattr(args, d, config[d])
                args.inherited[d] = f"{flag} {path}"
            values = ", ".join(_flag_value(d, config[d]) for d in taken)
            notes.append(f"architecture flags from {flag} {path}: {values}")
            break
    mpe = args.inherited.get("max_position_embeddings")
    if mpe is not None and "seq_length" not in given and args.seq_length > args.max_position_embeddings:
        # The default follows the base: a base made for 32 positions trains and evaluates at 32.
        args.seq_length = args.max_position_embeddings
        args.inherited["seq_length"] = f"the max_position_embeddings of {mpe}"
        notes.append(f"--seq-length {args.seq_length}: the longest sequence the base supports (its "
                     f"max_position_embeddings, from {mpe}); the default 64 would exceed it")
    load_manifest = _manifest_of(args.load)
    adapter = load_manifest.adapter_config if load_manifest is not None else None
    if adapter and "lora_rank" not in given:
        for dest, key in LORA_DESTS.items():
            if dest not in given and key in adapter:
                value = adapter[key]
                setattr(args, dest, list(value) if isinstance(value, list | tuple) else value)
                args.inherited[dest] = f"--load {args.load}"
        notes.append(f"LoRA flags from --load {args.load}: rank {args.lora_rank}, targets "
                     f"{' '.join(args.lora_target_modules)}")
    return notes


def _check_base_quantization(args: argparse.Namespace, cfg: GPTConfig, tp: int) -> None:
    """``--base-quantization nf4`` needs a frozen base, and every linear layer's columns on each tensor-parallel
    rank in whole NF4 blocks (and double-quantization groups)."""
    if args.base_quantization == "none":
        return
    if args.lora_rank <= 0:
        raise ArgumentError("--base-quantization nf4 holds the frozen base in 4 bits; with --lora-rank 0 nothing is "
                            "frozen: fine-tune with --lora-rank > 0")
    from ..model import nf4

    heads = cfg.num_attention_heads * cfg.head_dim
    for layer, columns, split, flags in (
            ("linear_qkv/linear_fc1", cfg.hidden_size, 1, "--hidden-size"),
            ("linear_proj", heads, tp, "--hidden-size / --num-attention-heads x heads"),
            ("linear_fc2", cfg.ffn, tp, "--ffn-hidden-size")):
        width = columns // split
        problems = [p for r in range(split) if (p := nf4.shard_problem(columns, r * width, width)) is not None]
        groups = nf4.groups_of(columns)[0]
        if not problems and split > 1 and groups > 1 and groups % split:
            problems = [f"its {groups} double-quantization groups per row cannot be split over {split} ranks"]
        if problems:
            per_rank = f" per --tensor-model-parallel-size {tp} rank" if split > 1 else ""
            raise ArgumentError(f"--base-quantization nf4: the {layer} input ({flags}: {columns} columns, {width}"
                                f"{per_rank}) does not fit NF4: {problems[0]}")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _flag_value(dest: str, value: Any) -> str:
    """``dest`` = ``value`` as it would be typed: ``--hidden-size 32``, ``--swiglu`` / ``--no-swiglu``."""
    if isinstance(value, bool):
        return _flag(dest) if value else "--no-" + dest.replace("_", "-")
    return f"{_flag(dest)} {value}"


def with_sources(error: ArgumentError, args: argparse.Namespace) -> ArgumentError:
    """``error`` with where each value it names came from, for the flags the user did not type (taken from a
    checkpoint: :func:`apply_checkpoint_defaults`), so no message is about a value the user never saw."""
    inherited: dict[str, str] = getattr(args, "inherited", {})
    named = [d for d in inherited if re.search(re.escape(_flag(d)) + r"\b", str(error))]
    if not named:
        return error
    sources = "; ".join(f"{_flag(d)} {getattr(args, d)} came from {inherited[d]}" for d in named)
    return ArgumentError(f"{error} ({sources}; pass the flag to override)")


def parse_train_args(argv: Sequence[str] | None, world_size: int,
                     parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse and validate; raises :class:`ArgumentError` (argparse's own errors exit 2 by themselves).

    ``args.checkpoint_defaults`` lists which flags were taken from checkpoint manifests, and notes on checkpoint
    flags that work but likely not as meant (printed at start by rank 0)."""
    parser = parser or build_parser()
    args = parser.parse_args(argv)
    refuse_urls(args)
    args.checkpoint_defaults = apply_checkpoint_defaults(args, _given(parser, argv))
    if args.save_trainable_params_only and args.lora_rank == 0:
        args.checkpoint_defaults.append("--save-trainable-params-only without LoRA (--lora-rank 0): every parameter "
                                        "trains, so each checkpoint holds the whole model")
    try:
        validate(args, world_size)
    except ArgumentError as e:
        raise with_sources(e, args) from None
    return args
