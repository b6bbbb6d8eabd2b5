"""Python's cyclic collector is paused while a save or load runs (a full collection scans the whole heap of a
process holding a model, once per few thousand objects a save builds) and resumed after it: nested, shared by
threads, after errors, and never left paused."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from peftckpt import Checkpointer, LoadOptions, SaveOptions
from peftckpt.checkpoint.gc_pause import paused_gc

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Probe:
    """A saved object that records whether the collector ran automatically when it was pickled."""

    seen: list[bool] = []

    def __getstate__(self) -> dict[str, Any]:
        Probe.seen.append(gc.isenabled())
        return {}


def test_nesting_errors_and_threads() -> None:
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer section still runs
    assert gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()

    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    thread.start()
    inside.wait(10)
    with paused_gc():
        pass
    assert not gc.isenabled()  # the other thread's section has not ended
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # the user's choice, not ours to undo
    finally:
        gc.enable()


def test_saves_and_loads_run_with_the_collector_paused(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    Probe.seen.clear()
    with Checkpointer([model], optimizer) as ckpt:
        ckpt.save(tmp_path / "sync", 1, {"probe": Probe()}, SaveOptions(trainable_only=True))
        assert gc.isenabled()
        pending = ckpt.async_save(tmp_path / "async", 2, {"probe": Probe()}, SaveOptions(trainable_only=True))
        pending.result()
        assert gc.isenabled()
        ckpt.load(tmp_path / "sync", LoadOptions())
        assert gc.isenabled()
    # both saves pickled it (the async one also deep-copied it first), each time with the collector paused
    assert len(Probe.seen) >= 2 and not any(Probe.seen), Probe.seen
    assert gc.isenabled()
