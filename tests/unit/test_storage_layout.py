"""Layout names, tracker, commit protocol (incl. crash states), resolution and retention."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
import torch

from peftckpt.checkpoint.api import Checkpointer
from peftckpt.checkpoint.errors import CheckpointFormatError, CheckpointNotFoundError
from peftckpt.checkpoint.location.directory import (
    apply_retention,
    clean_stale_staging,
    commit_staging,
    list_committed,
    new_staging_dir,
    read_tracker,
    resolve_checkpoint_dir,
    write_tracker,
)
from peftckpt.checkpoint.location.names import (
    MANIFEST_FILENAME,
    TRACKER_FILENAME,
    CheckpointFallbackWarning,
    iteration_dirname,
    parse_iteration_dirname,
)
from peftckpt.checkpoint.storage.durable import atomic_write_bytes, fsync_tree


def _save(save: Path, iteration: int, payload: bytes = b"data", token: str = "tok", **kw: object) -> Path:
    staging = new_staging_dir(save, iteration, token)
    (staging / "shard.distcp").write_bytes(payload)
    return commit_staging(staging, save, iteration, b'{"iteration": %d}' % iteration, **kw)  # type: ignore[arg-type]


def test_names_round_trip() -> None:
    assert iteration_dirname(100) == "iter_0000100"
    assert iteration_dirname(0) == "iter_0000000"
    assert parse_iteration_dirname("iter_0000100") == 100
    assert parse_iteration_dirname("iter_12345678") == 12345678
    for bad in ("iter_100", "iter_0000100.tmp", ".staging.iter_0000100.x", "iter_abcdefg", "x"):
        assert parse_iteration_dirname(bad) is None
    with pytest.raises(ValueError, match="-1"):
        iteration_dirname(-1)


def test_tracker_absent_written_and_garbled(tmp_path: Path) -> None:
    assert read_tracker(tmp_path) is None
    write_tracker(tmp_path, 42)
    assert (tmp_path / TRACKER_FILENAME).read_text() == "42\n"
    assert read_tracker(tmp_path) == 42
    write_tracker(tmp_path, 7)
    assert read_tracker(tmp_path) == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [TRACKER_FILENAME]  # no temp file left
    (tmp_path / TRACKER_FILENAME).write_text("release")
    with pytest.raises(CheckpointFormatError, match=f"{TRACKER_FILENAME} is garbled.*'release'"):
        read_tracker(tmp_path)


def test_atomic_write_failure_keeps_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f.txt"
    atomic_write_bytes(target, b"old")

    def boom(src: object, dst: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"]


def test_fsync_tree_walks_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"1")
    (tmp_path / "g").write_bytes(b"2")
    synced: list[int] = []
    real = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    fsync_tree(tmp_path)
    assert len(synced) == 5  # 2 files + 3 directories


def test_an_early_flushs_error_is_raised_by_the_fsync_that_follows(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``start_flush`` fsyncs a written file in the background; the commit's later ``fsync_file`` of it waits for
    that fsync and raises its error (a failed fsync is reported once: a second one could pass and lose data)."""
    from peftckpt.checkpoint.storage import durable

    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"x" * 4096)
    real = os.fsync
    failed = threading.Event()

    def failing_once(fd: int) -> None:
        if not failed.is_set():
            failed.set()
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", failing_once)
    durable.start_flush(path)
    assert failed.wait(10)
    with pytest.raises(OSError, match="Input/output error"):
        durable.fsync_file(path)
    durable.fsync_file(path)  # joined once: a later fsync is a plain one
    assert str(path) not in durable._early


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_does_not_commit_joins_its_early_flushes_as_it_hands_its_files_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    """Rank 0 fsyncs the whole staging tree when it commits, but a failed fsync is reported only to the process that
    made it: a rank k > 0 waits for its own files' early fsyncs when it hands them to the directory, so their error
    fails the save from that rank; rank 0 leaves its own to the commit's fsync."""
    from peftckpt.checkpoint.location.base import SaveTarget
    from peftckpt.checkpoint.location.directory import Directory
    from peftckpt.checkpoint.storage import durable

    staging = tmp_path / ".staging.iter_0000001.tok"
    staging.mkdir()
    path = staging / f"__{rank}_0.distcp"
    path.write_bytes(b"x" * 4096)
    monkeypatch.setattr(durable, "_fsync", lambda p: (_ for _ in ()).throw(OSError(errno.EIO, "Input/output error")))
    durable.start_flush(path)
    target = SaveTarget(1, staging.name, staging)
    if rank:
        with pytest.raises(OSError, match="Input/output error"):
            Directory(tmp_path).upload(target, [path], rank)
    else:
        Directory(tmp_path).upload(target, [path], rank)  # (nothing waited for here ...)
        with pytest.raises(OSError, match="Input/output error"):  # (... the commit's fsync raises it)
            durable.fsync_file(path)


