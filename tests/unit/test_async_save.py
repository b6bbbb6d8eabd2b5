"""Async saves (single process): what training may touch while the background write runs.

The writer is held at its first item (through the ``data`` fault point) so that "while the save is in
flight" is a fact of the test, not a race with the background thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from peftckpt.checkpoint.api import Checkpointer, LoadOptions, SaveOptions
from peftckpt.checkpoint.errors import CheckpointError
from peftckpt.checkpoint.location.directory import read_tracker
from peftckpt.checkpoint.rank_parts import RankParts
from peftckpt.checkpoint.storage import formats

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KW = dict(layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, coords={"tp": 0, "pp": 0, "dp": 0},
          model_config={"hidden_size": 8})
FROZEN = {"model.base.weight", "model.base.bias"}


class Net(nn.Module):
    """A frozen base linear, a trainable adapter and a buffer that the forward pass updates in place."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Linear(8, 8).requires_grad_(False)
        self.adapter = nn.Linear(8, 8, bias=False)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.base(x) + self.adapter(x)


def _step(net: Net, opt: torch.optim.Optimizer) -> None:
    net(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _trained(seed: int = 0) -> tuple[Net, torch.optim.Optimizer, Checkpointer]:
    net = Net(seed)
    opt = torch.optim.AdamW(net.adapter.parameters(), lr=0.1)
    _step(net, opt)
    return net, opt, Checkpointer([net], opt, **KW)


def _state(net: Net, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone() for k, v in net.state_dict().items()}
    for stat in ("exp_avg", "exp_avg_sq"):
        out[f"optimizer.{stat}"] = opt.state[net.adapter.weight][stat].clone()
    return out


@pytest.fixture
def held_writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The background write waits at its first item until the returned event is set."""
    release = threading.Event()

    def fault_point(point: str, rank: int, iteration: int) -> None:
        if point == "data" and threading.current_thread() is not threading.main_thread():
            assert release.wait(30), "the test never released the writer"

    monkeypatch.setattr(formats, "fault_hook", lambda point, rank, iteration: lambda: fault_point(point, rank, iteration))
    yield release
    release.set()


def test_async_full_save_holds_the_state_of_the_call(tmp_path: Path, held_writer: threading.Event) -> None:
    net, opt, ckpt = _trained()
    at_save = _state(net, opt)
    ckpt.save(tmp_path, 1, {"iteration": 1}, SaveOptions(async_save=True))
    # Only what training updates in place was copied: the frozen base is written from live memory.
    assert set(ckpt._host_buffers) == {"model.adapter.weight", "model.calls", "optimizer.state.adapter.weight.exp_avg",
                                       "optimizer.state.adapter.weight.exp_avg_sq"}
    _step(net, opt)  # adapter, Adam moments and the buffer change while the save is in flight
    assert not torch.equal(net.adapter.weight, at_save["model.adapter.weight"])
    held_writer.set()
    ckpt.wait()

    fresh, fresh_opt, fresh_ckpt = _trained(seed=7)
    result = fresh_ckpt.load(tmp_path, LoadOptions(objects=["iteration"]))
    assert result.iteration == 1
    for key, value in _state(fresh, fresh_opt).items():
        assert torch.equal(value, at_save[key]), key


def test_frozen_weight_changed_during_async_save_discards_it(tmp_path: Path, held_writer: threading.Event) -> None:
    net, opt, ckpt = _trained()
    ckpt.save(tmp_path, 1, {"iteration": 1})  # committed, synchronously
    ckpt.save(tmp_path, 2, {"iteration": 2}, SaveOptions(async_save=True))
    with torch.no_grad():
        net.base.weight.mul_(2.0)  # e.g. merge_lora while the save is in flight
    held_writer.set()
    with pytest.raises(CheckpointError) as err:
        ckpt.wait()
    message = str(err.value)
    assert "async save of iteration 2" in message
    assert "1 frozen parameter(s) were modified in place while an async save was writing them " \
           "(model.base.weight): the save is discarded" in message
    assert "the previously committed checkpoint and the tracker are unchanged" in message
    assert read_tracker(tmp_path) == 1
    assert not (tmp_path / "iter_0000002").exists()
    assert ckpt.load(tmp_path).iteration == 1


def test_load_commits_the_async_save_in_flight_first(tmp_path: Path) -> None:
    net, opt, ckpt = _trained()
    ckpt.save(tmp_path, 1, {"iteration": 1})
    ckpt.save(tmp_path, 2, {"iteration": 2}, SaveOptions(async_save=True, trainable_only=True))
    assert ckpt.save_in_flight
    # The tracker still names iteration 1 until the async save is committed; load commits it first.
    assert ckpt.load(tmp_path).iteration == 2
    assert not ckpt.save_in_flight


@pytest.fixture
def held_snapshot(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """A deferred snapshot's copy to host memory waits until the returned event is set."""
    release = threading.Event()
    copy = formats.host_copy

    def held(*args: object, **kwargs: object) -> object:
        assert release.wait(30), "the test never released the snapshot"
        return copy(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(formats, "host_copy", held)
    yield release
    release.set()


DEFERRED = SaveOptions(async_save=True, defer_snapshot=True)


def _fence_holds_until(ckpt: Checkpointer, release: threading.Event) -> None:
    """The fence (before the optimizer step) waits while the save's thread is held, and returns once released."""
    fenced = threading.Thread(target=ckpt.snapshot_fence)
    fenced.start()
    fenced.join(0.3)
    assert fenced.is_alive()
    release.set()
    fenced.join(30)
    assert not fenced.is_alive()


def test_deferred_snapshot_overlaps_the_next_step_up_to_the_fence(tmp_path: Path,
                                                                  held_snapshot: threading.Event) -> None:
    """The save call returns before anything is copied; the forward/backward of the next step may run (its
    in-place buffer update does not reach the checkpoint: buffers are copied at the call); the optimizer step
    waits on ``snapshot_fence``; the checkpoint holds the state of the call."""
    net, opt, ckpt = _trained()
    at_save = _state(net, opt)
    ckpt.save(tmp_path, 1, {"iteration": 1}, DEFERRED)
    assert not ckpt._host_buffers  # nothing copied yet
    net(torch.randn(4, 8)).square().sum().backward()  # the next forward/backward, while the copy waits
    _fence_holds_until(ckpt, held_snapshot)
    opt.step()
    opt.zero_grad()
    ckpt.wait()
    fresh, fresh_opt, fresh_ckpt = _trained(seed=7)
    assert fresh_ckpt.load(tmp_path, LoadOptions(objects=["iteration"])).iteration == 1
    for key, value in _state(fresh, fresh_opt).items():
        assert torch.equal(value, at_save[key]), key


def test_a_deferred_save_builds_its_entries_in_its_own_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The call takes the objects, the RNG state and the buffers as they are and returns before any entry is built;
    the entries are built (and copied) in the save's thread while the next forward/backward runs, up to the fence;
    the checkpoint holds the state of the call -- objects, buffers and RNG state included."""
    release = threading.Event()
    built_on_main: list[bool] = []
    model_sections = RankParts.model_sections

    def held(self: RankParts) -> dict[str, dict[str, object]]:
        built_on_main.append(threading.current_thread() is threading.main_thread())
        assert built_on_main[-1] or release.wait(30), "the test never released the entries"
        return model_sections(self)

    monkeypatch.setattr(RankParts, "model_sections", held)
    net, opt, ckpt = _trained()
    at_save = _state(net, opt)
    loader = {"position": 5}
    ckpt.save(tmp_path, 1, {"iteration": 1, "loader": loader}, DEFERRED)
    loader["position"] = 6  # the caller's object changes once the call returned
    after_call = torch.rand(3)  # drawn after the call: a load of the checkpoint draws it again
    net(torch.randn(4, 8)).square().sum().backward()  # the next forward (its buffer update) and backward
    _fence_holds_until(ckpt, release)
    assert built_on_main == [False]
    opt.step()
    opt.zero_grad()
    ckpt.wait()
    fresh, fresh_opt, fresh_ckpt = _trained(seed=7)
    assert fresh_ckpt.load(tmp_path, LoadOptions(objects=["loader"])).objects["loader"] == {"position": 5}
    for key, value in _state(fresh, fresh_opt).items():
        assert torch.equal(value, at_save[key]), key
    assert torch.equal(torch.rand(3), after_call)


def test_a_step_before_the_fence_discards_the_deferred_save(tmp_path: Path, held_snapshot: threading.Event) -> None:
    net, opt, ckpt = _trained()
    held_snapshot.set()
    ckpt.save(tmp_path, 1, {"iteration": 1}, DEFERRED)
    ckpt.wait()
    held_snapshot.clear()
    ckpt.save(tmp_path, 2, {"iteration": 2}, DEFERRED)
    _step(net, opt)  # the optimizer step without the fence: the adapter and its moments change under the copy
    held_snapshot.set()
    with pytest.raises(CheckpointError) as err:
        ckpt.wait()
    message = str(err.value)
    assert "were modified in place before an async save had copied them (model.adapter.weight, " \
           "optimizer.state.adapter.weight.exp_avg, optimizer.state.adapter.weight.exp_avg_sq)" in message
    assert "Call Checkpointer.snapshot_fence() before the optimizer step" in message
    assert read_tracker(tmp_path) == 1 and not (tmp_path / "iter_0000002").exists()
