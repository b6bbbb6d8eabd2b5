"""Command lines of the interop tools: ``peftckpt import-hf | export-hf | export-peft | import-peft``.

Parsing comes first (``--help`` imports no torch). Exit codes: 0 done, 1 a refused input (one message naming the file, key or flag; nothing written), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..checkpoint.errors import CheckpointError
from ..checkpoint.location.urls import local_only_problem, url_problem
from .parsing import FlagParser, HelpFormatter, print_error

__all__ = ["import_hf_main", "export_hf_main", "export_peft_main", "import_peft_main"]


def _run(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str], action: Any) -> int:
    """Parse (``--help`` imports no torch), then run ``action`` on the flags: its result is printed, an input it
    refuses is one ``error:`` line and exit 1."""
    args = parser.parse_args(list(argv))
    from ..interop import commands
    from ..interop.hf_llama import InteropError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's single-process notices
            result = action(args, commands)
    except (InteropError, CheckpointError) as e:
        print_error(f"peftckpt {prog}", e)
        return 1
    print(result)
    return 0


def local_path(value: str) -> str:
    """An argparse ``type`` for a path that must be local: a URL (``s3://...``) is a usage error, not a directory
    ``s3:``."""
    problem = local_only_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{value} {problem}")
    return value


def checkpoint_location(value: str) -> str:
    """An argparse ``type`` for a checkpoint to read: a local path or a URL of a supported object store."""
    problem = url_problem(value)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{value} {problem}")
    return value


def _parser(command: str, description: str, source: str, source_help: str | None = None,
            checksums: bool = True) -> argparse.ArgumentParser:
    """A tool's parser with its two positionals (what it reads, the new directory it writes) and, for tools
    that read a checkpoint, ``--no-verify-checksums``."""
    p = FlagParser(prog=f"peftckpt {command}", description=description, formatter_class=HelpFormatter)
    p.add_argument(source.lower(), metavar=source, type=checkpoint_location if source == "CKPT" else local_path,
                   help=source_help)
    if source in ("HF_DIR", "PEFT_DIR"):  # an import writes a checkpoint: local, or on an object store
        p.add_argument("out", metavar="OUT", type=checkpoint_location,
                       help="new save directory (must not exist or be empty), or an empty s3:// location")
    else:
        p.add_argument("out", metavar="OUT", type=local_path, help="new directory (must not exist or be empty)")
    if checksums:
        p.add_argument("--no-verify-checksums", action="store_true", help="do not re-hash the checkpoint's files")
    return p


def import_hf_main(argv: Sequence[str]) -> int:
    p = _parser("import-hf", "Convert an HF Llama model directory (config.json + safetensors, sharded or not) into "
                "a full torch_dist base checkpoint, usable as --pretrained-checkpoint at any TP/PP. `train` reads the "
                "architecture from it.", "HF_DIR", checksums=False)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="store the base in this dtype (default: each tensor's dtype in the HF files)")
    p.add_argument("--base-quantization", choices=["none", "nf4"], default="none",
                   help="nf4: store the linear weights in 4-bit NormalFloat, quantized as they are written (exactly "
                   "what train --base-quantization nf4 makes of the full-precision base; a quarter of its size), "
                   "for train --base-quantization nf4")
    return _run("import-hf", p, argv, lambda a, ops: (
        f"imported {a.hf_dir} -> "
        f"{ops.import_hf(a.hf_dir, a.out, _dtype(a.dtype) if a.dtype else None, a.base_quantization)}"))


def import_peft_main(argv: Sequence[str]) -> int:
    p = _parser("import-peft", "Convert an HF PEFT LoRA adapter (targets among q/k/v/o/gate/up/down_proj) into an "
                "adapter-only checkpoint (iteration 0, per-projection adapters) that `train --load` resumes from.",
                "PEFT_DIR")
    p.add_argument("--base", required=True, type=checkpoint_location, help="the base the adapter belongs to: an HF Llama directory or a full "
                   "checkpoint (see import-hf)")
    return _run("import-peft", p, argv, lambda a, ops: (
        f"imported {a.peft_dir} -> {ops.import_peft(a.peft_dir, a.out, a.base, not a.no_verify_checksums)}"))


def export_peft_main(argv: Sequence[str]) -> int:
    p = _parser("export-peft", "Export the LoRA adapter of a checkpoint (saved at any layout) as an HF PEFT adapter "
                "directory (adapter_model.safetensors + adapter_config.json) for peft.PeftModel.from_pretrained.",
                "CKPT", "save directory or checkpoint directory (or its s3:// URL)")
    p.add_argument("--base-model-name-or-path", default=None, help="recorded in adapter_config.json (default: the "
                   "HF directory the base came from, when the checkpoint's records name one)")
    def action(a: argparse.Namespace, ops: Any) -> str:
        out = ops.export_peft(a.ckpt, a.out, a.base_model_name_or_path, not a.no_verify_checksums)
        base = json.loads((out / "adapter_config.json").read_text()).get("base_model_name_or_path")
        return f"exported {out} (base_model_name_or_path: " + (
            f"{base})" if base else "unknown; pass --base-model-name-or-path to record it)")

    return _run("export-peft", p, argv, action)


def export_hf_main(argv: Sequence[str]) -> int:
    p = _parser("export-hf", "Export a checkpoint as an HF Llama model directory, LoRA adapters merged into the "
                "weights. An adapter-only checkpoint needs its base (--base, default: the --pretrained-checkpoint it "
                "was trained on).", "CKPT", "save directory or checkpoint directory (or its s3:// URL)")
    p.add_argument("--base", default=None, type=checkpoint_location, help="the base of an adapter-only CKPT: a full checkpoint or an HF "
                   "Llama directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--no-verify-base", action="store_true", help="merge even if the base fingerprint differs")
    p.add_argument("--eval-data", default=None, type=local_path, metavar="FILE",
                   help="then evaluate the model as trained (a QLoRA adapter on its NF4 base) and the merged export "
                   "on FILE (a --data-path file of train), in this process, and report how far their losses are")
    p.add_argument("--eval-seq-length", type=int, default=None, metavar="N",
                   help="sample length of --eval-data (default: the --seq-length the checkpoint was trained with)")

    def export(a: Any, ops: Any) -> str:
        if a.eval_data and not Path(a.eval_data).is_file():
            from ..interop.hf_llama import InteropError

            raise InteropError(f"--eval-data {a.eval_data} is not a file; nothing was written")
        notes: list[str] = []
        out = ops.export_hf(a.ckpt, a.out, a.base, not a.no_verify_base, not a.no_verify_checksums, _dtype(a.dtype),
                            report=notes)
        if a.eval_data:
            notes.append(_eval_note(a, out))
        return "\n".join([f"exported {out}", *notes])

    return _run("export-hf", p, argv, export)


def _eval_note(a: Any, out: Any) -> str:
    """``--eval-data``: the losses of the trained and the merged model (:mod:`peftckpt.cli.merge_eval`); an
    evaluation the flags do not allow is said, the export kept."""
    from ..train.args import ArgumentError
    from .merge_eval import eval_report

    try:
        return eval_report(a.ckpt, a.base, out, a.eval_data, a.eval_seq_length)
    except (ArgumentError, CheckpointError) as e:
        return f"exported, but not evaluated: {e}"


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)
