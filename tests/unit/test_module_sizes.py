"""The checkpoint package stays navigable: no module in it over 400 lines, and ``Checkpointer`` (the facade every
caller reads first) at most 300 -- orchestration lives in the save and load modules, not in the facade."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKPOINT = Path(__file__).resolve().parents[2] / "src" / "peftckpt" / "checkpoint"
MAX_MODULE_LINES = 400
MAX_CHECKPOINTER_LINES = 300


def test_no_checkpoint_module_is_over_400_lines() -> None:
    sizes = {p.relative_to(CHECKPOINT).as_posix(): len(p.read_text().splitlines()) for p in CHECKPOINT.rglob("*.py")}
    assert len(sizes) > 30  # the package is where this test thinks it is
    too_long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"split these modules (over {MAX_MODULE_LINES} lines): {too_long}"


def test_the_checkpointer_class_is_at_most_300_lines() -> None:
    tree = ast.parse((CHECKPOINT / "api.py").read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Checkpointer"]
    assert cls.end_lineno is not None
    lines = cls.end_lineno - cls.lineno + 1
    assert 50 < lines <= MAX_CHECKPOINTER_LINES, lines
