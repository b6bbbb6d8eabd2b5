"""A save laid out like the last one writes its tensors through the layout the last one left
(:mod:`peftckpt.checkpoint.storage.framed_layout`): the data file is byte for byte the one the per-item path writes
for the same values -- records, block digests of one and of several blocks, the index -- so stock DCP, our loads
and ``verify`` read it as before; a tensor that does not fit its slot is refused, never written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from peftckpt.checkpoint.api import Checkpointer, LoadOptions
from peftckpt.checkpoint.storage import dcp_writer
from peftckpt.checkpoint.storage.framed_layout import SMALL_BYTES, FramedLayout, TensorSlot
from peftckpt.checkpoint.storage.framing import BLOCK_BYTES, tensor_record
from peftckpt.checkpoint.tools.verify import verify_checkpoint
from tests.integration.cli import read_dcp_tensors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KW = dict(layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, coords={"tp": 0, "pp": 0, "dp": 0},
          model_config={"width": 32})


class _Mixed(nn.Module):
    """Tensors of every kind a data file holds: small and larger than SMALL_BYTES, over one block, of several
    dtypes, a scalar, an empty one, a non-contiguous one."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(32, 16)
        self.large = nn.Linear(256, 128)  # 128 KiB of fp32: written from its own memory
        self.blocks = nn.Parameter(torch.randn(3 * BLOCK_BYTES // 8))  # 1.5 MiB: two block digests
        self.brain = nn.Parameter(torch.randn(40, 24).to(torch.bfloat16))
        self.frozen = nn.Parameter(torch.randn(64, 8), requires_grad=False)
        self.register_buffer("count", torch.tensor(3.0))
        self.register_buffer("empty", torch.zeros(0, 4))
        self.register_buffer("mask", torch.rand(33) > 0.5)
        self.register_buffer("transposed", torch.randn(12, 20).t())


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    loss = model.small(torch.randn(2, 32)).sum() + model.large(torch.randn(2, 256)).sum() + model.blocks.sum() \
        + model.brain.float().sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _data(ckpt: Path) -> bytes:
    (data,) = ckpt.glob("*.distcp")
    return data.read_bytes()


def test_a_repeated_layout_writes_the_per_item_paths_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert SMALL_BYTES < 128 * 256 * 4
    torch.manual_seed(0)
    model = _Mixed()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    _step(model, optimizer)
    framed_writes: list[int] = []
    original = FramedLayout.write

    def counted(self: FramedLayout, out: object, tensors: list[torch.Tensor]) -> list[str]:
        framed_writes.append(len(tensors))
        return original(self, out, tensors)  # type: ignore[arg-type]

    monkeypatch.setattr(FramedLayout, "write", counted)
    run = Checkpointer([model], optimizer, **KW)
    run.save(tmp_path / "run", 1)  # the first save of the layout: per item
    assert framed_writes == []
    _step(model, optimizer)  # new values, same layout
    second = run.save(tmp_path / "run", 2)
    assert len(framed_writes) == 1 and framed_writes[0] >= 12  # every tensor item went through the layout
    fresh = Checkpointer([model], optimizer, **KW).save(tmp_path / "fresh", 2)  # a first save: per item
    assert len(framed_writes) == 1
    assert _data(second) == _data(fresh)

    report = verify_checkpoint(second)
    assert report.ok, report.problems
    plain = read_dcp_tensors(second, "model.")  # stock DCP, stock torch.load
    for name, tensor in model.state_dict().items():
        assert torch.equal(plain[f"model.{name}"], tensor), name
    torch.manual_seed(1)
    other = _Mixed()
    target = Checkpointer([other], torch.optim.AdamW([p for p in other.parameters() if p.requires_grad]), **KW)
    target.load(second, LoadOptions())
    for (name, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_tensor_that_does_not_fit_its_slot_is_refused() -> None:
    class Sink:
        def write_views(self, views: object) -> None:
            raise AssertionError("nothing may be written")

    slots, at = [], 0
    for t in (torch.zeros(4, 4), torch.zeros(70_000)):
        record = tensor_record(t)
        assert record is not None
        slots.append(TensorSlot(at, record))
        at += record.length
    layout = FramedLayout.matching(slots)
    assert layout is not None
    with pytest.raises(ValueError, match="tensor item 0 holds 32 bytes, its layout 64"):
        layout.write(Sink(), [torch.zeros(8), torch.zeros(70_000)])
    with pytest.raises(ValueError, match="tensor item 1 holds"):
        layout.write(Sink(), [torch.zeros(4, 4), torch.zeros(69_999)])
    with pytest.raises(ValueError, match="1 tensors for a layout of 2"):
        layout.write(Sink(), [torch.zeros(4, 4)])
    assert FramedLayout.matching(slots[1:]) is None  # not laid out from the file's start: no layout


def test_a_streaming_save_never_takes_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Entries produced only as they are written must be resolved one at a time: the writer asks the planner."""
    from peftckpt.checkpoint.storage.planners import EntrySavePlanner
    from peftckpt.sharding.entries import LazyGlobalTensor

    planner = EntrySavePlanner()
    planner.state_dict = {"a": LazyGlobalTensor((2,), torch.float32, lambda: torch.zeros(2))}
    assert planner.streams()
    planner.state_dict = {"a": 1}
    assert not planner.streams()
    assert dcp_writer.EntrySavePlanner is EntrySavePlanner
