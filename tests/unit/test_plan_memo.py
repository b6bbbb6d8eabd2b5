"""Saves laid out like the last committed one reuse its plans (the ranks' gathered pieces and their tiling check,
DCP's plans and metadata of the entries, the commit's checks of those entries): every such checkpoint is still
whole, verified and readable by stock DCP with the values of its own save (its metadata file pickled from the
entries pickled once). Any change of layout -- a shape, a
dtype, an object that became a tensor, an entry more -- and any save after a failed one plans afresh."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from peftckpt.checkpoint.api import Checkpointer, LoadOptions, SaveOptions
from peftckpt.checkpoint.errors import CheckpointError
from peftckpt.checkpoint.faults import FAULT_ENV
from peftckpt.checkpoint.storage.formats import TorchDistFormat
from peftckpt.checkpoint.storage.plan_memo import PlanMemo
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from peftckpt.checkpoint.tools.verify import verify_checkpoint
from tests.integration.cli import read_dcp_tensors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KW = dict(layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, coords={"tp": 0, "pp": 0, "dp": 0},
          model_config={"width": 16})
TRAINABLE = SaveOptions(trainable_only=True)


def _run(head: int = 4, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, head)).to(dtype)
    model[0].requires_grad_(False)
    return model, torch.optim.AdamW(model[1].parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 16, dtype=model[1].weight.dtype)).sum().backward()
    opt.step()
    opt.zero_grad()


def _plans(ckpt: Checkpointer) -> PlanMemo:
    assert ckpt._saves.last is not None
    return ckpt._saves.last.plans


def _check(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """``path`` verifies, and stock DCP reads the adapter and its Adam moments as they were saved."""
    assert verify_checkpoint(path).problems == []
    stored = read_dcp_tensors(path)
    torch.testing.assert_close(stored["model.1.weight"], model[1].weight.detach(), rtol=0, atol=0)
    torch.testing.assert_close(stored["optimizer.state.1.weight.exp_avg"], opt.state[model[1].weight]["exp_avg"],
                               rtol=0, atol=0)
    assert "model.0.weight" not in stored


def test_saves_laid_out_alike_reuse_the_plans_and_stay_whole(tmp_path: Path) -> None:
    model, opt = _run()
    _step(model, opt)
    ckpt = Checkpointer([model], opt, **KW)
    first = ckpt.save(tmp_path, 1, {"iteration": "x"}, TRAINABLE)
    memo = _plans(ckpt)
    assert memo.plan is not None and memo.metadata is not None and memo.structure is not None
    assert memo.pickler is not None and memo.pickler.entries is memo.metadata.state_dict_metadata
    _check(Path(first), model, opt)
    picklers, places, wholes = [memo.pickler], [r.storage_data for r in memo.written], [memo.whole]
    for it in (2, 3):  # new values (a step), new object values: the same layout
        _step(model, opt)
        path = ckpt.save(tmp_path, it, {"iteration": "x" * 5000}, TRAINABLE)  # (an object grows at save 2)
        assert _plans(ckpt) is memo
        _check(Path(path), model, opt)
        picklers.append(memo.pickler)
        wholes.append(memo.whole)
        # Tensors lie where they did (objects after them): their storage items are reused; the objects after
        # the one that grew moved, so save 2 pickles the items once more, and save 3 reuses that pickler.
        tensors = [r for r in memo.written if r.index.fqn.startswith(("model.", "optimizer.state."))]
        assert tensors and all(any(r.storage_data is p for p in places) for r in tensors)
        grown = next(r for r in memo.written if r.index.fqn == "iteration")
        assert grown.size_in_bytes > 5000 and grown.storage_data.offset > max(r.storage_data.offset for r in tensors)
    assert picklers[1] is not picklers[0] and picklers[2] is picklers[1]
    # The commit's per-item checks: save 2's items moved (checked afresh, recorded), save 3's equal save 2's
    # (the same verdict: only its files examined)
    assert None not in wholes and wholes[1] is not wholes[0] and wholes[2] is wholes[1]
    handle = ckpt.async_save(tmp_path, 4, {"iteration": "y"}, TRAINABLE)  # async saves share the memo too
    assert Path(handle.result()).name == "iter_0000004" and _plans(ckpt) is memo
    _check(Path(handle.path), model, opt)

    # A load of the reused-plan checkpoint restores exactly (its manifest and storage checks pass).
    fresh, fresh_opt = _run()
    Checkpointer([fresh], fresh_opt, **KW).load(tmp_path, LoadOptions(strictness="ignore_all"))
    torch.testing.assert_close(fresh[1].weight, model[1].weight, rtol=0, atol=0)


@pytest.mark.parametrize("change", ["shape", "dtype", "object", "entry", "format", "full"])
def test_a_changed_layout_is_planned_afresh(tmp_path: Path, change: str) -> None:
    model, opt = _run()
    _step(model, opt)
    ckpt = Checkpointer([model], opt, **KW)
    objects: dict[str, object] = {"iteration": 1}
    ckpt.save(tmp_path, 1, objects, TRAINABLE)
    memo = _plans(ckpt)
    options = TRAINABLE
    if change == "shape":  # the user swaps in a wider head (same modules, same optimizer)
        model[1] = nn.Linear(16, 6)
        opt.param_groups[0]["params"] = list(model[1].parameters())
        opt.state.clear()
        _step(model, opt)
    elif change == "dtype":  # ... or casts it: the same parameters, another dtype
        model[1].to(torch.float64)
        opt.state.clear()
        model[0].to(torch.float64)
        _step(model, opt)
    elif change == "object":
        objects = {"iteration": torch.zeros(3)}
    elif change == "entry":
        objects = {"iteration": 1, "extra": 2}
    elif change == "format":
        options = SaveOptions(ckpt_format="torch")
    else:
        options = SaveOptions()
    path = Path(ckpt.save(tmp_path, 2, objects, options))
    assert _plans(ckpt) is not memo
    if change == "format":
        return
    assert verify_checkpoint(path).problems == []
    stored = read_dcp_tensors(path)
    torch.testing.assert_close(stored["model.1.weight"], model[1].weight.detach(), rtol=0, atol=0)
    assert stored["model.1.weight"].dtype == model[1].weight.dtype
    assert ("model.0.weight" in stored) == (change == "full")
    if change == "object":
        assert torch.equal(stored["iteration"], torch.zeros(3))


@pytest.mark.parametrize("damage", ["truncated", "removed", "moved item"])
def test_a_reused_verdict_still_examines_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   damage: str) -> None:
    """A save laid out like the last whole one, whose data file is damaged (or an item's recorded place changed)
    between its write and its commit, is refused: the reused verdict covers equal items in files of equal size,
    and the files themselves are examined each time."""
    model, opt = _run()
    _step(model, opt)
    ckpt = Checkpointer([model], opt, **KW)
    ckpt.save(tmp_path, 1, {"iteration": 1}, TRAINABLE)
    assert _plans(ckpt).whole is not None
    check = TorchDistFormat.written_problems

    def damaged(self: TorchDistFormat, staging: Path, files: Any, saved_keys: Any, plans: PlanMemo,
                stored: Any = None, metadata: Any = None) -> list[str]:
        data = next(staging.glob("*.distcp"))
        if damage == "truncated":
            os.truncate(data, data.stat().st_size - 1)
        elif damage == "removed":
            data.unlink()
        else:  # the metadata records the adapter's bytes past the end of the file
            index = next(i for i in metadata.storage_data if i.fqn == "model.1.weight")
            info = metadata.storage_data[index]
            metadata.storage_data[index] = _StorageInfo(info.relative_path, info.offset + 10**6, info.length)
        return check(self, staging, files, saved_keys, plans, stored, metadata)
    monkeypatch.setattr(TorchDistFormat, "written_problems", damaged)
    _step(model, opt)
    with pytest.raises(CheckpointError, match="not whole") as refused:
        ckpt.save(tmp_path, 2, {"iteration": 1}, TRAINABLE)
    assert ("lie outside" if damage == "moved item" else "__0_0.distcp") in str(refused.value)
    assert not (tmp_path / "iter_0000002").exists()


def test_a_save_after_a_failed_one_plans_afresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _run()
    _step(model, opt)
    ckpt = Checkpointer([model], opt, **KW)
    monkeypatch.setenv(FAULT_ENV, "before_manifest:eio:iteration=1")
    with pytest.raises(CheckpointError, match="injected I/O error"):
        ckpt.save(tmp_path, 1, {"iteration": 1}, TRAINABLE)
    failed = _plans(ckpt)
    monkeypatch.delenv(FAULT_ENV)
    path = ckpt.save(tmp_path, 2, {"iteration": 2}, TRAINABLE)
    assert _plans(ckpt) is not failed
    _check(Path(path), model, opt)
    ckpt.save(tmp_path, 3, {"iteration": 3}, TRAINABLE)
    assert _plans(ckpt) is not failed


def _first_save_memo(tmp_path: Path) -> PlanMemo:
    """The plan memo a first trainable-only save (iteration 1, after one step) leaves."""
    model, opt = _run()
    _step(model, opt)
    ckpt = Checkpointer([model], opt, **KW)
    ckpt.save(tmp_path, 1, {"iteration": 1}, TRAINABLE)
    return _plans(ckpt)


def test_the_metadata_pickle_of_reused_entries_is_an_ordinary_pickle(tmp_path: Path) -> None:
    """The entries pickled once and each save's storage items after them load -- with stock pickle and with the
    restricted reader -- as the metadata itself; a metadata of other entries is refused."""
    memo = _first_save_memo(tmp_path)
    assert memo.pickler is not None and memo.metadata is not None
    written = load_dcp_metadata(tmp_path / "iter_0000001" / ".metadata")
    for shift in (0, 17):  # another save's items: same indices, other places
        metadata = Metadata(memo.metadata.state_dict_metadata, storage_data={
            index: _StorageInfo(info.relative_path, info.offset + shift, info.length)
            for index, info in memo.metadata.storage_data.items()}, version="1.0.0")
        data = memo.pickler.dumps(metadata)
        (tmp_path / "m").write_bytes(data)
        for loaded in (pickle.loads(data), load_dcp_metadata(tmp_path / "m")):
            assert loaded.state_dict_metadata == written.state_dict_metadata
            assert loaded.storage_data == metadata.storage_data and loaded.version == "1.0.0"
    with pytest.raises(ValueError, match="other entries"):
        memo.pickler.dumps(Metadata(dict(memo.metadata.state_dict_metadata)))


def test_equal_copies_of_the_storage_items_are_pickled_as_references(tmp_path: Path) -> None:
    """The coordinator receives the other ranks' write results as copies: where they equal the items pickled,
    entry for entry, the pickler adopts its own objects (their pickle is memo references, a fraction of the
    size); a moved item, a different index, or another count is not adopted."""
    memo = _first_save_memo(tmp_path)
    assert memo.pickler is not None and memo.metadata is not None
    held = memo.metadata.storage_data
    copies = pickle.loads(pickle.dumps(held))  # as gathered
    adopted = memo.pickler.adopt(copies)
    assert adopted == held
    assert all(k is hk and v is hv for (k, v), (hk, hv) in zip(adopted.items(), held.items()))
    as_copies = memo.pickler.dumps(Metadata(memo.metadata.state_dict_metadata, storage_data=copies))
    as_adopted = memo.pickler.dumps(Metadata(memo.metadata.state_dict_metadata, storage_data=adopted))
    assert pickle.loads(as_adopted).storage_data == held == pickle.loads(as_copies).storage_data
    assert len(as_copies) - len(as_adopted) >= 20 * len(held)  # (each copy pickled anew: its index and place)
    first = next(iter(copies))
    moved = dict(copies)
    moved[first] = _StorageInfo(copies[first].relative_path, copies[first].offset + 1, copies[first].length)
    renamed = {(MetadataIndex("other", k.offset, k.index) if k is first else k): v for k, v in copies.items()}
    fewer = dict(list(copies.items())[1:])
    assert memo.pickler.adopt(moved) is None and memo.pickler.adopt(renamed) is None
    assert memo.pickler.adopt(fewer) is None


def test_repeated_write_results_travel_as_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank whose write results are the very ones of the save before sends a token; the coordinator puts back
    the results it gathered then (the same objects), and the checkpoint is whole and loads. A token the
    coordinator cannot resolve is a bug, refused."""
    from peftckpt.checkpoint.storage import dcp_writer

    finished: list[list[list[Any]]] = []
    original = dcp_writer.FramedFileSystemWriter.finish

    def spy(self: Any, metadata: Metadata, results: list[list[Any]]) -> None:
        finished.append(results)
        original(self, metadata, results)

    monkeypatch.setattr(dcp_writer.FramedFileSystemWriter, "finish", spy)
    model, opt = _run()
    _step(model, opt)
    ckpt = Checkpointer([model], opt, **KW)
    for iteration in (1, 2, 3):
        ckpt.save(tmp_path, iteration, {"iteration": 1}, TRAINABLE)
    memo = _plans(ckpt)
    assert memo.wrote and memo.gathered == finished[-1]
    assert finished[2][0] is finished[1][0] is finished[0][0]  # put back: the first save's very list
    assert verify_checkpoint(tmp_path / "iter_0000003").ok
    fresh, fresh_opt = _run()
    Checkpointer([fresh], fresh_opt, **KW).load(tmp_path, LoadOptions(strictness="ignore_all"))
    assert torch.equal(fresh[1].weight, model[1].weight)
    memo.gathered = []
    with pytest.raises(Exception, match="said to repeat the last save's"):
        ckpt.save(tmp_path, 4, {"iteration": 1}, TRAINABLE)
