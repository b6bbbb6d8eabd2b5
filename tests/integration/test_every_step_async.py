"""Every-step adapter checkpoints (issue #28): ``--save-interval 1 --async-save`` on a LoRA run, killed with
SIGKILL at moments no one chooses, always leaves a verified checkpoint at most 2 iterations behind the last one
the run logged, and the rerun resumes from it with the losses of an uninterrupted run, bit for bit."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from peftckpt.checkpoint.location.directory import read_tracker
from peftckpt.checkpoint.tools.verify import verify_checkpoint

from .cli import TINY, launch, peftckpt, train_records, until

pytestmark = pytest.mark.slow
ITERS = 60
LORA = ["--lora-rank", "4", "--save-trainable-params-only"]
EVERY_STEP = ["--save-interval", "1", "--async-save"]


def _logged(metrics: Path) -> int:
    try:
        records = train_records(metrics)
    except (FileNotFoundError, ValueError):  # not there yet, or a line half written
        return 0
    return records[-1]["iteration"] if records else 0


def test_kill9_during_every_step_async_saves_loses_at_most_two_iterations(tmp_path: Path) -> None:
    base = tmp_path / "base"
    peftckpt(["train", *TINY, "--train-iters", "2", "--save", str(base)])
    run = ["train", *TINY, *LORA, "--pretrained-checkpoint", str(base), "--train-iters", str(ITERS)]
    straight = tmp_path / "straight.jsonl"
    peftckpt([*run, "--metrics-file", str(straight)])
    expected = {r["iteration"]: r["loss"] for r in train_records(straight)}
    rng = random.Random(1234)
    for attempt, kill_after in enumerate((3, 17, 31)):
        save = tmp_path / f"save{attempt}"
        metrics = tmp_path / f"killed{attempt}.jsonl"
        proc = launch([*run, *EVERY_STEP, "--save", str(save), "--metrics-file", str(metrics), "--no-progress"],
                      tmp_path / f"killed{attempt}.log")
        try:
            until(lambda m=metrics, k=kill_after, p=proc: _logged(m) >= k or p.poll() is not None,  # type: ignore[misc]
                  "iterations to be logged")
            time.sleep(rng.uniform(0.0, 0.05))  # somewhere inside a step and its background save
            proc.send_signal(signal.SIGKILL)
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
        logged = _logged(metrics)
        assert logged < ITERS, "the run finished before it was killed: the test proves nothing"
        committed = read_tracker(save)
        assert committed is not None and logged - committed <= 2, (logged, committed)
        report = verify_checkpoint(save)
        assert report.ok and report.iteration == committed, report.problems
        resumed = tmp_path / f"resumed{attempt}.jsonl"
        peftckpt([*run, *EVERY_STEP, "--save", str(save), "--load", str(save), "--metrics-file", str(resumed)])
        records = train_records(resumed)
        assert [r["iteration"] for r in records] == list(range(committed + 1, ITERS + 1))
        assert [r["loss"] for r in records] == [expected[r["iteration"]] for r in records]
        assert read_tracker(save) == ITERS
