"""The README's commands work as pasted (issue 16): every ```bash block of README.md runs, in order, in one
shell, in a fresh copy of the repository whose ``.venv`` is this environment, with tiny model flags appended
to each ``train`` and ``eval`` command. ``make`` lines are left out: CI runs those two itself."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from peftckpt.checkpoint.tools.verify import verify_checkpoint

from .cli import TINY, env

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SMALL = {"train": [*TINY, "--train-iters", "4", "--save-interval", "2"], "eval": TINY}


def readme_commands(text: str) -> list[str]:
    """The shell commands of the README's ```bash blocks: continuation lines joined, comments and ``make``
    lines dropped, tiny flags appended to ``peftckpt train``/``eval``."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
            if not line or line.startswith("make "):
                continue
            command = re.search(r"(?:-m peftckpt|peftckpt launch [^#]*?) (train|eval)\b", line)
            if command:
                line = f"{line} {' '.join(SMALL[command.group(1)])}"
            commands.append(line)
    return commands


def _fresh_copy(dst: Path) -> None:
    """The repository's files (tracked and new, as git lists them; everything but build output without git)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                            text=True)
    if listed.returncode == 0 and listed.stdout:
        for rel in listed.stdout.splitlines():
            if (ROOT / rel).is_file():
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / rel, dst / rel)
    else:
        shutil.copytree(ROOT, dst, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".venv", ".git", "runs", "out", "*_out", "__pycache__"))
    (dst / ".venv").symlink_to(Path(sys.prefix))


def test_readme_commands_run_as_pasted(tmp_path: Path) -> None:
    commands = readme_commands((ROOT / "README.md").read_text())
    assert commands[0] == "source .venv/bin/activate"
    assert sum(re.search(r"peftckpt launch .*\btrain\b", c) is not None for c in commands) >= 3 and any(c.startswith("peftckpt verify") for c in commands)
    checkout = tmp_path / "checkout"
    _fresh_copy(checkout)
    script = "set -euo pipefail\n" + "\n".join(f"echo '+ {c[:60]}'\n{c}" for c in commands)
    # PATH as a new shell has it: without this environment's bin, so `source` is what puts torchrun there.
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if Path(p).resolve() != Path(sys.executable).parent.resolve())
    run_env = {**env(), "PATH": path, "PEFTCKPT_CACHE_DIR": str(tmp_path / "cache")}
    try:
        done = subprocess.run(["bash", "-c", script], cwd=checkout, capture_output=True, text=True, timeout=1200,
                              env=run_env)
    finally:  # the S3 section's local server, had the script stopped before its own `stop`
        subprocess.run([sys.executable, "scripts/local_s3.py", "stop", "--port", "9753"], cwd=checkout,
                       capture_output=True, env=run_env)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    for ckpt in ("runs/base", "runs/lora", "runs/lora-hf", "runs/lora-imported", "runs/base-imported"):
        report = verify_checkpoint(checkout / ckpt)
        assert report.ok, (ckpt, report.problems)
    assert (checkout / "out/peft/adapter_model.safetensors").is_file()
    assert (checkout / "out/peft-s3/adapter_model.safetensors").is_file()  # exported from the local S3 server
    assert "OK s3://my-bucket/lora/iter_0000004" in done.stdout
    assert '"loss"' in done.stdout  # eval --json
