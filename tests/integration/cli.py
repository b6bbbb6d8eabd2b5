"""Helpers for tests that run the ``peftckpt`` CLI as a user does (torchrun or a plain process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from peftckpt.checkpoint.location.directory import list_committed, read_tracker
from peftckpt.checkpoint.tools.verify import verify_checkpoint

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "64", "--vocab-size", "128", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--mock-data", "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "100",
        "--device", "cpu"]
"""The tiny model of the CLI tests, on the device named explicitly (the code is device-generic: on a GPU machine
``auto`` would pick CUDA)."""


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONWARNINGS"] = "ignore"
    return e


def _command(args: list[str], nproc: int, launcher: str) -> list[str]:
    """``peftckpt ARGS``, under ``torchrun --nproc-per-node N`` (or ``peftckpt launch``) when ``nproc > 0``."""
    if not nproc:
        return [sys.executable, "-m", "peftckpt", *args]
    if launcher == "peftckpt":
        return [sys.executable, "-m", "peftckpt", "launch", "--nproc-per-node", str(nproc), *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "peftckpt", *args]


def peftckpt(args: list[str], nproc: int = 0, cwd: Path | None = None, check: bool = True,
             extra_env: dict[str, str] | None = None, launcher: str = "torchrun") -> subprocess.CompletedProcess[str]:
    """``peftckpt ARGS`` -- under ``torchrun --nproc-per-node N`` when ``nproc > 0`` (``launcher="peftckpt"``:
    under ``peftckpt launch``)."""
    cmd = _command(args, nproc, launcher)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd,
                          env={**env(), **(extra_env or {})})
    if check and proc.returncode != 0:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"peftckpt-failure-{os.getpid()}-{len(args)}.log"
        log.write_text(f"{cmd}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        raise AssertionError(f"(full output: {log}) "
                             f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def train_records(path: Path) -> list[dict[str, Any]]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def read_dcp_tensors(ckpt: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint as a full global tensor, with plain ``torch.distributed.checkpoint``."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
          if isinstance(m, TensorStorageMetadata) and k.startswith(prefix)}
    dcp.load(sd, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    return sd


def assert_runs_alike(root: Path, names: list[str], iteration: int, reference: str = "local") -> None:
    """The checkpoints ``root/<name>/iter_<iteration>`` of runs ``names`` hold the same tensors as ``reference``'s
    (adapters and Adam moments, bit for bit) and all record one base fingerprint."""
    iteration_dir = f"iter_{iteration:07d}"
    expected = read_dcp_tensors(root / reference / iteration_dir)
    assert any(k.startswith("optimizer.") for k in expected)
    for name in names:
        other = read_dcp_tensors(root / name / iteration_dir)
        assert expected.keys() == other.keys(), name
        for k in expected:
            assert torch.equal(expected[k], other[k]), (name, k)
    fingerprints = {json.loads((root / name / iteration_dir / "metadata.json").read_text())["base_fingerprint"]
                    for name in [reference, *names]}
    assert len(fingerprints) == 1, fingerprints


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def until(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def launch(args: list[str], log: Path, nproc: int = 0, launcher: str = "torchrun") -> subprocess.Popen[bytes]:
    """Start ``peftckpt ARGS`` in the background (as :func:`peftckpt` runs it), its output in ``log`` (a file,
    not a pipe: orphaned workers holding a pipe open would block the test instead of failing it)."""
    with open(log, "wb") as out:
        return subprocess.Popen(_command(args, nproc, launcher), stdout=out, stderr=subprocess.STDOUT, env=env())


def no_worker_traceback(stderr: str, nproc: int) -> None:
    """No traceback from a worker; under torchrun only the launcher's own (its ChildFailedError report when a
    worker failed, its SignalException when it was signalled itself)."""
    assert "peftckpt/" not in "".join(line for line in stderr.splitlines() if line.startswith("  File")), stderr
    assert stderr.count("Traceback") == (1 if nproc else 0), stderr


def all_committed_verify(save: Path) -> None:
    committed = list_committed(save)
    assert committed and read_tracker(save) in committed
    for it in committed:
        report = verify_checkpoint(save / f"iter_{it:07d}")
        assert report.ok, report.problems
