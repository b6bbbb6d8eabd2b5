"""End-to-end ``peftckpt train``: a real torchrun launch (TP=2 x PP=2, LoRA, mock data) and a --data-path run."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ITERS = 25
MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lora-rank", "4"]
LOG_LINE = re.compile(r"^iteration +(\d+)/(\d+) \| loss (\d+\.\d{6}) \| lr \S+ \| grad norm \S+ \| \S+ tokens/s$")
TRAIN_KEYS = {"iteration": int, "loss": float, "lr": float, "grad_norm": float, "tokens_per_s": float}


def _env() -> dict[str, str]:
    # The children must not inherit a torchrun environment from an outer launcher.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    # stdout is a pipe, not a terminal: the trainer must print plain log lines, not a progress bar.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=cwd, env=_env())


def _records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert len(train) + len(evals) == len(records), records
    return train, evals


def _check_train_records(train: list[dict[str, Any]], iters: int) -> None:
    assert [r["iteration"] for r in train] == list(range(1, iters + 1))
    for r in train:
        assert set(r) == set(TRAIN_KEYS), r
        for key, kind in TRAIN_KEYS.items():
            assert type(r[key]) is kind, (key, r)
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["tokens_per_s"] > 0, r


def _log_lines(stdout: str) -> list[re.Match[str]]:
    return [m for m in map(LOG_LINE.match, stdout.splitlines()) if m]


def test_torchrun_tp2_pp2_lora_mock_data_learns(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "peftckpt", "train", *MODEL, "--vocab-size", "64", "--mock-data",
           "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--train-iters", str(ITERS), "--lr", "1e-2", "--eval-interval", "10", "--eval-iters", "2",
           "--metrics-file", str(metrics)]
    proc = _run(cmd, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

    train, evals = _records(metrics)
    _check_train_records(train, ITERS)
    losses = [r["loss"] for r in train]
    lrs = [r["lr"] for r in train]
    # An untrained model with small init predicts ~uniformly over the 64-token vocabulary.
    assert abs(losses[0] - math.log(64)) < 0.1, losses[0]
    # Measured drop first -> mean(last 5) is 0.32-0.40 over seeds and LR styles; half of that is a real margin.
    last5 = sum(losses[-5:]) / 5
    assert last5 < losses[0] - 0.15, (losses[0], last5)
    # No warmup, cosine from --lr to --min-lr 0 over --train-iters.
    assert lrs[0] == 1e-2
    assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 0

    assert [r["iteration"] for r in evals] == [10, 20]
    for r in evals:
        assert set(r) == {"iteration", "eval_loss"} and type(r["eval_loss"]) is float
    assert evals[1]["eval_loss"] < losses[0] - 0.15

    # One plain log line per iteration (only rank 0 logs), agreeing with the metrics file.
    lines = _log_lines(proc.stdout)
    assert [int(m.group(1)) for m in lines] == list(range(1, ITERS + 1)), proc.stdout
    assert all(int(m.group(2)) == ITERS for m in lines)
    assert [float(m.group(3)) for m in lines] == [round(x, 6) for x in losses]
    assert "\r" not in proc.stdout
    assert [ln for ln in proc.stdout.splitlines() if ln.startswith("eval at iteration")] == [
        f"eval at iteration {r['iteration']}: loss {r['eval_loss']:.6f}" for r in evals]


def _write_jsonl(path: Path, num_docs: int = 40) -> Path:
    words = "the quick brown fox jumps over the lazy dog while checkpoints shard adapters".split()
    with path.open("w", encoding="utf-8") as f:
        for i in range(num_docs):
            text = " ".join(words[(i + k) % len(words)] for k in range(12)) + f" #{i}"
            f.write(json.dumps({"text": text}) + "\n")
    return path


def test_data_path_jsonl_trains_three_iterations(tmp_path: Path) -> None:
    data = _write_jsonl(tmp_path / "docs.jsonl")
    metrics = tmp_path / "m.jsonl"
    base = [sys.executable, "-m", "peftckpt", "train", *MODEL, "--data-path", str(data), "--train-iters", "3",
            "--metrics-file", str(metrics)]
    missing = tmp_path / "mistyped"
    proc = _run([*base, "--vocab-size", "257", "--load", str(missing)], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    said = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"--load {missing} does not exist; starting from")]
    assert len(said) == 1, proc.stdout  # a mistyped --load is never silent
    train, evals = _records(metrics)
    _check_train_records(train, 3)
    assert evals == []
    # Byte-level text over a 257-token vocabulary starts near ln(257).
    assert abs(train[0]["loss"] - math.log(257)) < 0.1, train[0]
    assert [int(m.group(1)) for m in _log_lines(proc.stdout)] == [1, 2, 3]

    # The same file with a vocabulary too small for bytes: refused with the fixing flag, exit 2.
    metrics.unlink()
    proc = _run([*base, "--vocab-size", "64"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("peftckpt train: error: ")]
    assert len(errors) == 1, proc.stderr
    assert "--vocab-size is 64" in errors[0] and "pass --vocab-size" in errors[0]
    assert not metrics.exists()
