"""The library's words, said in the trainer's flags.

The library's errors and warnings name its own parameters (``SaveOptions(trainable_only=True)``,
``LoadOptions(verify_base=False)``, ``load_pretrained``, ``adapter_config['rank']``); a user of ``peftckpt train``
typed flags, so the trainer says the same things in flags (:func:`in_flag_terms`) before printing them: errors
(:func:`in_flag_terms_error`) and warnings (:func:`say_warnings_in_flag_terms`, one line each, no source line).
"""

from __future__ import annotations

import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["FLAG_WORDS", "in_flag_terms", "in_flag_terms_error", "say_warnings_in_flag_terms"]

FLAG_WORDS: list[tuple[str, str]] = [
    (r"SaveOptions\(trainable_only=True\)", "--save-trainable-params-only"),
    (r"SaveOptions\(save_optim=False\)", "--no-save-optim"),
    (r"ckpt_format '(torch_dist|torch)'", r"--ckpt-format \1"),
    (r"\(a distributed optimizer\)", "(--use-distributed-optimizer)"),
    (r"LoadOptions\(verify_checksums=False\)", "--no-verify-checksums"),
    (r"Checkpointer\.load\('([^'\n]*)'\)", r"--load \1"),
    (r"Checkpointer\.load\(\"([^\"\n]*)\"\)", r"--load \1"),
    (r"LoadOptions\(verify_base=False\)", "--no-verify-base"),
    (r"LoadOptions\(load_optim=False\)", "--no-load-optim"),
    (r"LoadOptions\.strictness = ", "--dist-ckpt-strictness "),
    (r"\(keep_last_k\)", "(--keep-last-k)"),
    (r"load the base it was trained on \(load_pretrained\)", "load the matching --pretrained-checkpoint"),
    (r"the base \(load_pretrained\)", "--pretrained-checkpoint"),
    (r"load_pretrained: ", "--pretrained-checkpoint "),
    (r"Load it with Checkpointer\.load instead", "Pass it as --load instead"),
    (r"adapter_config\['rank'\]", "rank (--lora-rank)"),
    (r"adapter_config\['alpha'\]", "alpha (--lora-alpha)"),
    (r"adapter_config\['target_modules'\]", "target_modules (--lora-target-modules)"),
    (r"adapter_config\['layers'\]", "layers (--lora-layers)"),
    (r"adapter_config\['train_params'\]", "train_params (--lora-train-params)"),
    (r"make the adapter_config match the checkpoint's",
     "fix those flags to match the checkpoint, or leave the LoRA flags out to take the checkpoint's"),
    (r"hold the base the way the checkpoint's was \(model_config\['base_quantization'\]\)",
     "pass the --base-quantization it was trained with"),
    (r"fix the model configuration to match", "fix the model flags to match"),
    (r"the model \(its configuration and adapters\) must match",
     "the model flags (architecture, --lora-rank, --lora-target-modules) must match"),
    (r"or save to another (directory|location)", r"or pass another --save \1"),
]
"""``(library words as a regular expression, the trainer's words)``, applied in order."""

_COMPILED = [(re.compile(pattern), words) for pattern, words in FLAG_WORDS]


def in_flag_terms(text: str) -> str:
    """``text`` (a library message) with the library's parameters named by the trainer's flags."""
    for pattern, words in _COMPILED:
        text = pattern.sub(words, text)
    return text


def in_flag_terms_error(e: BaseException) -> BaseException:
    """``e`` with its message in flag terms (in place; the same object, its type and attributes kept)."""
    if e.args and isinstance(e.args[0], str):
        e.args = (in_flag_terms(e.args[0]), *e.args[1:])
    return e


@contextmanager
def say_warnings_in_flag_terms(prog: str) -> Iterator[None]:
    """While the body runs, the library's warnings are printed as ``<prog>: warning: <message in flag terms>``, one
    line each (no file, line number or source line); other warnings as Python prints them."""
    shown = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if "peftckpt" in filename.replace("\\", "/").split("/"):
            print(f"{prog}: warning: {in_flag_terms(str(message))}", file=sys.stderr if file is None else file)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown
