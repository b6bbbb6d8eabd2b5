"""The training-loop rows: a LoRA run with a checkpoint every step (``--save-interval 1 --async-save``,
trainable-only) against the same run without saves, as the trainer runs them (``peftckpt train``, one process).

Runs alternate (no saves, every step, no saves, every step, ...) so both see the same state of the machine;
the median step is taken over every run's steps after the first few (warm-up)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["measure_train_loop"]

MODELS = {
    "default": ["--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--ffn-hidden-size", "1408",
                "--vocab-size", "1024", "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "8"],
    "quick": ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
              "--vocab-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4"],
}
WARMUP = 3


def _train(args: list[str], log: Path) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with open(log, "w") as out:
        subprocess.run([sys.executable, "-m", "peftckpt", "train", *args], check=True, stdout=out,
                       stderr=subprocess.STDOUT, env=env)


def _steps(metrics: Path, tokens: int) -> list[float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [tokens / r["tokens_per_s"] for r in records if "tokens_per_s" in r][WARMUP:]


def measure_train_loop(work: Path, small: bool, iters: int, rounds: int) -> dict[str, Any]:
    """Median and minimum step time (s) of each mode, and how many checkpoints the every-step runs committed."""
    model = [*MODELS["quick" if small else "default"], "--mock-data", "--lr", "1e-3", "--device", "cpu",
             "--log-interval", "1000", "--no-progress"]
    tokens = int(model[model.index("--seq-length") + 1]) * int(model[model.index("--global-batch-size") + 1])
    root = work / "train-loop"
    root.mkdir()
    _train([*model, "--train-iters", "2", "--save", str(root / "base")], root / "base.log")
    lora = [*model, "--lora-rank", "16", "--pretrained-checkpoint", str(root / "base"), "--train-iters", str(iters)]
    steps: dict[str, list[float]] = {"no_saves": [], "every_step_async": []}
    committed = 0
    for i in range(rounds):
        for mode in steps:
            metrics = root / f"{mode}-{i}.jsonl"
            extra = [] if mode == "no_saves" else ["--save", str(root / f"save-{i}"), "--save-interval", "1",
                                                    "--async-save", "--save-trainable-params-only"]
            _train([*lora, *extra, "--metrics-file", str(metrics)], root / f"{mode}-{i}.log")
            steps[mode] += _steps(metrics, tokens)
            if extra:
                committed += len(list((root / f"save-{i}").glob("iter_*")))
    out: dict[str, Any] = {"iters": iters, "rounds": rounds, "model": model, "checkpoints_committed": committed}
    for mode, values in steps.items():
        out[mode] = {"median_s": statistics.median(values), "min_s": min(values), "max_s": max(values),
                     "samples_s": values}
    return out
