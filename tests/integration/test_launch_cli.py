"""``peftckpt launch`` (issue 25): torchrun's launcher in-process, reporting as a tool -- the workers' one message,
their exit code, no launcher traceback or banner -- for success, a usage error, a checkpoint error and SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from peftckpt.checkpoint.location.directory import read_tracker

from .cli import TINY, all_committed_verify, env, launch, peftckpt, until

pytestmark = pytest.mark.slow

LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "torch/distributed", "OMP_NUM_THREADS", "*****", "exitcode")


def _quiet(stderr: str) -> None:
    for noise in LAUNCHER_NOISE:
        assert noise not in stderr, stderr


def test_launch_runs_the_workers_and_reports_as_they_do(tmp_path: Path) -> None:
    save = tmp_path / "save"
    # 1. success: a TP=2 run saves; nothing from the launcher (no OMP_NUM_THREADS banner although unset)
    cmd = [sys.executable, "-m", "peftckpt", "launch", "--nproc-per-node", "2", "train", *TINY, "--train-iters", "2",
           "--tensor-model-parallel-size", "2", "--save", str(save)]
    quiet_env = {k: v for k, v in env().items() if k != "OMP_NUM_THREADS"}
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=quiet_env)
    assert ok.returncode == 0, ok.stderr
    _quiet(ok.stderr)
    assert read_tracker(save) == 2 and "saved checkpoint" in ok.stdout
    all_committed_verify(save)

    # 2. a usage error: the worker's line once, its exit code (2), not torchrun's 1
    typo = peftckpt(["train", *TINY, "--lora-rnak", "4"], nproc=2, check=False, launcher="peftckpt")
    assert typo.returncode == 2, typo.stderr
    assert typo.stderr.count("peftckpt train: error: unrecognized arguments: --lora-rnak (did you mean "
                             "--lora-rank?)") == 1, typo.stderr
    _quiet(typo.stderr)

    # 3. a checkpoint error found by every rank: said once (agreed), exit 1; nothing written
    missing = peftckpt(["train", *TINY, "--train-iters", "2", "--load", str(tmp_path / "nothere"),
                        "--exit-on-missing-checkpoint"], nproc=2, check=False, launcher="peftckpt")
    assert missing.returncode == 1, missing.stderr
    assert missing.stderr.count("error: --exit-on-missing-checkpoint: checkpoint path") == 1, missing.stderr
    _quiet(missing.stderr)
    assert not (tmp_path / "nothere").exists()

    # 4. what launch cannot run: one line, exit 2, before any worker starts
    tool = peftckpt(["launch", "--nproc-per-node", "2", "verify", str(save)], check=False)
    assert tool.returncode == 2 and tool.stderr.count("\n") == 1, tool.stderr
    assert "peftckpt launch: error: cannot launch 'verify'" in tool.stderr


def test_launch_forwards_sigterm_and_the_workers_save(tmp_path: Path) -> None:
    save = tmp_path / "save"
    log = tmp_path / "run.log"
    proc = launch(["train", *TINY, "--train-iters", "100000", "--log-interval", "1", "--lora-rank", "4",
                   "--save-trainable-params-only", "--save", str(save), "--exit-signal-handler"], log, nproc=2,
                  launcher="peftckpt")
    try:
        until(lambda: log.read_text(errors="replace").count("iteration ") >= 3, f"3 steps in {log}")
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    out = log.read_text()
    saved = read_tracker(save)
    assert saved is not None and saved >= 3, out[-3000:]
    assert out.count(f"peftckpt train: stopped by SIGTERM at iteration {saved}") == 1, out[-3000:]
    assert code == 128 + signal.SIGTERM  # the launcher's own signal, as a shell reports it
    _quiet(out)
    all_committed_verify(save)
