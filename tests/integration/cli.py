"""Helpers for tests that run the ``peftckpt`` CLI as a user does (torchrun or a plain process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

TINY = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "64", "--vocab-size", "128", "--seq-length", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--mock-data", "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval", "100"]


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONWARNINGS"] = "ignore"
    return e


def peftckpt(args: list[str], nproc: int = 0, cwd: Path | None = None, check: bool = True,
             extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``peftckpt ARGS`` -- under ``torchrun --nproc-per-node N`` when ``nproc > 0``."""
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "peftckpt", *args]
    else:
        cmd = [sys.executable, "-m", "peftckpt", *args]
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


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
