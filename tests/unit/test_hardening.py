"""Issue 13: a committed checkpoint is always whole, no file steers a read outside its directory or makes the
reader allocate or block, the manifest is trusted one way, trackers and commits fail honestly, retention and
the run lock never destroy a checkpoint.

Every exploit is built here from a real checkpoint, its manifest re-checksummed as an attacker would, so only
the new checks can catch it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from peftckpt.checkpoint.api import LoadOptions, SaveOptions
from peftckpt.checkpoint.errors import CheckpointError, CheckpointFormatError, UnsafeCheckpointError
from peftckpt.checkpoint.location.dir_lock import SaveDirInUseError, acquire_save_lock
from peftckpt.checkpoint.location.directory import (
    commit_staging,
    list_committed,
    new_staging_dir,
    read_tracker,
)
from peftckpt.checkpoint.location.names import TRACKER_FILENAME
from peftckpt.checkpoint.storage.checksums import checksum_files
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from peftckpt.checkpoint.tools.inspect import inspect_path
from peftckpt.checkpoint.tools.offline import open_checkpoint
from peftckpt.checkpoint.tools.verify import verify_checkpoint
from tests.unit.small_model import small_checkpointer

KEY = "model.0.weight"
SMALL_KEY = "model.1.bias"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("pristine")
    ckpt, _ = small_checkpointer()
    ckpt.save(save, 3, {"iteration": 3})
    ckpt.close()
    return save / "iter_0000003"


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "save" / pristine.name))


def _rerecord(ckpt: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Re-record every file's size and checksum in the manifest (and apply ``edit``), dropping its self-checksum:
    what an attacker who rewrote files would do."""
    manifest = json.loads((ckpt / "metadata.json").read_text())
    manifest.pop("manifest_sha256", None)
    regular = [ckpt / rel for rel in manifest["files"] if (ckpt / rel).is_file() and not (ckpt / rel).is_symlink()]
    manifest["files"].update(checksum_files(regular, ckpt))
    if edit is not None:
        edit(manifest)
    (ckpt / "metadata.json").write_text(json.dumps(manifest))


def _craft_metadata(ckpt: Path, edit: Callable[[Metadata], None]) -> None:
    md = load_dcp_metadata(ckpt / ".metadata")
    edit(md)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    _rerecord(ckpt)


def _item(md: Metadata, key: str) -> tuple[MetadataIndex, _StorageInfo]:
    (index, info), = [(i, s) for i, s in md.storage_data.items() if i.fqn == key]
    return index, info


def _refused_everywhere(ckpt: Path, expected: str, tmp_path: Path) -> None:
    """verify, inspect, the offline reader and a load all refuse ``ckpt`` with ``expected`` (a regex) in one
    message, checksums verified or not, and the load leaves the model untouched."""
    assert any(re.search(expected, p) for p in verify_checkpoint(ckpt).problems), verify_checkpoint(ckpt).problems
    for verify in (True, False):
        report = inspect_path(ckpt, verify_checksums=verify)
        assert report.exit_code == 1 and any(re.search(expected, r) for r in report.reasons), report.reasons
    for verify in (True, False):
        with pytest.raises(CheckpointError, match=expected):
            open_checkpoint(ckpt, verify_checksums=verify).model_tensors()
        target, model = small_checkpointer(seed=1)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(CheckpointError, match=expected):
            target.load(ckpt, LoadOptions(objects=["iteration"], verify_checksums=verify))
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ------------------------------------------------------------------------------ paths out of the checkpoint
@pytest.mark.parametrize("where", ["../outside.distcp", "ABSOLUTE", "/dev/zero"])
def test_storage_item_outside_the_checkpoint_is_never_read(ckpt: Path, tmp_path: Path, where: str) -> None:
    outside = tmp_path / "outside.distcp"
    target = str(outside) if where == "ABSOLUTE" else where
    original = (ckpt / "__0_0.distcp").read_bytes()
    outside.write_bytes(original)  # a perfectly readable copy: only the path check stands in the way

    def point_outside(md: Metadata) -> None:
        for index, info in list(md.storage_data.items()):
            if index.fqn == KEY:
                md.storage_data[index] = _StorageInfo(target, info.offset, info.length)

    _craft_metadata(ckpt, point_outside)
    expected = "refusing to read outside the checkpoint"
    _refused_everywhere(ckpt, expected, tmp_path)
    outside.unlink()  # had anything read it, removing it would change the error; it does not
    _refused_everywhere(ckpt, expected, tmp_path)


