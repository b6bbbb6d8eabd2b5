"""Unit tests for the signal handling of a training run (``peftckpt.train.interrupts``) and the progress ETA."""

from __future__ import annotations

import io
import os
import signal
import sys

import pytest

from peftckpt.train.interrupts import Stop, StopSignals
from peftckpt.train.metrics import MetricsLogger


def test_a_signal_is_recorded_and_stops_at_the_next_boundary() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signals = StopSignals(save_on_sigterm=False)
    assert signals.agreed() is None  # not installed: never asks
    with signals.installed():
        assert signals.agreed() is None
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: only recorded
        stop = signals.agreed()
        assert stop == Stop(signum=signal.SIGINT, save=False)
        assert (stop.name, stop.exit_code) == ("SIGINT", 130)
        with pytest.raises(KeyboardInterrupt):  # the second Ctrl-C stops at once
            os.kill(os.getpid(), signal.SIGINT)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize("save_on_sigterm", [False, True])
def test_sigterm_saves_only_with_the_exit_signal_handler(save_on_sigterm: bool) -> None:
    signals = StopSignals(save_on_sigterm=save_on_sigterm)
    with signals.installed():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)  # SIGTERM after Ctrl-C: SIGTERM's rule applies
        stop = signals.agreed()
    assert stop == Stop(signum=signal.SIGTERM, save=save_on_sigterm)
    assert stop.exit_code == (0 if save_on_sigterm else 143)


def test_progress_line_has_an_eta_from_this_runs_rate() -> None:
    out = io.StringIO()
    log = MetricsLogger(None, 1, total_iters=110, progress=True, stream=out)
    assert log.eta(10, now=100.0) == "?"  # the first step of a (resumed) run: no rate yet
    assert log.eta(20, now=110.0) == "0:01:30"  # 1 s per iteration, 90 left
    assert log.eta(110, now=200.0) == "0:00:00"
    log.train(30, 1.0, 1e-3, 0.5, 100.0)
    assert "ETA " in out.getvalue() and out.getvalue().startswith("\r[")


def test_ctrl_c_in_a_one_process_tool_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from peftckpt import cli

    def interrupted(argv: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "verify", (__name__, "_interrupted_tool", "test"))
    monkeypatch.setattr(sys.modules[__name__], "_interrupted_tool", interrupted, raising=False)
    assert cli.main(["verify", "somewhere"]) == 130
    assert capsys.readouterr().err == "peftckpt verify: interrupted\n"
