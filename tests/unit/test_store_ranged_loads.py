"""Loads from an object store read in place (issue 27): each rank fetches by ranged GETs the bytes of the items it
needs -- no copy of a data object on any host -- verified block by block as they arrive, damage named by URL.
Against a real S3-compatible server (moto's, on 127.0.0.1)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from peftckpt import CheckpointError
from peftckpt.checkpoint.api import Checkpointer
from peftckpt.checkpoint.location import store_reads
from peftckpt.checkpoint.options import LoadOptions
from peftckpt.checkpoint.storage import object_ranges
from peftckpt.checkpoint.storage.object_ranges import ObjectSource
from peftckpt.checkpoint.storage.object_store import ObjectStore

from ..s3_server import BUCKET, S3Server

LAYOUT = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
COORDS = {"tp": 0, "pp": 0, "dp": 0}
WIDTH = 768  # ~7 MB of weights and Adam moments: several verification blocks and parts per item


def _checkpointer(seed: int) -> tuple[Checkpointer, nn.Module]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH), nn.Linear(WIDTH, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, WIDTH)).sum().backward()
    opt.step()
    return Checkpointer([model], opt, layout=LAYOUT, coords=COORDS, model_config={"width": WIDTH}), model


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """What each load's store files fetched and asked for, and every object downloaded whole."""
    seen: dict[str, list] = {"loads": [], "downloaded": []}
    close = store_reads.StoreFiles.close

    def recording_close(self: store_reads.StoreFiles) -> None:
        seen["loads"].append((self.bytes_fetched, self.bytes_asked, self.requests))
        close(self)

    download = ObjectStore.download

    def recording_download(self: ObjectStore, rel: str, local: Path, *args: object, **kwargs: object) -> int:
        seen["downloaded"].append(rel)
        return download(self, rel, local, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store_reads.StoreFiles, "close", recording_close)
    monkeypatch.setattr(ObjectStore, "download", recording_download)
    return seen


def _data_size(s3: S3Server, prefix: str) -> int:
    return sum(info["size"] for key, info in s3.fs().find(f"{BUCKET}/{prefix}", detail=True).items()
               if key.endswith(".distcp"))


def test_a_load_fetches_only_the_bytes_it_needs_and_no_data_object_whole(s3: S3Server, reads: dict[str, list]) -> None:
    source, model = _checkpointer(0)
    url = s3.url("ranged/full")
    source.save(url, 1, {"step": 1})
    size = _data_size(s3, "ranged/full/iter_0000001")

    target, fresh = _checkpointer(1)
    result = target.load(url, LoadOptions(objects=["step"]))
    assert result.objects == {"step": 1} and str(result.path).startswith("s3://")
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert not any(rel.endswith(".distcp") for rel in reads["downloaded"]), reads["downloaded"]
    fetched, asked, requests = reads["loads"][-1]
    assert result.bytes_fetched == fetched
    assert fetched == size  # every item and the index, each byte once
    assert fetched <= 1.02 * asked
    assert requests == 1  # whole items: the index comes with the one part holding them (no GET per item)

    # The model alone (no optimizer): its items' bytes, not the file.
    model_only, _ = _checkpointer(2)
    result = model_only.load(url, LoadOptions(load_optim=False, load_rng=False))
    fetched, asked, _ = reads["loads"][-1]
    assert fetched < 0.5 * size and fetched <= 1.02 * asked + object_ranges.TAIL_BYTES, (fetched, asked, size)


