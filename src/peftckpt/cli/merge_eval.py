"""``export-hf --eval-data FILE``: how far the merged model's loss is from the loss of the model that was trained.

A merge changes the model when the adapter was trained on a base held otherwise than the weights it is merged
into -- a QLoRA adapter learned to correct the NF4 base, and is merged into the full-precision one -- so the
export evaluates both on the same file, in this process, with ``peftckpt eval``'s evaluator: the trained model
(the base as the run held it, ``--base-quantization`` included, plus the adapter) and the exported directory.

Memory: one model at a time, the merged one in fp32 (the evaluator computes a base without adapters in fp32).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

from ..checkpoint.location.locate import manifest_at

__all__ = ["eval_report"]


def _loss(argv: list[str]) -> dict[str, Any]:
    """``peftckpt eval``'s report of ``argv``, run here; the evaluator's progress lines are not the export's."""
    from ..train.args import build_parser, parse_train_args
    from ..train.evaluate import evaluate

    args = parse_train_args(argv, 1, build_parser(prog="peftckpt export-hf"))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return evaluate(args, 1, 0)


def eval_report(ckpt: str, base: str | None, merged: Path, data: str, seq_length: int | None) -> str:
    """One line: the mean next-token loss on ``data`` of the model ``ckpt`` trained (on ``base``, or the base its
    records name) and of the ``merged`` export, and their difference. Raises ``ArgumentError`` (a flag's value
    the evaluator refuses) or ``CheckpointError``."""
    from ..interop.nf4_base import is_nf4

    manifest = manifest_at(ckpt)
    trained_args = manifest.args or {}
    seq = seq_length or int(trained_args.get("seq_length") or 0) or None
    common = ["--data-path", data, "--micro-batch-size", "1", "--global-batch-size", "1", "--device", "cpu",
              "--no-progress", "--log-interval", "1000000"]
    if seq is not None:
        common += ["--seq-length", str(seq)]
    trained = ["--load", ckpt, *common]
    base = base or trained_args.get("pretrained_checkpoint")
    if base and not manifest.holds_every_weight:
        trained += ["--pretrained-checkpoint", str(base)]
    held: list[str] = []
    if is_nf4(manifest.model_config):
        trained += ["--base-quantization", "nf4"]
        held.append("base in NF4")
    if trained_args.get("bf16"):
        trained.append("--bf16")
        held.append("computed in bf16")
    label = "the model as trained" + (f" ({', '.join(held)})" if held else "")
    before = _loss(trained)
    after = _loss(["--pretrained-checkpoint", str(merged), *common])
    diff = after["loss"] - before["loss"]
    return (f"eval loss on {data} ({before['samples']} samples of {before['seq_length']} tokens): {label} "
            f"{before['loss']:.6f}, merged {after['loss']:.6f} ({diff:+.6f}, {100 * diff / before['loss']:+.3f} %)")