def test_a_saves_data_files_are_flushed_early_and_joined_by_the_commit(tmp_path: Path) -> None:
    from peftckpt.checkpoint.storage import durable

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    ckpt = Checkpointer([model], None, layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, coords={"tp": 0, "pp": 0, "dp": 0})
    started: list[str] = []
    real = durable.start_flush
    with pytest.MonkeyPatch.context() as m:
        from peftckpt.checkpoint.storage import dcp_writer
        m.setattr(dcp_writer, "start_flush", lambda p: (started.append(os.path.abspath(p)), real(p)))
        ckpt.save(tmp_path, 1)
    assert [Path(p).name for p in started] == ["__0_0.distcp"]
    assert not set(started) & set(durable._early)  # the commit's fsync of the staging tree joined it


def test_staging_name_and_validation(tmp_path: Path) -> None:
    save = tmp_path / "deep" / "save"
    staging = new_staging_dir(save, 100, "abc123")
    assert staging == save / ".staging.iter_0000100.abc123" and staging.is_dir()
    with pytest.raises(ValueError, match="token"):
        new_staging_dir(save, 100, "a.b")


def test_commit_creates_committed_dir_and_tracker(tmp_path: Path) -> None:
    final = _save(tmp_path, 100)
    assert final == tmp_path / "iter_0000100"
    assert (final / MANIFEST_FILENAME).read_bytes() == b'{"iteration": 100}'
    assert (final / "shard.distcp").read_bytes() == b"data"
    assert read_tracker(tmp_path) == 100
    assert list_committed(tmp_path) == [100]
    assert resolve_checkpoint_dir(tmp_path) == (final, 100)
    assert resolve_checkpoint_dir(final) == (final, 100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100", TRACKER_FILENAME]


def test_recommit_replaces_and_leaves_no_trash(tmp_path: Path) -> None:
    _save(tmp_path, 100, b"old", token="t1")
    final = _save(tmp_path, 100, b"new", token="t2")
    assert (final / "shard.distcp").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000100", TRACKER_FILENAME]


def test_tracker_rule_monotonic_unless_rewind(tmp_path: Path) -> None:
    _save(tmp_path, 200, token="a")
    _save(tmp_path, 100, token="b")
    assert read_tracker(tmp_path) == 200
    _save(tmp_path, 150, token="c", allow_tracker_rewind=True)
    assert read_tracker(tmp_path) == 150
    _save(tmp_path, 300, token="d", update_tracker=False)
    assert read_tracker(tmp_path) == 150
    assert list_committed(tmp_path) == [100, 150, 200, 300]


def test_crash_before_commit_leaves_previous_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 100)
    staging = new_staging_dir(tmp_path, 200, "crashed")
    (staging / "shard.distcp").write_bytes(b"half")
    (staging / MANIFEST_FILENAME).write_bytes(b"{}")  # even with a manifest, staging is never committed
    (tmp_path / "iter_0000300").mkdir()  # an iter dir without manifest is not committed either
    assert list_committed(tmp_path) == [100]
    assert resolve_checkpoint_dir(tmp_path) == (tmp_path / "iter_0000100", 100)
    with pytest.raises(CheckpointNotFoundError, match="iter_0000300 is not a committed checkpoint"):
        resolve_checkpoint_dir(tmp_path / "iter_0000300")
    with pytest.raises(CheckpointNotFoundError, match="not a committed checkpoint .it is the staging"):
        resolve_checkpoint_dir(staging)
    keep = new_staging_dir(tmp_path, 400, "current")
    assert clean_stale_staging(tmp_path, keep=keep) == [staging]
    assert keep.is_dir() and not staging.exists()


