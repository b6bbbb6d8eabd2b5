"""``peftckpt`` command line: ``train`` / ``eval`` (under torchrun or alone) and the offline checkpoint tools.

The library modules hold no argparse and no text rendering: the commands' parsers and output live in this
package (one module per tool family); the trainer's flags are in :mod:`peftckpt.train.args`."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

__all__ = ["main", "COMMANDS"]

#: command -> (module, function taking argv and returning the exit code, one-line description).
COMMANDS: dict[str, tuple[str, str, str]] = {
    "launch": ("peftckpt.cli.launch", "launch_main",
               "run train/eval on many processes: torchrun's options, the workers' exit code and message"),
    "train": ("peftckpt.cli.train", "train_main", "train a GPT (+ LoRA) with TP x PP x DP; under torchrun for >1 process"),
    "eval": ("peftckpt.train.evaluate", "eval_main", "mean next-token loss of a base (+ adapter) on --data-path"),
    "plot": ("peftckpt.cli.plot", "plot_main", "loss (+ eval loss) and LR of a train --metrics-file as a PNG"),
    "verify": ("peftckpt.cli.verify", "verify_main", "check a checkpoint's files against its manifest"),
    "inspect": ("peftckpt.cli.inspect", "inspect_main",
                "sections, keys, shapes, layout, commit state and sizes of a checkpoint"),
    "import-hf": ("peftckpt.cli.interop", "import_hf_main",
                  "HF Llama model directory -> full torch_dist base checkpoint"),
    "export-hf": ("peftckpt.cli.interop", "export_hf_main",
                  "base (+ adapter merged) -> HF Llama model directory"),
    "export-peft": ("peftckpt.cli.interop", "export_peft_main",
                    "adapter checkpoint -> HF PEFT LoRA adapter directory"),
    "import-peft": ("peftckpt.cli.interop", "import_peft_main",
                    "HF PEFT LoRA adapter directory -> adapter checkpoint for train --load"),
}


def _usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = [f"  {c:<{width}}  {desc}" for c, (_, _, desc) in COMMANDS.items()]
    return ("usage: peftckpt <command> [options]   (peftckpt --version)\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`peftckpt <command> --help` for the options of a command.")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from .. import __version__

        print(f"peftckpt {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"peftckpt: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module, function, _ = COMMANDS[command]
    entry: Callable[[Sequence[str]], int] = getattr(importlib.import_module(module), function)
    try:
        return entry(rest)
    except KeyboardInterrupt:  # Ctrl-C in a one-process tool (an import or export removes what it had written)
        print(f"peftckpt {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
