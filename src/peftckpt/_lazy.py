"""Lazy package exports: a package names what it offers, and a name's module is imported on first use.

So importing one light submodule (``peftckpt.model.config``, say) does not import every module of its package,
and the command line's ``--help`` never imports torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose ``exports`` map each name to its submodule
    (relative, e.g. ``".gpt"``)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
