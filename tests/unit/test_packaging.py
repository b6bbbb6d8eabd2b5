"""What a library user installs: typed exports (``py.typed``; the lazy exports are seen by type checkers), and the
command line's version."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

import peftckpt
from peftckpt.cli import main


def test_version(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"peftckpt {peftckpt.__version__}\n"


def test_type_checkers_see_the_exports(tmp_path: Path) -> None:
    assert resources.files("peftckpt").joinpath("py.typed").is_file()
    probe = tmp_path / "probe.py"
    probe.write_text("import peftckpt\n\nwrong: int = peftckpt.Checkpointer\nalso: int = peftckpt.SaveOptions()\n"
                     "fine: peftckpt.LoadOptions = peftckpt.LoadOptions(verify_base=False)\n")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--follow-imports=silent", str(probe)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    out = proc.stdout
    assert 'expression has type "type[Checkpointer]", variable has type "int"' in out, out
    assert 'expression has type "SaveOptions", variable has type "int"' in out, out
    assert "Found 2 errors" in out, out  # the typed LoadOptions line checks
