"""Issue 13, as users meet it: a save that could never succeed fails before training, a second run on a save
directory refuses to start, and workers whose torchrun launcher was SIGKILLed stop at once.

Waits poll for a condition with a deadline (a process's state on disk or in /proc), never a fixed sleep.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from peftckpt.checkpoint.location.directory import read_tracker
from peftckpt.checkpoint.location.names import TRACKER_FILENAME
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata

from .cli import TINY, all_committed_verify, launch, no_worker_traceback, peftckpt, until

pytestmark = pytest.mark.slow
LONG = ["train", *TINY, "--train-iters", "100000", "--save-interval", "3", "--log-interval", "1"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; only its exit status waits to be collected


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


@pytest.mark.parametrize("nproc", [0, 2])
def test_a_save_that_could_never_succeed_fails_before_training(tmp_path: Path, nproc: int) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    cases = [
        (["--save", str(a_file)], f"--save {a_file} is a file, not a directory"),
        (["--save", str(a_file / "sub")], f"--save {a_file / 'sub'} is not a writable directory"),
        (["--pretrained-checkpoint", str(tmp_path / "nowhere"), "--save", str(tmp_path / "s")],
         f"--pretrained-checkpoint {tmp_path / 'nowhere'} does not exist"),
        (["--load", str(a_file)], f"--load {a_file} is a file"),
    ]
    for flags, message in cases[:2] if nproc else cases:
        proc = peftckpt(["train", *TINY, "--train-iters", "50", "--log-interval", "1", *flags], nproc, check=False)
        assert proc.returncode == (1 if nproc else 2), proc.stderr  # torchrun reports any worker failure as 1
        assert proc.stderr.count(message) == 1, proc.stderr  # once, not once per rank
        no_worker_traceback(proc.stderr, nproc)
        assert "iteration" not in proc.stdout  # no step was trained
    assert not (tmp_path / "s").exists()


def test_second_run_on_a_save_directory_refuses_before_training(tmp_path: Path) -> None:
    save = tmp_path / "save"
    first = launch([*LONG, "--save", str(save)], tmp_path / "first.log")
    try:
        until(lambda: (save / TRACKER_FILENAME).exists(), "the first run's first checkpoint")
        second = peftckpt([*LONG, "--save", str(save), "--load", str(save)], nproc=2, check=False)
        assert second.returncode == 1, second.stderr
        message = f"save directory {save} is in use by another run (host "
        assert second.stderr.count(message) == 1 and f"pid {first.pid}, since " in second.stderr
        no_worker_traceback(second.stderr, 2)
        assert "iteration" not in second.stdout
        assert first.poll() is None  # the first run goes on
    finally:
        first.kill()  # a kill at any moment costs nothing committed
        first.wait()
    all_committed_verify(save)
    # the kernel released the dead run's lock: a rerun resumes at once
    rerun = peftckpt(["train", *TINY, "--train-iters", str(read_tracker(save) + 2), "--save", str(save),
                      "--load", str(save)], check=False)
    assert rerun.returncode == 0 and "resumed from" in rerun.stdout + rerun.stderr, rerun.stderr
    all_committed_verify(save)


def test_workers_end_with_a_killed_launcher(tmp_path: Path) -> None:
    save = tmp_path / "save"
    launcher = launch([*LONG, "--tensor-model-parallel-size", "2", "--save", str(save)], tmp_path / "run.log",
                       nproc=2)
    workers: list[int] = []
    try:
        until(lambda: (save / TRACKER_FILENAME).exists(), "the first checkpoint")
        workers = _children(launcher.pid)
        assert len(workers) == 2 and all(_alive(w) for w in workers)
        os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone, as the OOM killer or `kill -9` does
        launcher.wait()
        until(lambda: not any(_alive(w) for w in workers), "the workers to end", timeout=10)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in workers:  # never leave a worker training forever if the check above failed
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    all_committed_verify(save)


def test_a_damaged_data_file_is_said_once_under_torchrun(tmp_path: Path) -> None:
    """A byte flipped in one rank's data file of a TP=2 checkpoint: the load's ranged reader finds it in the
    block it reads and every rank stops with the same error -- printed once, naming the file and the tensor."""
    save = tmp_path / "run"
    tp2 = ["--tensor-model-parallel-size", "2"]
    peftckpt(["train", *TINY, *tp2, "--train-iters", "2", "--save", str(save)], 2)
    data = save / "iter_0000002" / "__1_0.distcp"
    # The middle byte of rank 1's largest model tensor (where items lie in the file is the .metadata's to say).
    stored = load_dcp_metadata(save / "iter_0000002" / ".metadata").storage_data
    key, info = max(((k.fqn, v) for k, v in stored.items() if v.relative_path == data.name
                     and k.fqn.startswith("model.")), key=lambda kv: kv[1].length)
    raw = bytearray(data.read_bytes())
    raw[info.offset + info.length // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    load = peftckpt(["train", *TINY, *tp2, "--train-iters", "4", "--load", str(save)], 2, check=False)
    assert load.returncode != 0
    assert load.stderr.count("is damaged") == 1, load.stderr
    assert f"{data}: xxh3_64 checksum mismatch in the bytes of {key!r}" in load.stderr
    no_worker_traceback(load.stderr, 2)
