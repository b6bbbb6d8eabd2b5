"""Experiment logging as Megatron-LM users expect it (issue #25): ``--tensorboard-dir`` and ``--wandb-project`` write,
on global rank 0 only, the values ``--metrics-file`` holds; ``peftckpt plot`` draws a metrics file's curves.

The real packages (the ``logging`` extra), read back with their own readers: TensorBoard's ``EventAccumulator``,
W&B's offline run directory. W&B never goes online here: ``WANDB_MODE=offline``, or no API key at all (the trainer
then chooses offline itself and says so).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from peftckpt.cli import main

from .cli import TINY, env, peftckpt

ITERS = 4
EVAL = ["--eval-interval", "2", "--eval-iters", "1"]
TRAIN_TAGS = {"loss", "lr", "grad_norm", "tokens_per_s"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _wandb_env(tmp_path: Path) -> dict[str, str]:
    """W&B's own files (settings, caches) in ``tmp_path``, nothing printed by it, never online."""
    state = tmp_path / "wandb-state"
    return {"WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(state / "config"),
            "WANDB_CACHE_DIR": str(state / "cache"), "WANDB_DATA_DIR": str(state / "data"),
            "WANDB_ARTIFACT_DIR": str(state / "artifacts"), "NETRC": str(tmp_path / "no-netrc")}


