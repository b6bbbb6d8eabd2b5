"""The package's modules import each other without cycles -- every import counts: module-level ones, those under
``TYPE_CHECKING`` and those inside functions (run later, they still make two modules depend on each other) -- so
any module can be imported first and the layers read top-down. One kind of edge is containment, not dependency: a
package's ``__init__`` naming its own submodules (the lazy re-exports of :mod:`peftckpt._lazy`, typed for type
checkers under ``TYPE_CHECKING``); every submodule still depends on its parent packages."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in the module, wherever it is."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def import_graph() -> dict[str, set[str]]:
    """``{module: the peftckpt modules it imports, anywhere in it}`` (parent packages included)."""
    files = {_module_name(p): p for p in (SRC / "peftckpt").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if _is_package(path) else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bases = [a.name for a in node.names]
                subs: list[str] = []
            else:
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                bases = [base]
                subs = [f"{base}.{a.name}" for a in node.names]
            for target in bases + subs:
                if target in files:
                    parts = target.split(".")
                    targets |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & set(files)
        if _is_package(path):  # its own submodules: the lazy re-exports (see the module docstring)
            targets = {t for t in targets if not t.startswith(name + ".")}
        graph[name] = targets - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycles() -> None:
    graph = import_graph()
    assert "peftckpt.checkpoint.save" in graph and "peftckpt.checkpoint.storage.formats" in graph["peftckpt.checkpoint.save"]
    assert "peftckpt.checkpoint.location.base" in graph["peftckpt.checkpoint.location.store"]
    # a function-level import and a TYPE_CHECKING one are edges too
    assert "peftckpt.checkpoint.location.locate" in graph["peftckpt.train.checkpoint_flags"]
    assert "peftckpt.checkpoint.location.base" in graph["peftckpt.train.checkpoint_flags"]
    cycle = _cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_check_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
