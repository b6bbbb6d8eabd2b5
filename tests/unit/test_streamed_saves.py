"""Saves to an object store stream each rank's data file straight into its object (issue 27: no local spool):
parts uploaded while the file is written, a bounded number held, nothing visible before the object is complete,
nothing left behind by a failure -- and what a killed save left unfinished is aborted by the next run's save.
Against the real S3-compatible server (moto)."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from peftckpt import CheckpointError
from peftckpt.checkpoint.api import Checkpointer
from peftckpt.checkpoint.faults import FAULT_ENV
from peftckpt.checkpoint.location import protocol, store_writes
from peftckpt.checkpoint.location.locate import locate
from peftckpt.checkpoint.location.store import cache_root
from peftckpt.checkpoint.storage import object_writes
from peftckpt.checkpoint.storage.object_store import ObjectStore
from peftckpt.checkpoint.storage.object_writes import PARTS_IN_FLIGHT, ObjectWriter

from ..s3_server import S3Server
from .small_model import COORDS, LAYOUT

MIB = 1 << 20


class _SlowStore(ObjectStore):
    """The real store, with each part upload held a while and watched: how many at once, from how many buffers;
    ``fail_part``: that part's upload fails as an unreachable store does."""

    def __init__(self, url: str, fail_part: int = 0) -> None:
        super().__init__(url)
        self.fail_part = fail_part
        self.in_flight = self.most_in_flight = 0
        self.buffers: set[int] = set()
        self._guard = threading.Lock()

    def upload_part(self, rel: str, upload_id: str, number: int, data: bytes | bytearray) -> str:
        with self._guard:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            if len(data) == 5 * MIB:  # a full part's buffer (the last part goes as a copy of its bytes)
                self.buffers.add(id(data))
        try:
            time.sleep(0.05)
            if number == self.fail_part:
                raise ConnectionError("the connection was reset")
            return super().upload_part(rel, upload_id, number, data)
        finally:
            with self._guard:
                self.in_flight -= 1


def test_an_object_is_written_in_parts_with_a_bounded_number_held(s3: S3Server) -> None:
    store = _SlowStore(s3.url("writer"))
    data = torch.randint(0, 256, (43 * MIB + 123,), dtype=torch.uint8).numpy().tobytes()
    writer = ObjectWriter(store, "obj", part_bytes=5 * MIB)
    for at in range(0, len(data), 3 * MIB):  # writes straddling the parts
        writer.write(memoryview(data)[at:at + 3 * MIB])
    assert not store.exists("obj")  # nothing visible before it is complete
    writer.close()
    assert store.read_bytes("obj") == data and writer.written == len(data)
    # 9 parts, at most PARTS_IN_FLIGHT at once, from at most one buffer more than that (reused, not reallocated)
    assert writer.requests == 1 + 9 + 1
    assert 1 < store.most_in_flight <= PARTS_IN_FLIGHT
    assert len(store.buffers) <= PARTS_IN_FLIGHT + 1
    assert store.unfinished_uploads() == []
    small = ObjectWriter(store, "small")  # smaller than a part: one PUT, no multipart upload
    small.write(b"hello")
    small.close()
    assert store.read_bytes("small") == b"hello" and small.requests == 1