def _records(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


def _scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the one event file in ``tb_dir``, with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list(tb_dir.glob("events.out.tfevents.*"))
    assert len(events) == 1, events  # one writer: global rank 0
    acc = EventAccumulator(str(events[0]), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(value: float) -> float:
    return float(np.float32(value))  # TensorBoard's simple_value is a float32


def _wandb_runs(root: Path) -> list[Path]:
    runs = sorted((root / "wandb").glob("offline-run-*"))
    for run in runs:
        files = list(run.glob("run-*.wandb"))
        assert len(files) == 1 and files[0].stat().st_size > 0, list(run.iterdir())
    return runs


@pytest.mark.slow
def test_torchrun_two_ranks_tensorboard_and_wandb_equal_the_metrics_file(tmp_path: Path) -> None:
    metrics, tb, wb = tmp_path / "metrics.jsonl", tmp_path / "tb", tmp_path / "wb"
    proc = peftckpt(["train", *TINY, "--train-iters", str(ITERS), *EVAL, "--metrics-file", str(metrics),
                     "--tensorboard-dir", str(tb), "--wandb-project", "peftckpt-test", "--wandb-exp-name", "tiny",
                     "--wandb-save-dir", str(wb)],
                    nproc=2, cwd=tmp_path, extra_env={**_wandb_env(tmp_path), "WANDB_MODE": "offline"})
    assert "W&B: no API key" not in proc.stdout  # WANDB_MODE said what to do
    train, evals = _records(metrics)
    assert [r["iteration"] for r in train] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in evals] == [2, 4]

    scalars = _scalars(tb)
    assert set(scalars) == TRAIN_TAGS | {"eval_loss"}
    for tag in TRAIN_TAGS:
        assert scalars[tag] == [(r["iteration"], _f32(r[tag])) for r in train], tag
    assert scalars["eval_loss"] == [(r["iteration"], _f32(r["eval_loss"])) for r in evals]

    (run,) = _wandb_runs(wb)  # one run: rank 0's
    data = next(run.glob("run-*.wandb")).read_bytes()
    for key in (b"eval_loss", b"grad_norm", b"tokens_per_s", b"peftckpt-test", b"tensor_model_parallel_size"):
        assert key in data, key  # the logged values' names, the project, the flags as the run's config
    assert not (tmp_path / "wandb").exists()  # --wandb-save-dir, not WANDB_DIR, holds it


def test_one_process_offline_by_default_then_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No WANDB_MODE, no API key: offline, said in one line. ``--tensorboard-log-interval 2``: training scalars
    every second iteration, eval ones at each evaluation. Then ``peftckpt plot`` on the run's metrics file."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    metrics, tb = tmp_path / "run" / "metrics.jsonl", tmp_path / "tb"
    proc = peftckpt(["train", *TINY, "--train-iters", str(ITERS), *EVAL, "--metrics-file", str(metrics),
                     "--tensorboard-dir", str(tb), "--tensorboard-log-interval", "2", "--wandb-project", "p"],
                    cwd=tmp_path, extra_env=_wandb_env(tmp_path))
    notes = [line for line in proc.stdout.splitlines() if line.startswith("W&B: ")]
    assert len(notes) == 1 and "logging offline" in notes[0] and "WANDB_MODE" in notes[0], proc.stdout
    assert len(_wandb_runs(tmp_path)) == 1  # WANDB_DIR
    train, evals = _records(metrics)
    scalars = _scalars(tb)
    assert scalars["loss"] == [(r["iteration"], _f32(r["loss"])) for r in train if r["iteration"] % 2 == 0]
    assert scalars["eval_loss"] == [(r["iteration"], _f32(r["eval_loss"])) for r in evals]

    # plot, as a user runs it: the default output is next to the metrics file; the path is printed
    done = subprocess.run([sys.executable, "-m", "peftckpt", "plot", str(metrics)], capture_output=True, text=True,
                          timeout=120, env=env())
    png = metrics.with_suffix(".png")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{png}\n", "")
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    from matplotlib.image import imread

    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 0 and image.shape[1] > 0
    assert not list(png.parent.glob(".*partial"))


def test_plot_takes_the_last_record_of_each_iteration_and_skips_broken_lines(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A resumed run appends to the same file: iterations 3-4 again, after a line cut short by the kill."""
    from peftckpt.cli.plot import read_metrics

    metrics = tmp_path / "m.jsonl"
    first = [{"iteration": i, "loss": 5.0 - i, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0} for i in (1, 2, 3, 4)]
    again = [{"iteration": i, "loss": 9.0 + i, "lr": 2e-3, "grad_norm": 1.0, "tokens_per_s": 10.0} for i in (3, 4, 5)]
    lines = [json.dumps(r) for r in first] + [json.dumps({"iteration": 4, "eval_loss": 3.5}), '{"iteration": 5, "lo']
    lines += [json.dumps(r) for r in again] + [json.dumps({"iteration": 4, "eval_loss": 2.5}), "", "[1, 2]"]
    metrics.write_text("\n".join(lines) + "\n")
    curves = read_metrics(metrics)
    assert curves.train == {1: (4.0, 1e-3), 2: (3.0, 1e-3), 3: (12.0, 2e-3), 4: (13.0, 2e-3), 5: (14.0, 2e-3)}
    assert curves.evals == {4: 2.5}
    assert curves.skipped == [6, 12]

    out = tmp_path / "plots" / "curves.png"
    assert main(["plot", str(metrics), "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{out}\n"
    assert captured.err == (f"peftckpt plot: warning: {metrics}: 2 line(s) that are not metrics records left out "
                            "(first: line 6)\n")
    assert out.read_bytes().startswith(PNG_SIGNATURE)


def _bad(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Inputs that cannot be plotted: name -> (file, what the message says about it)."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    evals_only = tmp_path / "evals.jsonl"
    evals_only.write_text(json.dumps({"iteration": 2, "eval_loss": 1.0}) + "\n")
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text("not json\n[1]\n")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00\x80" * 8)
    return {"missing": (tmp_path / "nope.jsonl", "does not exist"), "empty": (empty, "is empty"),
            "evals-only": (evals_only, "holds no training record"), "garbage": (garbage, "holds no training record"),
            "binary": (binary, "not UTF-8 text"), "directory": (tmp_path, "is a directory")}


@pytest.mark.parametrize("case", ["missing", "empty", "evals-only", "garbage", "binary", "directory"])
def test_plot_refuses_a_bad_metrics_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     case: str) -> None:
    path, said = _bad(tmp_path)[case]
    assert main(["plot", str(path), "-o", str(tmp_path / "out.png")]) == 1
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("peftckpt plot: error: ") and str(path) in lines[0], lines
    assert said in lines[0]
    assert captured.out == "" and not (tmp_path / "out.png").exists()


def test_plot_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot"]) == 2
    assert capsys.readouterr().err.startswith("peftckpt plot: error: the following arguments are required: METRICS")
    metrics = tmp_path / "m.png"  # the default output would be the file itself
    metrics.write_text(json.dumps({"iteration": 1, "loss": 1.0, "lr": 0.1}) + "\n")
    assert main(["plot", str(metrics)]) == 2
    assert capsys.readouterr().err == (f"peftckpt plot: error: the output {metrics} is METRICS itself; pass "
                                       "another -o\n")
    assert metrics.read_text().startswith("{")


# ------------------------------------------------------------------------------- missing packages, bad flags
def _parse(extra: list[str]) -> Any:
    from peftckpt.train.args import parse_train_args

    return parse_train_args(["--mock-data", *extra], 1)


@pytest.mark.parametrize(("flag", "package"), [("--tensorboard-dir", "tensorboard"), ("--wandb-project", "wandb")])
def test_a_missing_package_is_one_message_naming_the_flag_and_the_extra(
        monkeypatch: pytest.MonkeyPatch, flag: str, package: str) -> None:
    from peftckpt.train.args import ArgumentError
    from peftckpt.train.logging_flags import check_logging_packages

    args = _parse([flag, "x"])  # installed: accepted
    monkeypatch.setitem(sys.modules, package, None)  # as if not installed: its import fails
    with pytest.raises(ArgumentError) as info:
        check_logging_packages(args)
    message = str(info.value)
    assert message.startswith(f"{flag} needs the {package} package, which is not installed"), message
    assert "the logging extra: pip install '.[logging]'" in message and "\n" not in message
    with pytest.raises(ArgumentError, match=f"^{flag} needs the {package} package"):
        _parse([flag, "x"])  # the parse-time validation runs the check


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"iteration": 1, "loss": 1.0, "lr": 0.1}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(metrics)]) == 1
    assert capsys.readouterr().err == ("peftckpt plot: error: peftckpt plot needs the matplotlib package, which is "
                                       "not installed (pip install matplotlib, or the logging extra: pip install "
                                       "'.[logging]' in a peftckpt checkout)\n")


@pytest.mark.parametrize(("extra", "expected"), [
    (["--wandb-exp-name", "a"], "--wandb-exp-name needs --wandb-project"),
    (["--wandb-exp-name", "a", "--wandb-save-dir", "d"], "--wandb-exp-name, --wandb-save-dir need --wandb-project"),
    (["--tensorboard-log-interval", "2"], "--tensorboard-log-interval needs --tensorboard-dir or --wandb-project"),
    (["--tensorboard-dir", "tb", "--tensorboard-log-interval", "0"], "--tensorboard-log-interval must be >= 1, got 0"),
    (["--tensorboard-dir", "s3://bucket/tb"], "--tensorboard-dir s3://bucket/tb is a URL, but this path must be a "
     "local (or mounted) file system path"),
])
def test_tracking_flags_that_cannot_work_are_refused(extra: list[str], expected: str) -> None:
    from peftckpt.train.args import ArgumentError

    with pytest.raises(ArgumentError) as info:
        _parse(extra)
    assert str(info.value) == expected


@pytest.mark.slow
def test_a_missing_package_is_said_once_under_torchrun(tmp_path: Path) -> None:
    """Every rank refuses at parse time, before any model is built; rank 0 says it, exit 2 from the workers."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['tensorboard'] = None  # not installed\n")
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    proc = peftckpt(["train", *TINY, "--tensorboard-dir", str(tmp_path / "tb")], nproc=2, check=False,
                    extra_env={"PYTHONPATH": path})
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if "peftckpt train: error:" in line]
    assert said == ["peftckpt train: error: --tensorboard-dir needs the tensorboard package, which is not installed "
                    "(pip install tensorboard, or the logging extra: pip install '.[logging]' in a peftckpt "
                    "checkout)"], proc.stderr
    assert "exitcode  : 2" in proc.stderr or "exitcode: 2" in proc.stderr.replace(" ", ""), proc.stderr[-2000:]
    assert not (tmp_path / "tb").exists()


