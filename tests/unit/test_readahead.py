"""Read-ahead of DCP loads: it reads what the reader will read, in order, never more than a window ahead."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from peftckpt.checkpoint.storage import readahead
from peftckpt.checkpoint.storage.planners import EntryLoadPlanner, EntrySavePlanner
from peftckpt.checkpoint.storage.readahead import ReadAhead, _merge
from peftckpt.checkpoint.storage.safe_pickle import SafeFileSystemReader

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_adjacent_ranges_of_a_file_merge_into_runs() -> None:
    a, b = Path("a"), Path("b")
    schedule = [(a, 0, 10), (a, 10, 5), (a, 12, 10), (b, 0, 4), (a, 40, 1), (a, 22, 3)]
    assert _merge(schedule) == [(a, 0, 22), (b, 0, 4), (a, 40, 1), (a, 22, 3)]


def test_stays_within_its_window_of_the_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    block, window, blocks = 4096, 3 * 4096, 10
    path = tmp_path / "data"
    path.write_bytes(os.urandom(block * blocks))
    leads: list[int] = []
    progressed = threading.Condition()
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        leads.append(ahead._read - ahead._consumed)  # what it had read beyond the reader, before this read
        n = real_preadv(fd, buffers, offset)
        with progressed:
            progressed.notify_all()
        return n

    monkeypatch.setattr(readahead.os, "preadv", preadv)
    ahead = ReadAhead([(path, 0, block * blocks)], window=window, block=block)
    with ahead:
        for k in range(blocks):
            # the reader takes block k once the read-ahead has fetched it -- the first only once the read-ahead
            # filled its whole window, so how far ahead it runs does not depend on how the threads are scheduled
            need = window if k == 0 else (k + 1) * block
            with progressed:
                assert progressed.wait_for(lambda n=need: ahead._read >= n, timeout=30)
            ahead.consumed(block)
    assert ahead._read == block * blocks
    assert len(leads) == blocks and max(leads) == window - block


def test_a_dcp_load_through_the_reader_is_exact(tmp_path: Path) -> None:
    state = {f"t{i}": torch.randn(64, 33 + i) for i in range(12)}
    state["obj"] = {"step": 3}  # a bytes item among the tensors
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path, thread_count=1), planner=EntrySavePlanner())
    target = {k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)}
    target["obj"] = None
    dcp.load(target, storage_reader=SafeFileSystemReader(tmp_path), planner=EntryLoadPlanner())
    assert target["obj"] == {"step": 3}
    assert all(torch.equal(target[k], v) for k, v in state.items() if isinstance(v, torch.Tensor))


def test_a_missing_file_is_left_to_the_reader(tmp_path: Path) -> None:
    with ReadAhead([(tmp_path / "gone", 0, 100)]) as ahead:
        ahead.consumed(100)
    assert ahead._read == 0