def test_parts_grow_so_that_a_large_file_fits_the_stores_part_limit(s3: S3Server,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(object_writes, "PARTS_BEFORE_GROWING", 2)  # (2,000 in earnest)
    store = _SlowStore(s3.url("growing"))
    data = torch.randint(0, 256, (43 * MIB,), dtype=torch.uint8).numpy().tobytes()
    writer = ObjectWriter(store, "obj", part_bytes=5 * MIB)
    writer.write(data)
    writer.close()
    assert store.read_bytes("obj") == data
    assert writer.requests == 1 + 5 + 1  # parts of 5, 5, 10, 10 and the last 13 of 20 MiB


def test_a_failed_part_leaves_nothing_and_names_the_object(s3: S3Server) -> None:
    store = _SlowStore(s3.url("failing"), fail_part=2)
    writer = ObjectWriter(store, "obj", part_bytes=5 * MIB)
    with pytest.raises(CheckpointError) as raised:
        for _ in range(8):
            writer.write(b"x" * 3 * MIB)
        writer.close()
    writer.abort()
    assert str(raised.value).startswith(f"{s3.url('failing')}/obj: cannot reach the object store"), raised.value
    dropped = ObjectWriter(store, "dropped", part_bytes=5 * MIB)  # never closed: abandoned, not completed
    dropped.write(b"z" * 6 * MIB)
    assert len(store.unfinished_uploads()) == 1
    del dropped
    gc.collect()
    assert store.list_files() == {} and store.unfinished_uploads() == []


def _large_checkpointer(seed: int) -> tuple[Checkpointer, nn.Module]:
    """~24 MiB of weights and Adam moments in one rank's data file (several 5 MiB parts)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    return Checkpointer([model], opt, layout=LAYOUT, coords=COORDS, model_config={"width": 1024}), model


def test_a_save_streams_its_data_file_and_never_spools_it(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The data file goes to the store in parts as it is written: a save stopped before its manifest left the
    complete object on the store and no copy of it in the node-local spool; the retry commits, and loads back."""
    monkeypatch.setattr(object_writes, "PART_BYTES", 5 * MIB)
    url = s3.url("streamed")
    ckpt, model = _large_checkpointer(0)
    monkeypatch.setenv(FAULT_ENV, "before_manifest:eio")
    with pytest.raises(CheckpointError, match="injected I/O error"):
        ckpt.save(url, 1)
    monkeypatch.delenv(FAULT_ENV)
    store = ObjectStore(url)
    stored = store.list_files()
    assert stored["iter_0000001/__0_0.distcp"] > 20 * MIB, stored  # streamed whole, never committed
    spooled = [p.name for p in (cache_root() / "spool").rglob("*") if p.is_file()]
    assert ".metadata" in spooled and not any(name.endswith(".distcp") for name in spooled), spooled
    ckpt.save(url, 1)
    ckpt.close()
    other, loaded = _large_checkpointer(1)
    assert other.load(url).iteration == 1
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert store.unfinished_uploads() == []


def test_uploads_a_killed_save_left_unfinished_are_aborted_once_per_run(
        s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed mid-object leaves a multipart upload nobody will complete (stored, and billed, until
    aborted): the next run's first save aborts it -- not one of a save in progress -- and later saves do not
    list the uploads again."""
    url = s3.url("killed")
    store = ObjectStore(url)
    killed = [ObjectWriter(store, f"{name}/__0_0.distcp", part_bytes=5 * MIB)  # (held: a killed process
              for name in ("iter_0000002", "iter_0000005")]                      # never drops them)
    for writer in killed:  # as a killed save left them: a part uploaded, never completed
        writer.write(b"y" * 6 * MIB)
    assert len(store.unfinished_uploads()) == 2
    listings: list[str] = []
    real = ObjectStore.unfinished_uploads

    def counted(self: ObjectStore, rel: str = "") -> list[tuple[str, str]]:
        listings.append(rel)
        return real(self, rel)
    monkeypatch.setattr(ObjectStore, "unfinished_uploads", counted)
    monkeypatch.setattr(store_writes, "_SWEPT", set())  # a new process
    protocol.claim(locate(url, "save"), "iter_0000005")  # a save of this process, in progress there
    try:
        ckpt, _ = _large_checkpointer(0)
        ckpt.save(url, 3)
        assert [rel for rel, _ in real(store)] == ["iter_0000005/__0_0.distcp"]
        ckpt.save(url, 4)
        ckpt.close()
    finally:
        protocol.unclaim(locate(url, "save"), "iter_0000005")
    assert len(listings) == 1  # swept by the run's first save only
    assert protocol.list_committed(locate(url, "save")) == [3, 4]
    assert not any(Path(k).parts[0] == "iter_0000002" for k in store.list_files())


def test_a_store_that_refuses_to_list_uploads_gets_a_warning_and_the_save(
        s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials without the permission to list multipart uploads: the sweep is skipped with one warning saying
    what to allow; the save itself is committed."""
    def refused(self: ObjectStore, rel: str = "") -> list[tuple[str, str]]:
        raise PermissionError("AccessDenied: s3:ListBucketMultipartUploads")
    monkeypatch.setattr(ObjectStore, "unfinished_uploads", refused)
    monkeypatch.setattr(store_writes, "_SWEPT", set())
    url = s3.url("refused")
    ckpt, _ = _large_checkpointer(0)
    with pytest.warns(UserWarning, match="cannot be listed or aborted .*s3:ListBucketMultipartUploads"):
        ckpt.save(url, 1)
    ckpt.save(url, 2)  # (warned once per run)
    ckpt.close()
    assert protocol.list_committed(locate(url, "save")) == [1, 2]