# --------------------------------------------------------------------------- the writers' lifetime in the trainer
def test_a_run_stopped_by_a_signal_flushes_tensorboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during iteration 2: the run stops after it (exit code 130) and the event file holds steps 1-2,
    closed by the trainer on the way out (the writer's own flush would come only after 30 s)."""
    from peftckpt.train.args import parse_train_args
    from peftckpt.train.interrupts import RunStopped, StopSignals
    from peftckpt.train.trainer import Trainer

    tb = tmp_path / "tb"
    args = parse_train_args([*TINY, "--train-iters", "50", "--tensorboard-dir", str(tb)], 1)
    signals = StopSignals()
    trainer = Trainer(args, stop=signals)

    step = trainer.train_step

    def ctrl_c_in_step_2() -> tuple[float, float, float]:
        done = step()
        if trainer.iteration == 2:
            os.kill(os.getpid(), signal.SIGINT)  # recorded by the handler; the run stops at the next boundary
        return done

    monkeypatch.setattr(trainer, "train_step", ctrl_c_in_step_2)
    with signals.installed(), pytest.raises(RunStopped) as info:
        trainer.run()
    assert info.value.exit_code == 130
    assert trainer.logger.writers == []  # closed
    assert [step for step, _ in _scalars(tb)["loss"]] == [1, 2]
    assert [loss for _, loss in _scalars(tb)["loss"]] == [_f32(x) for x in trainer.losses]


def test_a_resumed_run_continues_its_wandb_run(tmp_path: Path) -> None:
    """The W&B run id is recorded with each checkpoint's flags; a run resumed from that checkpoint (same
    ``--wandb-project``) continues the same W&B run, a fresh run or another project starts a new one."""
    from peftckpt.checkpoint.storage.manifest import read_manifest

    save = tmp_path / "save"
    common = ["train", *TINY, "--train-iters", "4", "--save", str(save), "--save-interval", "2"]
    wandb_env = {**_wandb_env(tmp_path), "WANDB_MODE": "offline"}
    peftckpt([*common, "--exit-interval", "2", "--wandb-project", "p"], cwd=tmp_path, extra_env=wandb_env)
    (first,) = _wandb_runs(tmp_path)
    run_id = first.name.rsplit("-", 1)[-1]
    assert read_manifest(save / "iter_0000002").args["wandb_run_id"] == run_id
    peftckpt([*common, "--load", str(save), "--wandb-project", "p"], cwd=tmp_path, extra_env=wandb_env)
    resumed = [r for r in _wandb_runs(tmp_path) if r != first]
    assert [r.name.rsplit("-", 1)[-1] for r in resumed] == [run_id]  # the same W&B run, continued
    assert read_manifest(save / "iter_0000004").args["wandb_run_id"] == run_id
    peftckpt([*common, "--load", str(save), "--train-iters", "6", "--wandb-project", "other"], cwd=tmp_path,
             extra_env=wandb_env)
    ids = [r.name.rsplit("-", 1)[-1] for r in _wandb_runs(tmp_path)]
    assert len(ids) == 3 and ids.count(run_id) == 2  # another project: a run of its own