def test_symlinked_and_special_files_are_refused_without_blocking(ckpt: Path, tmp_path: Path) -> None:
    # the data file becomes a symlink to an identical copy outside; the manifest records the copy's bytes
    outside = tmp_path / "outside.distcp"
    shutil.copy(ckpt / "__0_0.distcp", outside)
    (ckpt / "__0_0.distcp").unlink()
    (ckpt / "__0_0.distcp").symlink_to(outside)
    _refused_everywhere(ckpt, "is a symbolic link", tmp_path)
    # .metadata replaced by a FIFO: nothing may block on it
    (ckpt / "__0_0.distcp").unlink()
    shutil.copy(outside, ckpt / "__0_0.distcp")
    (ckpt / ".metadata").unlink()
    os.mkfifo(ckpt / ".metadata")
    done: list[Any] = []
    worker = threading.Thread(target=lambda: done.append(verify_checkpoint(ckpt).problems), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert not worker.is_alive(), "verify blocked on a FIFO"
    assert any("not a regular file" in p for p in done[0]), done
    with pytest.raises(CheckpointError, match="not a regular file"):
        small_checkpointer(seed=1)[0].load(ckpt, LoadOptions(verify_checksums=False))


@pytest.mark.parametrize("name", ["", ".", "sub", "a//b"])
def test_manifest_file_names_that_are_not_files_are_one_message(ckpt: Path, tmp_path: Path, name: str) -> None:
    (ckpt / "sub").mkdir()
    _rerecord(ckpt, lambda m: m["files"].update({name: {"size": 0, "checksum": "0"}}))
    expected = "not a regular file" if name == "sub" else "must name a file inside the checkpoint"
    if name == "sub":
        _refused_everywhere(ckpt, expected, tmp_path)
    else:  # an invalid manifest: every tool says so in one message
        with pytest.raises(CheckpointFormatError, match=expected):
            verify_checkpoint(ckpt)
        assert any(expected in r for r in inspect_path(ckpt).reasons)
        with pytest.raises(CheckpointFormatError, match=expected):
            small_checkpointer(seed=1)[0].load(ckpt)


def test_dangling_symlinks_are_reported_not_raised(ckpt: Path) -> None:
    (ckpt / "dangling").symlink_to("/nonexistent/peftckpt")
    (ckpt.parent / "also-dangling").symlink_to("/nonexistent/peftckpt")
    assert any("unexpected file" in p for p in verify_checkpoint(ckpt).problems)
    for path in (ckpt, ckpt.parent):
        assert inspect_path(path).exit_code == 1
        assert inspect_path(path, verify_checksums=False).exit_code == 1


# ------------------------------------------------------------------------------------- whole or not at all
def test_lost_shard_is_refused(ckpt: Path, tmp_path: Path) -> None:
    def split_and_drop(md: Metadata) -> None:
        # the chunk list claims two row halves, of which only the first reached the checkpoint
        tensor = md.state_dict_metadata[KEY]
        index, info = _item(md, KEY)
        del md.storage_data[index]
        tensor.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([32, 64])),
                         ChunkStorageMetadata(torch.Size([32, 0]), torch.Size([32, 64]))]
        md.storage_data[MetadataIndex(KEY, torch.Size([0, 0]))] = info

    _craft_metadata(ckpt, split_and_drop)
    _refused_everywhere(ckpt, f"chunk of '{KEY}' at offsets \\[32, 0\\] has no valid storage item", tmp_path)


def test_data_file_gone_with_its_manifest_entry_is_refused(ckpt: Path, tmp_path: Path) -> None:
    """What the reported concurrent-save bug committed: .metadata and a manifest, no data file."""
    (ckpt / "__0_0.distcp").unlink()
    _rerecord(ckpt, lambda m: m["files"].pop("__0_0.distcp"))
    _refused_everywhere(ckpt, "a file the manifest does not list", tmp_path)


def test_coverage_hole_names_the_key(ckpt: Path, tmp_path: Path) -> None:
    def hole(md: Metadata) -> None:
        tensor = md.state_dict_metadata[KEY]
        tensor.size = torch.Size([128, 64])  # one chunk of 64 rows stored for a 128-row tensor
    _craft_metadata(ckpt, hole)
    _refused_everywhere(ckpt, f"'{KEY}': its chunks cover 4096 of 8192 elements", tmp_path)


def test_overlapping_chunks_are_refused(ckpt: Path, tmp_path: Path) -> None:
    def overlap(md: Metadata) -> None:
        index, info = _item(md, KEY)
        half = _StorageInfo(info.relative_path, info.offset, info.length)
        md.state_dict_metadata[KEY].chunks.append(ChunkStorageMetadata(torch.Size([32, 0]), torch.Size([32, 64])))
        md.storage_data[MetadataIndex(KEY, torch.Size([32, 0]))] = half
    _craft_metadata(ckpt, overlap)
    _refused_everywhere(ckpt, "overlap", tmp_path)


