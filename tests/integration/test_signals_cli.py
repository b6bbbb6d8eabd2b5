"""Ctrl-C and SIGTERM as users meet them (issue 16): the run stops at the next iteration boundary, one line
says where to resume, and the rerun of the same command resumes there.

Under torchrun the signal goes to torchrun, which forwards it to every worker (its own shutdown) and then
exits 1 with its own SignalException traceback; the workers' line and checkpoint are what these tests check.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest

from peftckpt.checkpoint.location.directory import read_tracker
from peftckpt.checkpoint.storage.manifest import read_manifest

from .cli import TINY, all_committed_verify, launch, no_worker_traceback, peftckpt, until

pytestmark = pytest.mark.slow
LORA = ["--lora-rank", "4", "--save-trainable-params-only"]


def _steps_logged(log: Path) -> int:
    return len(re.findall(r"^iteration +\d+/", log.read_text(errors="replace"), re.M))


def _run_until_signalled(tmp_path: Path, args: list[str], nproc: int, sig: signal.Signals,
                         after: int = 3, committed: bool = False) -> tuple[int, str]:
    """Start a long run of ``args``, send ``sig`` to it (to torchrun when ``nproc``) once ``after`` steps are
    logged (and, with ``committed``, a checkpoint is), wait; returns (exit code, output)."""
    log = tmp_path / f"{sig.name}.log"
    proc = launch(["train", *TINY, "--train-iters", "100000", "--log-interval", "1", *args], log, nproc)
    save = Path(args[args.index("--save") + 1])
    try:
        until(lambda: _steps_logged(log) >= after and (not committed or read_tracker(save) is not None),
              f"{after} steps in {log}")
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    return code, log.read_text()


def _resume_line(save: Path, iteration: int) -> str:
    return f"resumed from {save / f'iter_{iteration:07d}'} at iteration {iteration}"


@pytest.mark.parametrize("nproc", [0, 2])
def test_sigterm_with_exit_signal_handler_saves_then_the_rerun_resumes(tmp_path: Path, nproc: int) -> None:
    save = tmp_path / "save"
    tp = ["--tensor-model-parallel-size", "2"] if nproc else []
    args = [*LORA, *tp, "--save", str(save), "--load", str(save), "--save-interval", "1000", "--exit-signal-handler"]
    code, out = _run_until_signalled(tmp_path, args, nproc, signal.SIGTERM)

    saved = read_tracker(save)
    assert saved is not None and saved >= 3, out[-3000:]
    line = (f"peftckpt train: stopped by SIGTERM at iteration {saved}; last committed checkpoint: "
            f"{save / f'iter_{saved:07d}'}; rerun the same command to resume")
    assert out.count(line) == 1, out[-3000:]
    assert code == (1 if nproc else 0)  # the workers exit 0; torchrun says 1 for any signal it got itself
    no_worker_traceback(out, nproc)
    all_committed_verify(save)
    assert read_manifest(save / f"iter_{saved:07d}").trainable_only

    if nproc:  # the same command resumes (with an end in sight)
        rerun = peftckpt(["train", *TINY, "--log-interval", "1", *args, "--train-iters", str(saved + 1)], nproc)
        assert _resume_line(save, saved) in rerun.stdout
        assert read_tracker(save) == saved + 1


@pytest.mark.parametrize(("nproc", "sig"), [(2, signal.SIGINT), (0, signal.SIGINT), (0, signal.SIGTERM)])
def test_ctrl_c_stops_at_the_next_iteration_and_names_the_last_checkpoint(tmp_path: Path, nproc: int,
                                                                          sig: signal.Signals) -> None:
    """Ctrl-C (and SIGTERM without --exit-signal-handler): no new save, a background save in flight commits,
    exit 128 + signal; the line names the newest committed checkpoint."""
    save = tmp_path / "save"
    tp = ["--tensor-model-parallel-size", "2"] if nproc else []
    args = [*tp, "--save", str(save), "--load", str(save), "--save-interval", "2", "--async-save"]
    code, out = _run_until_signalled(tmp_path, args, nproc, sig, committed=True)

    match = re.search(rf"peftckpt train: interrupted by {sig.name} at iteration (\d+); last committed checkpoint: "
                      rf"(\S+)/iter_(\d+); rerun the same command to resume\n", out)
    assert match, out[-3000:]
    stopped, last = int(match.group(1)), int(match.group(3))
    assert match.group(2) == str(save) and last == read_tracker(save)
    assert last <= stopped and last % 2 == 0 and out.count("peftckpt train: interrupted") == 1
    assert code == (1 if nproc else 128 + sig)
    no_worker_traceback(out, nproc)
    all_committed_verify(save)

    if nproc:
        rerun = peftckpt(["train", *TINY, "--log-interval", "1", *args, "--train-iters", str(last + 1)], nproc)
        assert _resume_line(save, last) in rerun.stdout
