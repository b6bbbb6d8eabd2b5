"""The ranged reader: a rank reads the bytes of its region of a stored tensor -- not the tensor -- straight into
its destination where it can, and verifies exactly the blocks it read against the block index."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from peftckpt.checkpoint.api import Checkpointer, LoadOptions
from peftckpt.checkpoint.errors import CheckpointIntegrityError
from peftckpt.checkpoint.storage.dcp_reader import RangedFileSystemReader
from peftckpt.checkpoint.storage.framing import BLOCK_BYTES
from peftckpt.checkpoint.storage.planners import EntryLoadPlanner
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from peftckpt.sharding.entries import GlobalTensor, Piece

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

ROWS, COLS = 1024, 1024  # fp32: 4 MiB, four verification blocks
KEY = "model.0.weight"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(COLS, ROWS, bias=False))
    ckpt = Checkpointer([model], None, layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, coords={"tp": 0, "pp": 0, "dp": 0},
                        model_config={"width": COLS})
    path = ckpt.save(tmp_path_factory.mktemp("ranged"), 1)
    return Path(path), model[0].weight.detach().clone()


def _read(ckpt: Path, offsets: tuple[int, int], shape: tuple[int, int], dtype: torch.dtype = torch.float32,
          verify: bool = True) -> tuple[torch.Tensor, RangedFileSystemReader]:
    dest = torch.full(shape, -1.0, dtype=dtype)
    reader = RangedFileSystemReader(ckpt, verify=verify)
    request = {KEY: GlobalTensor((ROWS, COLS), dtype, [Piece(offsets, dest)])}
    dcp.load(request, storage_reader=reader, planner=EntryLoadPlanner(), no_dist=True)
    return dest, reader


def _item_data_start(ckpt: Path) -> tuple[Path, int]:
    """The data file holding KEY and the file offset of its first tensor byte."""
    from peftckpt.checkpoint.storage.framing import read_index

    md = load_dcp_metadata(ckpt / ".metadata")
    info = next(v for k, v in md.storage_data.items() if k.fqn == KEY)
    path = ckpt / info.relative_path
    with open(path, "rb") as f:
        index = read_index(f.fileno(), path.stat().st_size, verify=True)
    assert index is not None
    return path, index[info.offset].data_offset


def test_a_row_slice_reads_its_rows_only(saved: tuple[Path, torch.Tensor]) -> None:
    ckpt, weight = saved
    got, reader = _read(ckpt, (256, 0), (512, COLS))
    assert torch.equal(got, weight[256:768])
    assert reader.bytes_read == 512 * COLS * 4 == 2 * BLOCK_BYTES  # block-aligned rows: not one byte more
    assert reader.problems == []
    # a slice off the block edges reads at most one block more at each end
    got, reader = _read(ckpt, (100, 0), (200, COLS))
    assert torch.equal(got, weight[100:300])
    assert 200 * COLS * 4 <= reader.bytes_read <= 200 * COLS * 4 + 2 * BLOCK_BYTES


def test_column_slices_and_dtype_changes_go_through_a_buffer(saved: tuple[Path, torch.Tensor]) -> None:
    ckpt, weight = saved
    got, _ = _read(ckpt, (0, 512), (ROWS, 512))
    assert torch.equal(got, weight[:, 512:])
    got, _ = _read(ckpt, (10, 3), (20, 7))
    assert torch.equal(got, weight[10:30, 3:10])
    got, _ = _read(ckpt, (0, 0), (ROWS, COLS), dtype=torch.bfloat16)
    assert torch.equal(got, weight.to(torch.bfloat16))


def test_large_column_slices_are_read_in_runs_of_rows_through_one_buffer(saved: tuple[Path, torch.Tensor],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from peftckpt.checkpoint.storage import dcp_reader

    ckpt, weight = saved
    monkeypatch.setattr(dcp_reader, "_BOUNCE_BYTES", 300_000)  # ~73 rows of 4 KiB per run
    got, reader = _read(ckpt, (5, 100), (1000, 900))
    assert torch.equal(got, weight[5:1005, 100:1000])
    assert reader.problems == [] and reader._buffers._made == 1 and reader._buffers.nbytes == 300_000
    # every block read is read whole and verified: at most one block more per run, at each end
    runs = -(-1000 // (300_000 // (COLS * 4)))
    assert 1000 * COLS * 4 <= reader.bytes_read <= 1000 * COLS * 4 + 2 * runs * BLOCK_BYTES


def test_reads_through_buffers_share_a_few_of_them() -> None:
    """Buffered reads run on the read threads: each holds one buffer, at most ``count`` exist, all reused."""
    import threading
    import time

    from peftckpt.checkpoint.storage.bounce_buffers import BounceBuffers

    buffers = BounceBuffers(3, 1000)
    held: list[int] = []
    peak: list[int] = []
    lock = threading.Lock()

    def read() -> None:
        for _ in range(20):
            with buffers.take(600) as buffer:
                assert buffer.numel() == 600
                with lock:
                    held.append(buffer.data_ptr())
                    peak.append(len(held))
                time.sleep(0.001)
                with lock:
                    held.remove(buffer.data_ptr())

    threads = [threading.Thread(target=read) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(peak) <= 3 and buffers._made == 3
    with buffers.take(5000) as larger:  # a row longer than a buffer: memory of its own
        assert larger.numel() == 5000 and buffers._made == 3


def test_damage_is_found_in_what_is_read_and_named(saved: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    ckpt, weight = saved
    import shutil

    copy = tmp_path / "iter"
    shutil.copytree(ckpt, copy)
    path, data_start = _item_data_start(copy)
    raw = bytearray(path.read_bytes())
    raw[data_start + 900 * COLS * 4] ^= 0x40  # row 900, in the last block
    path.write_bytes(bytes(raw))
    _, reader = _read(copy, (0, 0), (512, COLS))  # rows 0-511 never touch it
    assert reader.problems == []
    _, reader = _read(copy, (768, 0), (256, COLS))
    assert len(reader.problems) == 1
    assert reader.problems[0].startswith(f"{path}: xxh3_64 checksum mismatch in the bytes of {KEY!r} (block 3 ")
    _, reader = _read(copy, (768, 0), (256, COLS), verify=False)
    assert reader.problems == []
    # through the checkpointer: the load names the file after the read, and verify's whole-file checksum sees it
    model = nn.Sequential(nn.Linear(COLS, ROWS, bias=False))
    target = Checkpointer([model], None, layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1},
                          coords={"tp": 0, "pp": 0, "dp": 0}, model_config={"width": COLS})
    with pytest.raises(CheckpointIntegrityError) as info:
        target.load(copy)
    text = str(info.value)
    assert f"{path}: xxh3_64 checksum mismatch in the bytes of {KEY!r}" in text
    assert "may hold values from them" in text and "LoadOptions(verify_checksums=False)" in text
    with pytest.raises(CheckpointIntegrityError, match="xxh3_128 checksum mismatch"):
        target.load(copy, LoadOptions(verify_while_reading=False))


def test_a_damaged_block_index_is_named_and_the_stock_path_reads(saved: tuple[Path, torch.Tensor],
                                                                  tmp_path: Path) -> None:
    ckpt, weight = saved
    import shutil

    copy = tmp_path / "iter"
    shutil.copytree(ckpt, copy)
    path, _ = _item_data_start(copy)
    raw = bytearray(path.read_bytes())
    raw[-30] ^= 0x01  # inside the index body
    path.write_bytes(bytes(raw))
    got, reader = _read(copy, (0, 0), (ROWS, COLS))
    assert torch.equal(got, weight)  # read by the stock path
    assert len(reader.problems) == 1 and "checksum mismatch of its block index" in reader.problems[0]


def test_a_failed_read_drops_the_reads_still_queued(tmp_path: Path) -> None:
    """A read that fails stops the load: the reads queued behind it are not run (on a store each would fetch its
    range afresh), only those already running finish."""
    import time

    from peftckpt.checkpoint.storage import dcp_reader
    from peftckpt.checkpoint.storage.byte_sources import FileSource

    layers = 40
    model = nn.Sequential(*(nn.Linear(64, 64, bias=False) for _ in range(layers)))
    ckpt = Path(Checkpointer([model], None, layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1},
                             coords={"tp": 0, "pp": 0, "dp": 0}, model_config={"width": 64}).save(tmp_path, 1))
    reads: list[int] = []

    class Failing(FileSource):
        def read_into(self, views, offset):  # type: ignore[no-untyped-def]
            reads.append(offset)
            if len(reads) == 1:
                raise OSError("the first read fails")
            time.sleep(0.2)  # the others take long enough for the load to see the failure
            return super().read_into(views, offset)

    reader = RangedFileSystemReader(ckpt, sources=lambda rel: Failing(ckpt / rel))
    request = {f"model.{i}.weight": GlobalTensor((64, 64), torch.float32, [Piece((0, 0), torch.empty(64, 64))])
               for i in range(layers)}
    with pytest.raises(CheckpointException) as failed:
        dcp.load(request, storage_reader=reader, planner=EntryLoadPlanner(), no_dist=True)
    assert "OSError('the first read fails')" in repr(failed.value.failures)
    assert len(reads) <= 1 + dcp_reader._READ_THREADS, f"{len(reads)} of {layers} reads ran after the failure"