def test_damage_in_a_ranged_read_is_named_by_url(s3: S3Server) -> None:
    source, _ = _checkpointer(0)
    url = s3.url("ranged/damaged")
    source.save(url, 1)
    s3.flip_byte("ranged/damaged/iter_0000001/__0_0.distcp", offset=_data_size(s3, "ranged/damaged") // 2)
    target, _ = _checkpointer(1)
    with pytest.raises(CheckpointError) as raised:
        target.load(url)
    said = str(raised.value)
    assert f"{url}/iter_0000001/__0_0.distcp: xxh3_64 checksum mismatch" in said, said
    assert "/fetch/" not in said  # no local path leaks into the message


def test_verify_first_downloads_and_checks_everything_before_the_model_changes(s3: S3Server,
                                                                              reads: dict[str, list]) -> None:
    """LoadOptions(verify_while_reading=False) from a store (hot-swapping an adapter into a model that must stay
    intact): every object is hashed before anything is read, so a damaged one leaves the model untouched."""
    source, _ = _checkpointer(0)
    url = s3.url("ranged/verify-first")
    source.save(url, 1)
    target, model = _checkpointer(1)
    assert target.load(url, LoadOptions(verify_while_reading=False)).bytes_fetched is None  # a verified copy
    assert any(rel.endswith(".distcp") for rel in reads["downloaded"])
    s3.flip_byte("ranged/verify-first/iter_0000001/__0_0.distcp", offset=100_000)
    other, untouched = _checkpointer(2)
    before = {k: v.clone() for k, v in untouched.state_dict().items()}
    with pytest.raises(CheckpointError, match=f"{url}/iter_0000001/__0_0.distcp: xxh3_128 checksum mismatch"):
        other.load(url, LoadOptions(verify_while_reading=False))
    for k, v in untouched.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_data_object_without_a_block_index_is_hashed_whole(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Written as an earlier release did (every tensor torch.save framed, no index): loads, and damage is still
    caught, by the object's whole checksum streamed from the store."""
    from peftckpt.checkpoint.storage import dcp_writer

    source, model = _checkpointer(0)
    url = s3.url("ranged/old")
    with monkeypatch.context() as m:
        m.setattr(dcp_writer, "tensor_record", lambda tensor: None)
        m.setattr(dcp_writer, "encode_index", lambda items: b"")
        source.save(url, 1)
    target, fresh = _checkpointer(1)
    target.load(url)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    s3.flip_byte("ranged/old/iter_0000001/__0_0.distcp", offset=1000)
    with pytest.raises(CheckpointError, match=f"{url}/iter_0000001/__0_0.distcp: xxh3_128 checksum mismatch"):
        _checkpointer(2)[0].load(url)


def test_an_object_source_holds_a_bounded_window(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expected ranges are fetched ahead in parts, never more than the window unread; reads across parts, outside
    the expected ranges, twice, and past the object's end all return the object's bytes."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(object_ranges, "PART_BYTES", 64 << 10)
    monkeypatch.setattr(object_ranges, "AHEAD_BYTES", 256 << 10)
    monkeypatch.setattr(object_ranges, "TAIL_BYTES", 4 << 10)
    blob = os.urandom(2 << 20)
    s3.fs().pipe_file(f"{BUCKET}/ranged/blob", blob)
    store = ObjectStore(s3.url("ranged"))
    with ThreadPoolExecutor(4) as pool:
        source = ObjectSource(store, "blob", len(blob), pool)
        assert source.read(24, len(blob) - 24) == blob[-24:]  # the tail, kept
        ranges = [(s, s + 40_000) for s in range(0, len(blob) - 100_000, 50_000)]
        source.expect(ranges)
        held = []
        for start, end in ranges:
            buf = bytearray(end - start)
            assert source.read_into([memoryview(buf)], start) == end - start
            assert bytes(buf) == blob[start:end]
            held.append(source._held)
        assert max(held) <= (256 << 10) + (64 << 10)
        assert source.fetched <= 1.3 * sum(e - s for s, e in ranges) + (4 << 10)  # merged gaps of <= 10 KB
        for start, end in [(100, 200), (len(blob) - 5000, len(blob) + 10), (ranges[0][0], ranges[0][1])]:
            head, body = bytearray(7), bytearray(end - start - 7)
            n = source.read_into([memoryview(head), memoryview(body)], start)
            assert n == min(end, len(blob)) - start
            assert bytes(head + body)[:n] == blob[start:min(end, len(blob))]
        source.close()


def test_the_index_part_goes_first_and_reads_start_as_their_parts_arrive(s3: S3Server,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-items read: the part holding the block index is requested first (every read waits for the index),
    and a range is ready as soon as its own parts are there, whatever the order the store answers in -- a part
    held back holds back only the reads of its bytes."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(object_ranges, "PART_BYTES", 64 << 10)
    monkeypatch.setattr(object_ranges, "TAIL_BYTES", 4 << 10)
    blob = os.urandom(512 << 10)
    s3.fs().pipe_file(f"{BUCKET}/ranged/parts", blob)
    store = ObjectStore(s3.url("ranged"))
    body = len(blob) - (4 << 10)  # items up to the last 4 KB (the "index")
    items = [(s, min(s + (32 << 10), body)) for s in range(0, body, 32 << 10)]
    asked: list[int] = []
    first_part = threading.Event()
    get = ObjectSource._get

    def gated_get(self: ObjectSource, start: int, end: int) -> bytes:
        asked.append(start)
        if start == 0:
            first_part.wait(30)
        return get(self, start, end)

    monkeypatch.setattr(ObjectSource, "_get", gated_get)
    first_part.set()
    with ThreadPoolExecutor(1) as one:  # one GET at a time: the order they were asked in
        source = ObjectSource(store, "parts", len(blob), one)
        source.expect(items, tail=True)
        assert source.read(4 << 10, body) == blob[body:]
        parts = [p.start for p in source._parts]
        for start, end in items:
            buf = bytearray(end - start)
            assert source.read_into([memoryview(buf)], start) == end - start and bytes(buf) == blob[start:end]
        assert asked == [parts[-1], *parts[:-1]], (asked, parts)
        source.close()

    first_part.clear()
    ready: list[int] = []
    with ThreadPoolExecutor(8) as pool:
        source = ObjectSource(store, "parts", len(blob), pool)
        source.expect(items, tail=True)
        for start, end in items:
            source.when_ready(start, end, lambda start=start: ready.append(start))
        later = [s for s, _ in items if s >= source._parts[0].end]
        for _ in range(300):
            if sorted(ready) == later:
                break
            threading.Event().wait(0.05)
        assert sorted(ready) == later  # all but the held part's ranges, while it is held
        first_part.set()
        for _ in range(300):
            if len(ready) == len(items):
                break
            threading.Event().wait(0.05)
        assert sorted(ready) == [s for s, _ in items]
        for start, end in items:
            buf = bytearray(end - start)
            assert source.read_into([memoryview(buf)], start) == end - start and bytes(buf) == blob[start:end]
        source.close()


def test_the_offline_tools_read_a_stores_data_objects_in_place(s3: S3Server, reads: dict[str, list],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """open_checkpoint (export-hf, export-peft, import-peft --base) of a checkpoint on a store: its small files
    fetched and verified, its data objects read where they lie, by ranges, verified as they are read -- damage is
    named by URL, in an object written without a block index too (hashed whole, once)."""
    from peftckpt.checkpoint.storage import dcp_writer
    from peftckpt.checkpoint.tools.offline import open_checkpoint

    source, model = _checkpointer(0)
    url = s3.url("ranged/offline")
    source.save(url, 1)
    ckpt = open_checkpoint(url)
    assert ckpt.where == f"{url}/iter_0000001" and ckpt.files is not None
    assert not list(ckpt.path.glob("*.distcp"))  # nothing of the data objects on local disk
    tensors = ckpt.model_tensors()
    for name, value in model.state_dict().items():
        assert torch.equal(tensors[name], value), name
    assert not any(rel.endswith(".distcp") for rel in reads["downloaded"]), reads["downloaded"]
    assert 0 < ckpt.files.bytes_fetched < _data_size(s3, "ranged/offline")  # the model's tensors: no Adam state
    s3.flip_byte("ranged/offline/iter_0000001/__0_0.distcp", offset=100_000)  # in the first model weight
    with pytest.raises(CheckpointError, match=f"{url}/iter_0000001/__0_0.distcp: xxh3_64 checksum mismatch"):
        open_checkpoint(url).model_tensors()

    old = s3.url("ranged/offline-old")
    with monkeypatch.context() as m:  # written as an earlier release did: no block index
        m.setattr(dcp_writer, "tensor_record", lambda tensor: None)
        m.setattr(dcp_writer, "encode_index", lambda items: b"")
        source.save(old, 1)
    hashed = []
    checksum_problems = store_reads.StoreFiles.checksum_problems
    monkeypatch.setattr(store_reads.StoreFiles, "checksum_problems",
                        lambda self, manifest, rels: hashed.extend(rels) or checksum_problems(self, manifest, rels))
    ckpt = open_checkpoint(old)
    for name, value in model.state_dict().items():
        assert torch.equal(ckpt.model_tensors([name])[name], value), name
    assert hashed == ["__0_0.distcp"]  # once, however many reads
    s3.flip_byte("ranged/offline-old/iter_0000001/__0_0.distcp", offset=1000)
    with pytest.raises(CheckpointError, match=f"{old}/iter_0000001/__0_0.distcp: xxh3_128 checksum mismatch"):
        open_checkpoint(old).model_tensors()


def test_a_base_is_kept_in_the_host_cache_and_read_from_it_next_time(s3: S3Server, reads: dict[str, list]) -> None:
    """load_pretrained of a base on the store: the first load fetches it whole into the host's base cache
    (verified as it streams), the next reads the cached copy -- no data object fetched again; a damaged cached
    copy is named as such and deleted, and the load after that fetches the base again; base_cache=False reads it
    where it lies, by ranges."""
    source, model = _checkpointer(0)
    url = s3.url("ranged/base")
    source.save(url, 1)
    cache = Path(os.environ["PEFTCKPT_CACHE_DIR"]) / "bases"

    first = _checkpointer(1)[0].load_pretrained(url)
    assert first.cache_hit is False and reads["downloaded"] and str(first.path).startswith("s3://")
    assert first.bytes_fetched == sum(rec["size"] for rec in first.manifest.files.values())  # the whole base
    reads["downloaded"].clear()
    target, fresh = _checkpointer(2)
    second = target.load_pretrained(url)
    assert second.cache_hit is True and reads["downloaded"] == [] and not reads["loads"]  # nothing from the store
    assert second.bytes_fetched == 0
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]

    blob = entry / "__0_0.distcp"  # the cached copy rots on the host's disk (in the first weight's bytes)
    data = bytearray(blob.read_bytes())
    data[100_000] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="the host's base cache.*it was deleted"):
        _checkpointer(3)[0].load_pretrained(url)
    assert not entry.exists()
    assert _checkpointer(4)[0].load_pretrained(url).cache_hit is False  # fetched again, intact
    assert entry.is_dir()

    ranged = _checkpointer(5)[0].load_pretrained(url, LoadOptions(base_cache=False))
    assert ranged.cache_hit is None and ranged.bytes_fetched and reads["loads"]


def test_a_foreign_directory_is_copied_into_the_host_cache_once_per_version(s3: S3Server) -> None:
    """A directory peftckpt did not write (an HF model directory) on the store: its wanted top-level files are
    copied into the host's base cache on the first read and read from there after; re-uploading a file makes a
    new entry (the key holds the ETags); an object changed between the listing and the copy is named, and nothing
    is kept."""
    from peftckpt.checkpoint.collectives import Collectives
    from peftckpt.checkpoint.location.locate import locate
    from peftckpt.checkpoint.location.store_foreign import _fetch

    store = ObjectStore(s3.url("foreign/hf"))
    store.write_bytes("config.json", b'{"a": 1}')
    store.write_bytes("model.safetensors", b"w" * 1000)
    store.write_bytes("README.md", b"not wanted")
    location = locate(store.url, "base")
    wanted = lambda name: name.endswith((".json", ".safetensors"))  # noqa: E731
    seen = []
    for _ in range(2):
        with location.foreign_files(Collectives(), wanted) as (held, hit):
            seen.append((held.describe(), hit, sorted(p.name for p in Path(held.describe()).iterdir())))
    assert seen[0][1:] == (False, ["config.json", "model.safetensors"]) and seen[1][1] is True
    assert seen[0][0] == seen[1][0]
    store.write_bytes("model.safetensors", b"v" * 1000)  # re-uploaded: a new entry, never the stale copy
    with location.foreign_files(Collectives(), wanted) as (held, hit):
        assert hit is False and held.describe() != seen[0][0]
        assert (Path(held.describe()) / "model.safetensors").read_bytes() == b"v" * 1000
    with location.foreign_files(Collectives(), wanted, cache=False) as (held, hit):
        assert held is location and hit is None  # read where it lies
    listed = store.list_tagged()
    store.write_bytes("model.safetensors", b"u" * 1000)  # rewritten after the listing, same size
    store.write_bytes("config.json", b'{"a": 12}')  # and one of another size
    into = Path(s3.env["PEFTCKPT_CACHE_DIR"]) / "stale-listing"
    problems = _fetch(store, {n: listed[n] for n in ("config.json", "model.safetensors")}, into)
    assert problems == [f"{store.url}/config.json: size mismatch (extended): more than the 8 bytes recorded",
                        f"{store.url}/model.safetensors: md5 checksum mismatch: expected "
                        f"{listed['model.safetensors'][1].strip(chr(34))}, got {hashlib.md5(b'u' * 1000).hexdigest()}"
                        ], problems


def test_verify_hashes_a_stores_data_objects_as_they_stream_without_copying_them(s3: S3Server,
                                                                                 reads: dict[str, list]) -> None:
    """``verify`` of a checkpoint on the store: the small files fetched, every data object hashed as it streams
    and never written to local disk; damage is named by URL, as before."""
    from peftckpt.checkpoint.tools.verify import verify_checkpoint

    source, _ = _checkpointer(0)
    url = s3.url("ranged/verify")
    source.save(url, 1)
    report = verify_checkpoint(url)
    assert report.ok and report.path == f"{url}/iter_0000001", report.problems
    assert reads["downloaded"] and not any(rel.endswith(".distcp") for rel in reads["downloaded"])
    s3.flip_byte("ranged/verify/iter_0000001/__0_0.distcp", offset=100_000)
    bad = verify_checkpoint(url)
    assert [p.split(": ", 1)[0] for p in bad.problems] == [f"{url}/iter_0000001/__0_0.distcp"], bad.problems
    assert "checksum mismatch" in bad.problems[0]
