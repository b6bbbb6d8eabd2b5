"""How a save frames its tensors: ``torch.save``-compatible records written from the tensor's memory (the pickle
byte for byte ``torch.save``'s, the zip CRC32 left 0 as ``torch.save`` leaves it with the switch off: the
manifest's checksums and the block index cover the bytes), readable by plain ``torch.load`` / plain DCP, for
blocking and async saves alike; the process-wide switch is restored, and an async save never touches it."""

from __future__ import annotations

import io
import math
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from peftckpt.checkpoint.api import Checkpointer, LoadOptions, SaveOptions
from peftckpt.checkpoint.errors import CheckpointIntegrityError
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from tests.integration.cli import read_dcp_tensors

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

KW = dict(layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, coords={"tp": 0, "pp": 0, "dp": 0},
          model_config={"width": 32})


def _checkpointer() -> tuple[Checkpointer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 4))
    model[0].requires_grad_(False)
    return Checkpointer([model], torch.optim.AdamW(model[1].parameters()), **KW), model


def _data_crcs(ckpt: Path) -> dict[str, int]:
    """The zip CRC32 recorded for the data record of every stored tensor item."""
    md = load_dcp_metadata(ckpt / ".metadata")
    out = {}
    for index, info in md.storage_data.items():
        if not isinstance(md.state_dict_metadata[index.fqn], TensorStorageMetadata):
            continue
        with open(ckpt / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        records = zipfile.ZipFile(io.BytesIO(blob)).infolist()
        out[index.fqn] = next(r.CRC for r in records if "/data/" in r.filename)
        assert torch.load(io.BytesIO(blob), weights_only=True).numel() > 0
    return out


@pytest.mark.parametrize("user_setting", [True, False])
def test_blocking_save_skips_zip_crc32_and_restores_the_switch(tmp_path: Path, user_setting: bool) -> None:
    ckpt, model = _checkpointer()
    torch.serialization.set_crc32_options(user_setting)
    try:
        path = ckpt.save(tmp_path, 1)
        assert torch.serialization.get_crc32_options() is user_setting
    finally:
        torch.serialization.set_crc32_options(True)
    crcs = _data_crcs(path)
    assert set(crcs) >= {"model.0.weight", "model.1.weight", "optimizer.state.1.weight.exp_avg"}
    assert set(crcs.values()) == {0}
    plain = read_dcp_tensors(path, "model.")  # plain DCP, plain torch.load
    for name, tensor in model.state_dict().items():
        assert torch.equal(plain[f"model.{name}"], tensor), name


def test_async_save_frames_like_a_blocking_save_and_leaves_the_switch(tmp_path: Path) -> None:
    ckpt, model = _checkpointer()
    path = ckpt.save(tmp_path, 1, options=SaveOptions(async_save=True))
    ckpt.wait()
    assert torch.serialization.get_crc32_options() is True
    assert set(_data_crcs(path).values()) == {0}
    plain = read_dcp_tensors(path, "model.")
    for name, tensor in model.state_dict().items():
        assert torch.equal(plain[f"model.{name}"], tensor), name


CASES = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 3, 4), torch.float16), ((), torch.float32),
         ((0, 4), torch.float32), ((5,), torch.bool), ((4, 2), torch.int64), ((3,), torch.uint8),
         ((2, 2), torch.complex64), ((6,), torch.int8)]


