"""The library on a real S3-compatible server (moto's, on 127.0.0.1): URLs, retention, re-saving a committed
iteration (and a re-save interrupted at each step), async saves, the tracker rule, the run lock across processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from peftckpt import CheckpointError
from peftckpt.checkpoint.location.names import CheckpointFallbackWarning
from peftckpt.checkpoint.location.protocol import list_committed, read_tracker, resolve
from peftckpt.checkpoint.location.store import StorePrefix, clean_uncommitted
from peftckpt.checkpoint.location.store_lease import acquire_remote_lock
from peftckpt.checkpoint.location.urls import parse_location, url_problem
from peftckpt.checkpoint.options import LoadOptions, SaveOptions
from peftckpt.checkpoint.storage.object_store import ObjectStore

from ..s3_server import BUCKET, S3Server
from .small_model import small_checkpointer


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _loads_as(url: str, expected: dict[str, torch.Tensor]) -> int:
    ckpt, model = small_checkpointer(seed=99)
    result = ckpt.load(url)
    for k, v in model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert isinstance(result.path, str) and result.path.startswith("s3://")
    return result.iteration


def test_urls_are_parsed_or_refused_with_one_reason() -> None:
    assert parse_location("run", "--save") == Path("run")
    assert parse_location("file:///tmp/x%20y", "--save") == Path("/tmp/x y")
    store = parse_location("s3://bucket/a/b/", "--save")
    assert isinstance(store, ObjectStore) and store.url == "s3://bucket/a/b" and store.bucket == "bucket"
    assert store.url_of("iter_0000001") == "s3://bucket/a/b/iter_0000001"
    assert url_problem("s3:///run") == "names no bucket (expected s3://BUCKET/PREFIX)"
    assert "hdfs://" in (url_problem("hdfs://nn/run") or "")
    assert "'..'" in (url_problem("s3://b/a/../c") or "")
    assert url_problem("file://host/tmp") is not None and url_problem("/tmp/run") is None
    with pytest.raises(CheckpointError, match=r"^--save ftp://x/y has scheme ftp://"):
        parse_location("ftp://x/y", "--save")


def test_save_load_retention_and_the_tracker_rule(s3: S3Server) -> None:
    url = s3.url("lib/retention")
    ckpt, model = small_checkpointer()
    saved = {}
    for it in (1, 2, 3):
        with torch.no_grad():
            model[0].weight.add_(1.0)
        assert ckpt.save(url, it, options=SaveOptions(keep_last_k=2)) == f"{url}/iter_{it:07d}"
        saved[it] = _weights(model)
    store = ObjectStore(url)
    assert list_committed(StorePrefix(store)) == [2, 3] and read_tracker(StorePrefix(store)) == 3  # iteration 1 retired
    ckpt.save(url, 1, options=SaveOptions(keep_last_k=5))  # a late save of an older iteration
    assert read_tracker(StorePrefix(store)) == 3  # the tracker keeps naming the newest
    ckpt.close()
    assert _loads_as(url, saved[3]) == 3
    assert _loads_as(f"{url}/iter_0000002", saved[2]) == 2
    assert not list((Path(s3.env["PEFTCKPT_CACHE_DIR"]) / "fetch").rglob("*.distcp"))


def test_resaving_a_committed_iteration_never_leaves_it_without_a_complete_copy(s3: S3Server) -> None:
    url = s3.url("lib/resave")
    store = ObjectStore(url)
    ckpt, model = small_checkpointer()
    ckpt.save(url, 5)
    old = _weights(model)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
    new = _weights(model)
    # A re-save stopped after its staged copy is complete but before the promotion: the old copy stands.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PEFTCKPT_FAULT_INJECT", "before_rename:eio")
        with pytest.raises(CheckpointError, match="iteration 5 was committed|nothing was committed"):
            ckpt.save(url, 5)
    assert _loads_as(url, old) == 5
    staged = [n for n in store.children() if n.startswith(".staging.iter_0000005.")]
    assert len(staged) == 1
    # A crash in the middle of the promotion (old copy uncommitted, new one not copied yet): loads use the staged
    # copy, with a warning, and the next save finishes the promotion.
    store.delete("iter_0000005/metadata.json")
    with pytest.warns(CheckpointFallbackWarning, match="was being re-saved"):
        assert resolve(StorePrefix(store)) == (staged[0], 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointFallbackWarning)
        assert _loads_as(url, new) == 5
    assert clean_uncommitted(store) == ["iter_0000005"]
    assert [n for n in store.children() if n.startswith(".staging.")] == []
    assert _loads_as(url, new) == 5
    # A plain re-save replaces the copy.
    with torch.no_grad():
        model[0].weight.add_(3.0)
    ckpt.save(url, 5)
    ckpt.close()
    assert _loads_as(url, _weights(model)) == 5
    assert [n for n in store.children() if not n.startswith("iter_")] == ["latest_checkpointed_iteration.txt"]


def test_async_saves_upload_in_the_background_and_commit(s3: S3Server) -> None:
    url = s3.url("lib/async")
    ckpt, model = small_checkpointer()
    handles = []
    for it in (1, 2):
        with torch.no_grad():
            model[2].weight.add_(0.5)
        handles.append(ckpt.async_save(url, it))
        expected = _weights(model)
    ckpt.wait()
    assert all(h.done() for h in handles)
    ckpt.close()
    assert list_committed(StorePrefix(url)) == [1, 2]
    assert _loads_as(url, expected) == 2


def test_missing_bucket_and_damage_are_one_error_each(s3: S3Server) -> None:
    ckpt, _ = small_checkpointer()
    with pytest.raises(CheckpointError, match="bucket no-such-bucket-x does not exist"):
        ckpt.save("s3://no-such-bucket-x/run", 1)
    with pytest.raises(CheckpointError, match=f"no committed checkpoint in s3://{BUCKET}/lib/empty"):
        ckpt.load(s3.url("lib/empty"))
    url = s3.url("lib/damaged")
    ckpt.save(url, 1, options=SaveOptions())
    s3.fs().rm_file(f"{BUCKET}/lib/damaged/iter_0000001/.metadata")
    s3.fs().pipe_file(f"{BUCKET}/lib/damaged/iter_0000001/stray.bin", b"x")
    with pytest.raises(CheckpointError) as raised:
        ckpt.load(url, LoadOptions())
    said = str(raised.value)
    assert f"{url}/iter_0000001/.metadata: missing" in said
    assert f"{url}/iter_0000001/stray.bin: unexpected object, not listed in the manifest" in said
    ckpt.close()


_OTHER_RUN = """
import sys
from peftckpt.checkpoint.storage.object_store import ObjectStore
from peftckpt.checkpoint.location.store_lease import acquire_remote_lock
from peftckpt.checkpoint.location.dir_lock import SaveDirInUseError
try:
    acquire_remote_lock(ObjectStore(sys.argv[1])).release()
