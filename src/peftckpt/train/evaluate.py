"""``peftckpt eval``: mean next-token loss of a model (base + optional adapter) on a data file, at any TP/PP.

It takes the ``train`` flags that define the model, layout and data. The architecture (and the LoRA
config of an adapter given as ``--load``) default to what the checkpoints' manifests record, so::

    torchrun --nproc-per-node 4 -m peftckpt eval --pretrained-checkpoint base --load lora \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --data-path val.jsonl --json

Steps of :func:`evaluate`:
    1. Build the model chunks of this rank (as ``train`` does) and load ``--pretrained-checkpoint`` (model
       only), then ``--load`` (model only; an adapter's base fingerprint is checked).
    2. Cut the whole file (no held-out split) into samples of ``--seq-length + 1`` tokens, in file order.
    3. Forward every complete global batch; the loss is the mean over all their target tokens.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any

from ..checkpoint.checks.strictness import StrictHandling
from ..checkpoint.errors import CheckpointError
from ..cli.parsing import say_once
from .args import ArgumentError, build_parser, parse_train_args

__all__ = ["evaluate", "eval_main"]


def evaluate(args: argparse.Namespace, world_size: int, rank: int) -> dict[str, Any]:
    """Steps 1-3 of the module docstring; returns the JSON report (on every rank)."""
    from ..checkpoint.api import LoadOptions
    from .checkpointing import TrainerCheckpointing
    from .trainer import Trainer

    args.eval_fraction = 0.0
    trainer = Trainer(args, world_size, rank)
    checkpointing = TrainerCheckpointing(trainer)
    ckpt = checkpointing.ckpt
    loaded: dict[str, str] = {}
    verify = not args.no_verify_checksums
    if args.pretrained_checkpoint:
        loaded["pretrained_checkpoint"] = checkpointing.load_base(args.pretrained_checkpoint,
                                                                  LoadOptions(verify_checksums=verify,
                                                                              base_cache=not args.no_base_cache))
    checkpointing.quantize_base()
    if args.load:
        res = ckpt.load(args.load, LoadOptions(load_optim=False, load_rng=False, verify_checksums=verify,
                                               verify_base=not args.no_verify_base,
                                               strictness=StrictHandling(args.dist_ckpt_strictness)))
        loaded["load"] = str(res.path)
    data = trainer.train_data
    batch = args.global_batch_size
    num_batches = len(data) // batch
    if num_batches == 0:
        raise ArgumentError(f"{data.source} has {len(data)} samples of --seq-length {args.seq_length}, fewer "
                            f"than one --global-batch-size ({batch})")
    losses = [trainer.eval_batch(data.gather(range(i * batch, (i + 1) * batch))) for i in range(num_batches)]
    return {
        "loss": sum(losses) / len(losses), "samples": num_batches * batch, "samples_in_file": len(data),
        "tokens": num_batches * batch * args.seq_length, "seq_length": args.seq_length,
        "layout": trainer.dims.to_dict(), **loaded,
    }


def eval_main(argv: Sequence[str]) -> int:
    parser = build_parser(prog="peftckpt eval")
    parser.description = ("Mean next-token loss of a model (--pretrained-checkpoint and/or --load, e.g. a base "
                          "plus an adapter) on --data-path, at any TP/PP. Training flags are accepted and ignored.")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        args = parse_train_args(list(argv), world_size, parser)
        if not (args.pretrained_checkpoint or args.load):
            raise ArgumentError("peftckpt eval needs --pretrained-checkpoint and/or --load (a model to evaluate)")
    except ArgumentError as e:
        say_once("peftckpt eval", e, rank, world_size)
        return 2
    except CheckpointError as e:  # a base or checkpoint whose architecture contradicts its files
        say_once("peftckpt eval", e, rank, world_size)
        return 1
    def body() -> None:
        report = evaluate(args, world_size, rank)
        if rank != 0:
            return
        if args.json:
            print(json.dumps(report, sort_keys=True))
        else:
            dropped = report["samples_in_file"] - report["samples"]
            tail = f" ({dropped} trailing samples, less than a global batch, left out)" if dropped else ""
            print(f"eval loss {report['loss']:.6f} over {report['samples']} samples "
                  f"({report['tokens']} tokens){tail}")

    from .run import exit_multi_rank, run_with_process_group  # torch: only once the flags are valid

    return exit_multi_rank(run_with_process_group(body, world_size, rank, "eval", args.device), world_size)