@pytest.mark.parametrize("shape,dtype", CASES, ids=[f"{d}-{list(s)}" for s, d in CASES])
def test_records_are_what_torch_save_writes(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """The record's pickle is ``torch.save``'s byte for byte; ``torch.load`` (weights_only) reads the record as
    the same tensor; the tensor bytes sit where the record says, 64-byte aligned inside it."""
    from peftckpt.checkpoint.storage.framing import tensor_bytes, tensor_record

    tensor = (torch.arange(math.prod(shape)) % 7).to(dtype).reshape(shape)
    record = tensor_record(tensor)
    assert record is not None
    blob = record.prefix + bytes(tensor_bytes(tensor)) + record.suffix
    loaded = torch.load(io.BytesIO(blob), weights_only=True)
    assert loaded.dtype == dtype and loaded.shape == tensor.shape and torch.equal(loaded, tensor)
    reference = io.BytesIO()
    torch.save(tensor, reference)
    assert _stored(blob, "archive/data.pkl") == _stored(reference.getvalue(), "archive/data.pkl")
    assert _stored(blob, "archive/data/0") == bytes(tensor_bytes(tensor))
    assert len(record.prefix) % 64 == 0


def _stored(blob: bytes, name: str) -> bytes:
    """A stored zip entry's bytes, found through the central directory (``ZipFile.read`` would check the CRC32,
    which both ``torch.save`` with the switch off and our records leave 0)."""
    info = zipfile.ZipFile(io.BytesIO(blob)).getinfo(name)
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len
    return blob[start:start + info.file_size]


def test_checkpoints_without_the_new_framing_still_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Items framed by ``torch.save`` (an earlier release's, or a tensor the framing leaves to it) and data files
    without a block index load through the stock path, verified by their whole-file checksums."""
    from peftckpt.checkpoint.storage import dcp_writer, framing

    source, model = _checkpointer()
    with monkeypatch.context() as m:  # every tensor framed by torch.save, and no block index: as earlier releases
        m.setattr(dcp_writer, "tensor_record", lambda tensor: None)
        m.setattr(dcp_writer, "encode_index", lambda items: b"")
        old = source.save(tmp_path / "old", 1, {"step": 1})
    with open(old / "__0_0.distcp", "rb") as f:
        assert framing.read_index(f.fileno(), (old / "__0_0.distcp").stat().st_size, verify=True) is None
    target, fresh = _checkpointer()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    assert target.load(tmp_path / "old", LoadOptions(objects=["step"])).objects == {"step": 1}
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    # and the same file, damaged, is still caught (by its whole-file checksum)
    data = bytearray((old / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 1
    (old / "__0_0.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match="__0_0.distcp: xxh3_128 checksum mismatch"):
        target.load(tmp_path / "old")


def test_tensors_left_to_torch_save_are_indexed_whole_and_verified(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor the framing leaves to ``torch.save`` (a record of 2 GiB or more, a dtype without a storage class)
    is indexed as one opaque item: the load reads it whole, verifies its digest, and names it when damaged."""
    from peftckpt.checkpoint.storage import dcp_writer

    source, model = _checkpointer()
    with monkeypatch.context() as m:
        m.setattr(dcp_writer, "tensor_record", lambda tensor: None)
        path = source.save(tmp_path, 1)
    target, fresh = _checkpointer()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    target.load(tmp_path)
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    md = load_dcp_metadata(path / ".metadata")
    info = next(v for k, v in md.storage_data.items() if k.fqn == "model.0.weight")
    data = bytearray((path / info.relative_path).read_bytes())
    data[info.offset + info.length // 2] ^= 1  # inside the tensor's bytes of its torch.save record
    (path / info.relative_path).write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"__0_0.distcp: xxh3_64 checksum mismatch in the bytes of "
                                                       r"'model.0.weight' \(framing"):
        target.load(tmp_path)


def test_gathered_writes_survive_short_writes_and_hash_every_byte_in_order(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer's vectored writes resume after a short ``writev`` (the kernel may take part of a batch), and the
    checksum taken on another thread while writing equals the file's own, byte for byte."""
    import os

    from peftckpt.checkpoint.storage import checksums
    from peftckpt.checkpoint.storage.checksums import ChecksummingFileSystem, checksum_file

    real_writev = os.writev
    calls: list[int] = []

    def short_writev(fd: int, views: list[memoryview]) -> int:  # at most 1000 bytes a call, cut mid-buffer
        calls.append(len(views))
        first = memoryview(views[0])[:1000]
        return real_writev(fd, [first])

    monkeypatch.setattr(os, "writev", short_writev)
    ranges: list[tuple[int, int]] = []
    real_writeback = checksums.start_writeback
    monkeypatch.setattr(checksums, "start_writeback", lambda fd, at, n: (ranges.append((at, n)),
                                                                          real_writeback(fd, at, n)))
    fs = ChecksummingFileSystem()
    path = tmp_path / "__0_0.distcp"
    pieces = [bytes([i % 251]) * (i * 37 % 5000) for i in range(300)]
    with fs.create_stream(path, "wb") as stream:
        raw = stream.raw
        raw.write_many([memoryview(p) for p in pieces[:150]])
        stream.write(b"between")  # a plain write after gathered ones keeps the order
        stream.flush()  # (the vectored writes go below the stream's buffer, as the writer's do after a flush)
        raw.write_many([memoryview(p) for p in pieces[150:]])
    expected = b"".join(pieces[:150]) + b"between" + b"".join(pieces[150:])
    assert path.read_bytes() == expected
    assert len(calls) > 100  # it really was cut short, many times
    record = fs.checksums([path], tmp_path)[path.name]
    assert record == {"size": len(expected), "checksum": checksum_file(path)}
    assert checksums._ordered_pool is not None
    # Each batch's write-back to the disk was started right after it: the gathered bytes, where they lie.
    first = len(b"".join(pieces[:150]))
    assert ranges == [(0, first), (first + len(b"between"), len(expected) - first - len(b"between"))]