except SaveDirInUseError as e:
    print(e)
    sys.exit(3)
"""


def _other_run(url: str) -> subprocess.CompletedProcess[str]:
    """Another process taking (and releasing) the location's run lock."""
    return subprocess.run([sys.executable, "-c", _OTHER_RUN, url], capture_output=True, text=True, timeout=120)


def test_one_run_per_location_across_processes(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PEFTCKPT_STORE_LEASE_S", "8")  # renewed every 2 s; a newcomer watches for 4 s
    url = s3.url("lib/lock")
    store = ObjectStore(url)
    held = acquire_remote_lock(store)
    refused = _other_run(url)
    assert refused.returncode == 3, refused.stderr
    assert f"save location {url} is in use by another run (host" in refused.stdout
    assert f"pid {os.getpid()}," in refused.stdout
    held.release()
    assert not store.exists(".peftckpt.lock")
    assert _other_run(url).returncode == 0
    # A holder that died (its lease object left, never renewed) is taken over after half a lease.
    store.write_bytes(".peftckpt.lock", b'{"holder": "host gone, pid 1, since then", "sequence": 0}\n')
    taken = acquire_remote_lock(store)
    assert f"pid {os.getpid()}," in store.read_bytes(".peftckpt.lock").decode()
    taken.release()
    # A run whose lease another run took over commits nothing.
    ckpt, _ = small_checkpointer()
    ckpt.lock(url)
    store.write_bytes(".peftckpt.lock", b'{"holder": "host other, pid 2, since now", "sequence": 0}\n')
    time.sleep(4.5)  # its next renewal finds the object changed
    with pytest.raises(CheckpointError, match=f"save location {url} was taken over by another run"):
        ckpt.save(url, 1)
    ckpt.close()
    assert list_committed(StorePrefix(store)) == []


def test_stores_share_one_client_per_configuration_and_list_afresh(s3: S3Server,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ObjectStore of a process and configuration shares one client (making one per save or load cost tens of
    milliseconds); another endpoint or credentials get their own; no listing is served from a cache."""
    a, b = ObjectStore(s3.url("shared/a")), ObjectStore(s3.url("shared/b"))
    assert a.fs is b.fs
    assert a.list_files() == {}
    s3.fs().pipe(f"{BUCKET}/shared/a/x", b"written by another client")
    assert a.list_files() == {"x": 25}  # listed afresh, though listed empty a moment ago
    assert ObjectStore(s3.url("shared/a")).list_files() == {"x": 25}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # another server: another client
    assert ObjectStore(s3.url("shared/a")).fs is not a.fs
