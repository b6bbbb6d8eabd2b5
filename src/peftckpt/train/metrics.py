"""Per-iteration metrics: a JSON-lines file for scripts, a live line or plain log lines for people, and the same
values as TensorBoard scalars (``--tensorboard-dir``) and to Weights & Biases (``--wandb-project``)."""

from __future__ import annotations

import argparse
import json
import netrc
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

__all__ = ["MetricsLogger", "ScalarWriter", "TensorBoardWriter", "WandbWriter", "open_writers", "wandb_key_configured"]


class ScalarWriter:
    """Where a run's scalars also go, step = iteration: TensorBoard, W&B. Only rank 0 opens one."""

    note: str | None = None
    """One line to print at start (how it logs), or ``None``."""

    def __init__(self, interval: int = 1):
        self.interval = interval
        """Training scalars every ``interval`` iterations (``--tensorboard-log-interval``); eval ones always."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self, exit_code: int = 0) -> None:
        """Flush and close: at the end of the run, however it ends (``exit_code`` 0 finished, else how it ended)."""


class TensorBoardWriter(ScalarWriter):
    """``torch.utils.tensorboard.SummaryWriter`` on ``log_dir`` (the tensorboard package)."""

    def __init__(self, log_dir: str, interval: int = 1):
        super().__init__(interval)
        from torch.utils.tensorboard import SummaryWriter

        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=log_dir, flush_secs=30)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)

    def close(self, exit_code: int = 0) -> None:
        self._writer.close()


def wandb_key_configured(hosts: Sequence[str] = ()) -> bool:
    """Whether W&B has an API key to go online with: ``WANDB_API_KEY``, or an entry of the netrc file (``$NETRC``,
    else ``~/.netrc``) for api.wandb.ai, ``WANDB_BASE_URL``'s host or one of ``hosts``. An unreadable netrc counts
    as none (W&B would not use it either)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    names = {"api.wandb.ai", *hosts}
    if os.environ.get("WANDB_BASE_URL"):
        names.add(urlsplit(os.environ["WANDB_BASE_URL"]).netloc)
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        entries = netrc.netrc(path)
    except (OSError, netrc.NetrcParseError):
        return False
    return any((auth := entries.authenticators(name)) is not None and auth[2] for name in names if name)