def test_shape_lie_in_metadata_cannot_allocate(ckpt: Path, tmp_path: Path) -> None:
    def huge(md: Metadata) -> None:
        tensor = md.state_dict_metadata[KEY]
        tensor.size = torch.Size([200_000, 100_000])  # 80 GB of float32 declared on a 16 KB item
        tensor.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([200_000, 100_000]))]
        index, info = _item(md, KEY)
        del md.storage_data[index]
        md.storage_data[MetadataIndex(KEY, torch.Size([0, 0]))] = info
    _craft_metadata(ckpt, huge)
    tracemalloc.start()
    try:
        _refused_everywhere(ckpt, "more than its", tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak


def test_manifest_shape_contradicting_storage_fails_the_load_too(ckpt: Path, tmp_path: Path) -> None:
    _rerecord(ckpt, lambda m: m["saved_keys"][KEY].update(shape=[64, 32]))
    _refused_everywhere(ckpt, re.escape("manifest says [64, 32]"), tmp_path)


def test_commit_refuses_a_save_whose_data_another_save_deleted(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported bug: a second save into the same directory removed the first one's staging directory
    while it was being written; the first then committed a checkpoint without data. (Two runs are kept apart
    by the run lock; two checkpointers of one process share it and no longer clean each other's saves in
    progress -- and if a save's files vanish anyway, the commit's own check stops it.)"""
    from peftckpt.checkpoint import save as api

    save = tmp_path / "save"
    first, _ = small_checkpointer()
    second, _ = small_checkpointer(seed=1)
    first.save(save, 1)
    written, go_on = threading.Event(), threading.Event()
    commit = api.commit_checkpoint

    def held_commit(*a: Any, **k: Any) -> None:  # the async save's thread: written, held before its commit
        written.set()
        go_on.wait(60)
        commit(*a, **k)

    monkeypatch.setattr(api, "commit_checkpoint", held_commit)
    first.save(save, 2, options=SaveOptions(async_save=True))  # in flight: its staging directory exists
    assert written.wait(60)  # written, not yet committed (the write itself must not be what fails)
    monkeypatch.setattr(api, "commit_checkpoint", commit)
    second.save(save, 5)  # a second checkpointer of this process: its clean leaves the first's save alone ...
    staging = next(save.glob(".staging.iter_0000002.*"))
    shutil.rmtree(staging)  # ... whatever removes it anyway (a tool, a bug), the commit's own check refuses it
    go_on.set()
    with pytest.raises(CheckpointError) as info:
        first.wait()
    message = str(info.value)
    assert "not whole, so it is not committed" in message and "nothing was committed" in message
    assert list_committed(save) == [1, 5] and read_tracker(save) == 5
    assert all(verify_checkpoint(save / f"iter_{i:07d}").ok for i in (1, 5))


# ------------------------------------------------------------------------ metadata that allocates or blocks
def _rewrite_metadata(ckpt: Path, data: bytes) -> None:
    (ckpt / ".metadata").write_bytes(data)
    _rerecord(ckpt)


class _HugeBytearray:
    def __reduce__(self) -> tuple[Any, ...]:
        return (bytearray, (10**10,))


@pytest.mark.parametrize("bomb", ["bytearray", "memo", "bytes8"])
def test_metadata_bombs_stay_small(ckpt: Path, tmp_path: Path, bomb: str) -> None:
    md = load_dcp_metadata(ckpt / ".metadata")
    if bomb == "bytearray":
        md.planner_data = _HugeBytearray()
        data, expected = pickle.dumps(md), "builtins.bytearray"
    elif bomb == "memo":  # LONG_BINPUT 2**31 - 1: the C unpickler would grow its memo table to 16 GB
        data, expected = b"\x80\x04N" + b"r" + struct.pack("<I", 2**31 - 1) + b".", "memo index"
    else:  # BINBYTES8 declaring 2**40 bytes: the C unpickler allocates the declared length first
        data, expected = b"\x80\x04\x8e" + struct.pack("<Q", 2**40) + b"xx.", "corrupt"
    _rewrite_metadata(ckpt, data)
    tracemalloc.start()
    try:
        problems = verify_checkpoint(ckpt).problems
        assert any(expected in p for p in problems), problems
        assert inspect_path(ckpt).exit_code == 1
        with pytest.raises(CheckpointError, match=expected):
            small_checkpointer(seed=1)[0].load(ckpt, LoadOptions(verify_checksums=False))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20, peak


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_refused_data_item_is_one_message_in_load_and_export(tmp_path: Path) -> None:
    """A tensor item of a data file replaced by a pickle that would run code: refused by name, nothing runs."""
    ckpt_obj, _ = small_checkpointer()
    save = tmp_path / "save"
    ckpt_obj.save(save, 1)
    ckpt = save / "iter_0000001"
    marker = tmp_path / "ran"
    payload = io.BytesIO()
    torch.save(_RunsCode(marker), payload)
    evil = payload.getvalue()  # longer than the 64 floats the item claims to hold
    (ckpt / "evil.distcp").write_bytes(evil)

    def point_at_evil(md: Metadata) -> None:
        index, _ = _item(md, SMALL_KEY)
        md.storage_data[index] = _StorageInfo("evil.distcp", 0, len(evil))

    _rerecord(ckpt, lambda m: m["files"].update({"evil.distcp": {"size": 0, "checksum": "0"}}))
    _craft_metadata(ckpt, point_at_evil)
    expected = "cannot be loaded with torch.load\\(weights_only=True\\), so it is refused .*posix.system"
    with pytest.raises(UnsafeCheckpointError, match=expected):
        open_checkpoint(ckpt).model_tensors()
    with pytest.raises(UnsafeCheckpointError, match=expected):
        small_checkpointer(seed=1)[0].load(ckpt)
    assert not marker.exists()


# --------------------------------------------------------------------------------- trackers and commits
@pytest.mark.parametrize("content", ["٤\n", b"\xff\xfe3", "3 4", "DIR"])
def test_garbled_trackers_are_messages(tmp_path: Path, content: str | bytes) -> None:
    save = tmp_path / "save"
    small_checkpointer()[0].save(save, 3)
    tracker = save / TRACKER_FILENAME
    tracker.unlink()
    if content == "DIR":
        tracker.mkdir()
    elif isinstance(content, bytes):
        tracker.write_bytes(content)
    else:
        tracker.write_text(content, encoding="utf-8")
    with pytest.raises(CheckpointFormatError, match="is garbled"):
        read_tracker(save)
    assert inspect_path(save).exit_code == 1
    if content == "DIR":  # it cannot be replaced: refused before the existing iter_3 is touched
        before = sorted(p.name for p in (save / "iter_0000003").iterdir())
        staging = new_staging_dir(save, 3, "tok")
        (staging / "x").write_bytes(b"x")
        with pytest.raises(CheckpointFormatError, match="not a regular file.*nothing was committed"):
            commit_staging(staging, save, 3, b"{}")
        assert sorted(p.name for p in (save / "iter_0000003").iterdir()) == before


def test_commit_failure_says_what_is_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import peftckpt.checkpoint.location.protocol as layout

    save = tmp_path / "save"
    ckpt, _ = small_checkpointer()
    ckpt.save(save, 1)

    def no_tracker(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(layout, "write_tracker", no_tracker)
    with pytest.raises(CheckpointError) as info:
        ckpt.save(save, 2)
    message = str(info.value)
    assert f"iteration 2 was committed as {save / 'iter_0000002'}, but the tracker was not moved" in message
    assert "still names iteration 1" in message and "unchanged" not in message
    assert list_committed(save) == [1, 2] and read_tracker(save) == 1
    monkeypatch.undo()
    monkeypatch.setenv("PEFTCKPT_FAULT_INJECT", "before_rename:eio")
    with pytest.raises(CheckpointError, match="nothing was committed .*unchanged"):
        ckpt.save(save, 3)
    assert list_committed(save) == [1, 2]


def test_retention_never_deletes_the_checkpoint_just_committed(tmp_path: Path) -> None:
    save = tmp_path / "save"
    ckpt, _ = small_checkpointer()
    for it in (10, 20):
        ckpt.save(save, it)
    path = ckpt.save(save, 3, options=SaveOptions(keep_last_k=2))  # another run's higher iterations exist
    assert path.is_dir() and list_committed(save) == [3, 10, 20] and read_tracker(save) == 20
    ckpt.save(save, 4, options=SaveOptions(keep_last_k=2))
    assert list_committed(save) == [4, 10, 20]


# ---------------------------------------------------------------------------------------------- run lock
_HOLD = """
import sys, time
from peftckpt.checkpoint.location.dir_lock import acquire_save_lock
acquire_save_lock(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


def test_run_lock_refuses_a_second_process_and_frees_on_exit(tmp_path: Path) -> None:
    save = tmp_path / "save"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(save)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        ckpt, _ = small_checkpointer()
        with pytest.raises(CheckpointError, match=f"in use by another run .*pid {holder.pid}"):
            ckpt.save(save, 1)
        assert list_committed(save) == [] and not list(save.glob(".staging.*"))
        with pytest.raises(SaveDirInUseError):
            acquire_save_lock(save)
    finally:
        holder.communicate("", timeout=30)
    # the holder is gone (however it ended): the directory is free
    path = ckpt.save(save, 1)
    assert verify_checkpoint(path).ok
    # one process may take it as often as it likes (the trainer's check and its checkpointer share it)
    with acquire_save_lock(save), acquire_save_lock(save):
        ckpt.save(save, 2)
    ckpt.close()