def test_crash_between_rename_and_tracker_update(tmp_path: Path) -> None:
    _save(tmp_path, 100, token="a")
    _save(tmp_path, 200, token="b", update_tracker=False)  # = crash after step 4, before step 6
    assert read_tracker(tmp_path) == 100
    assert resolve_checkpoint_dir(tmp_path) == (tmp_path / "iter_0000100", 100)


def test_crash_between_the_two_renames_of_a_resave(tmp_path: Path) -> None:
    _save(tmp_path, 100, b"old", token="a")
    # Replay steps 1-3 of a re-save, then "crash": the old copy is in trash, the new one in staging.
    staging = new_staging_dir(tmp_path, 100, "b")
    (staging / "shard.distcp").write_bytes(b"new")
    (staging / MANIFEST_FILENAME).write_bytes(b'{"iteration": 100}')
    trash = tmp_path / ".trash.replace.iter_0000100.deadbeef"
    os.rename(tmp_path / "iter_0000100", trash)

    with pytest.warns(CheckpointFallbackWarning, match="previous copy"):
        found, iteration = resolve_checkpoint_dir(tmp_path)
    assert (found, iteration) == (trash, 100)
    assert (found / "shard.distcp").read_bytes() == b"old"

    removed = clean_stale_staging(tmp_path)
    assert removed == [staging]
    assert (tmp_path / "iter_0000100" / "shard.distcp").read_bytes() == b"old"
    assert list_committed(tmp_path) == [100]


def test_crash_after_resave_leaves_only_garbage_trash(tmp_path: Path) -> None:
    _save(tmp_path, 100, b"new")
    trash = tmp_path / ".trash.replace.iter_0000100.cafe"
    trash.mkdir()
    (trash / MANIFEST_FILENAME).write_bytes(b"{}")  # half-deleted old copy
    assert resolve_checkpoint_dir(tmp_path) == (tmp_path / "iter_0000100", 100)
    assert clean_stale_staging(tmp_path) == [trash]
    assert (tmp_path / "iter_0000100" / "shard.distcp").read_bytes() == b"new"


def test_resolve_fallbacks_and_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=f"{tmp_path / 'nope'} does not exist"):
        resolve_checkpoint_dir(tmp_path / "nope")
    with pytest.raises(CheckpointNotFoundError, match=f"no committed checkpoint in {tmp_path}"):
        resolve_checkpoint_dir(tmp_path)
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(CheckpointFormatError, match="is a file"):
        resolve_checkpoint_dir(tmp_path / "f")
    other = tmp_path / "other"
    other.mkdir()
    (other / "readme.txt").write_text("hi")
    with pytest.raises(CheckpointFormatError, match="neither a peftckpt checkpoint"):
        resolve_checkpoint_dir(other)

    save = tmp_path / "save"
    _save(save, 100, token="a")
    _save(save, 200, token="b", update_tracker=False)
    (save / TRACKER_FILENAME).unlink()
    with pytest.warns(CheckpointFallbackWarning, match="no latest_checkpointed_iteration.txt.*iteration 200"):
        assert resolve_checkpoint_dir(save) == (save / "iter_0000200", 200)
    write_tracker(save, 300)
    with pytest.warns(CheckpointFallbackWarning, match="names iteration 300, which is not committed"):
        assert resolve_checkpoint_dir(save) == (save / "iter_0000200", 200)

    empty = tmp_path / "empty_save"
    empty.mkdir()
    write_tracker(empty, 5)
    with pytest.raises(CheckpointNotFoundError, match="names iteration 5"):
        resolve_checkpoint_dir(empty)


def test_retention_rules(tmp_path: Path) -> None:
    for i, it in enumerate((10, 20, 30, 40, 50)):
        _save(tmp_path, it, token=f"t{i}")
    write_tracker(tmp_path, 20)  # e.g. a rewind: the tracker's checkpoint must survive
    staging = new_staging_dir(tmp_path, 60, "inflight")
    deleted = apply_retention(tmp_path, 2, protect=[tmp_path / "iter_0000010"])
    assert deleted == [30]
    assert list_committed(tmp_path) == [10, 20, 40, 50]
    assert staging.is_dir()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".trash.")]
    assert apply_retention(tmp_path, 1) == [10, 40]
    assert list_committed(tmp_path) == [20, 50]
    with pytest.raises(ValueError, match="keep_last_k must be >= 1, got 0"):
        apply_retention(tmp_path, 0)
    assert apply_retention(tmp_path / "missing", 3) == []