class WandbWriter(ScalarWriter):
    """A W&B run: ``wandb.init(project, name, dir, config)``, ``log(values, step)``, ``finish()``.

    It never waits on a network it has not been told to use: ``WANDB_MODE`` from the environment is honoured;
    without it and without an API key (:func:`wandb_key_configured`) the run is offline, said in one line
    (``wandb sync`` uploads it later). An online start that fails (no network: W&B gives up after its
    ``init_timeout``) is a warning, and the run logs offline instead. ``run_id``: continue that W&B run (a
    resumed training run continues the W&B run of the checkpoint it resumes from); :attr:`run_id` is this run's."""

    def __init__(self, project: str, name: str | None, save_dir: str | None, config: dict[str, Any],
                 interval: int = 1, run_id: str | None = None):
        super().__init__(interval)
        import wandb

        if save_dir:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
        where = os.path.join(save_dir or os.environ.get("WANDB_DIR") or ".", "wandb")
        mode: Any = None  # WANDB_MODE, or W&B's default (online)
        if not os.environ.get("WANDB_MODE"):
            try:
                default_host = urlsplit(str(wandb.Settings().base_url)).netloc
            except Exception:  # a W&B without that setting: api.wandb.ai is checked anyway
                default_host = ""
            if not wandb_key_configured([default_host]):
                mode = "offline"
                self.note = (f"W&B: no API key (WANDB_API_KEY, ~/.netrc) and WANDB_MODE unset: logging offline in "
                             f"{where} (upload with `wandb sync`; set WANDB_MODE=online to log online)")
        init: dict[str, Any] = dict(project=project, name=name, dir=save_dir, config=config)
        if run_id:
            init |= dict(id=run_id, resume="allow")
        try:
            self._run = wandb.init(**init, mode=mode)
        except Exception as e:
            if mode == "offline" or os.environ.get("WANDB_MODE") == "offline":
                raise
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            warnings.warn(f"--wandb-project: W&B did not start online ({reason}); logging offline in {where} "
                          "instead (upload with `wandb sync`)", stacklevel=2)
            self._run = wandb.init(**init, mode="offline")
        self.run_id: str = str(self._run.id)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self, exit_code: int = 0) -> None:
        self._run.finish(exit_code=exit_code)


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run's flags as W&B's config: every parsed value that is plain data."""
    plain = (str, int, float, bool, type(None), list, tuple)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(vars(args).items())
            if isinstance(v, plain) and k != "checkpoint_defaults"}


def resumed_wandb_run(args: argparse.Namespace) -> str | None:
    """The W&B run a resume continues: the one the ``--load`` checkpoint recorded, when it logged to the same
    ``--wandb-project`` (``None`` for a fresh run, ``--finetune``, or a checkpoint that recorded none)."""
    if not getattr(args, "load", None) or getattr(args, "finetune", False):
        return None
    from ..checkpoint.errors import CheckpointError
    from ..checkpoint.location.locate import manifest_at

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            recorded = manifest_at(args.load).args
    except CheckpointError:
        return None  # nothing to resume (the load says so itself)
    if not recorded or recorded.get("wandb_project") != args.wandb_project:
        return None
    run_id = recorded.get("wandb_run_id")
    return run_id if isinstance(run_id, str) and run_id else None


def open_writers(args: argparse.Namespace) -> list[ScalarWriter]:
    """The writers ``--tensorboard-dir`` and ``--wandb-project`` ask for (called on global rank 0 only)."""
    interval = getattr(args, "tensorboard_log_interval", None) or 1
    writers: list[ScalarWriter] = []
    try:
        if getattr(args, "tensorboard_dir", None):
            writers.append(TensorBoardWriter(args.tensorboard_dir, interval))
        if getattr(args, "wandb_project", None):
            wandb = WandbWriter(args.wandb_project, getattr(args, "wandb_exp_name", None),
                                getattr(args, "wandb_save_dir", None), run_config(args), interval,
                                resumed_wandb_run(args))
            args.wandb_run_id = wandb.run_id  # recorded with every checkpoint's flags: a resume continues the run
            writers.append(wandb)
    except BaseException:
        for writer in writers:
            writer.close(1)
        raise
    return writers


class MetricsLogger:
    """Only the rank that owns it writes (the trainer creates it on global rank 0)."""

    def __init__(self, metrics_file: str | None, log_interval: int, total_iters: int,
                 progress: bool | None = None, stream: TextIO | None = None, enabled: bool = True,
                 writers: Sequence[ScalarWriter] = ()):
        self.enabled = enabled
        self.writers = list(writers)
        """TensorBoard, W&B (:func:`open_writers`): closed by :meth:`close` (see :meth:`writing_to`)."""
        self.path = Path(metrics_file) if metrics_file else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stream = stream or sys.stdout
        self.progress = self.stream.isatty() if progress is None else progress
        self.log_interval = log_interval
        self.total_iters = total_iters
        self.start = time.monotonic()
        self._line_width = 0
        self._first: tuple[int, float] | None = None
        """(iteration, time) of this run's first logged step: the ETA's rate counts from there, so a resumed run
        and the first step's one-off costs do not skew it."""

    def eta(self, iteration: int, now: float | None = None) -> str:
        """Time left to ``total_iters`` at this run's mean rate so far, ``h:mm:ss`` (``?`` until it is known)."""
        now = time.monotonic() if now is None else now
        if self._first is None:
            self._first = (iteration, now)
        done = iteration - self._first[0]
        if done <= 0:
            return "?"
        left = max(0, self.total_iters - iteration) * (now - self._first[1]) / done
        minutes, seconds = divmod(int(round(left)), 60)
        hours, minutes = divmod(minutes, 60)
        return f"{hours}:{minutes:02d}:{seconds:02d}"

    def _append(self, record: dict[str, Any]) -> None:
        if self.enabled and self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def _scalars(self, iteration: int, values: dict[str, float], every: bool = False) -> None:
        if self.enabled:
            for writer in self.writers:
                if every or iteration % writer.interval == 0:
                    writer.scalars(iteration, values)

    def train(self, iteration: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        record = {"iteration": iteration, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_s}
        self._append(record)
        if not self.enabled:
            return
        self._scalars(iteration, {k: v for k, v in record.items() if k != "iteration"})
        eta = self.eta(iteration)
        if self.progress:
            width = 30
            done = int(width * iteration / max(1, self.total_iters))
            bar = "#" * done + "." * (width - done)
            line = (f"[{bar}] {iteration}/{self.total_iters} loss {loss:.4f} lr {lr:.2e} |g| {grad_norm:.3f} "
                    f"{tokens_per_s:,.0f} tok/s ETA {eta}")
            self.stream.write("\r" + line.ljust(self._line_width))  # blank what a longer line left behind
            self._line_width = len(line)
            if iteration >= self.total_iters:
                self.stream.write("\n")
            self.stream.flush()
        elif iteration % self.log_interval == 0 or iteration == self.total_iters:
            self.stream.write(f"iteration {iteration:6d}/{self.total_iters} | loss {loss:.6f} | lr {lr:.3e} | "
                              f"grad norm {grad_norm:.4f} | {tokens_per_s:,.0f} tokens/s\n")
            self.stream.flush()

    def eval(self, iteration: int, eval_loss: float) -> None:
        self._append({"iteration": iteration, "eval_loss": eval_loss})
        if not self.enabled:
            return
        self._scalars(iteration, {"eval_loss": eval_loss}, every=True)
        prefix = "\n" if self.progress else ""
        self.stream.write(f"{prefix}eval at iteration {iteration}: loss {eval_loss:.6f}\n")
        self.stream.flush()

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        prefix = "\n" if self.progress else ""
        self.stream.write(f"{prefix}{message}\n")
        self.stream.flush()

    def close(self, exit_code: int = 0) -> None:
        """Flush and close the writers (once; later calls do nothing)."""
        writers, self.writers = self.writers, []
        failed: Exception | None = None
        for writer in writers:
            try:
                writer.close(exit_code)
            except Exception as e:  # the others are closed all the same
                failed = failed or e
        if failed is not None:
            raise failed

    @contextmanager
    def writing_to(self, writers: Sequence[ScalarWriter]) -> Iterator[MetricsLogger]:
        """The scalars also go to ``writers`` while the body runs; then they are flushed and closed, however the
        body ends, with the exit code the process will have (a signal's stop carries its own; Ctrl-C 130; another
        error 1). A writer that fails to close then does not hide the error that ended the run."""
        self.writers = list(writers)
        for writer in self.writers:
            if writer.note:
                self.info(writer.note)
        try:
            yield self
        except BaseException as e:
            code = 130 if isinstance(e, KeyboardInterrupt) else getattr(e, "exit_code", 1)
            try:
                self.close(code if isinstance(code, int) else 1)
            except Exception:
                pass
            raise
        self.close(0)
