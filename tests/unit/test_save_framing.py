"""How a save frames its tensors: a blocking save skips the zip CRC32 (the manifest's SHA-256 covers the
bytes), the result stays readable by plain ``torch.load`` / plain DCP, and the process-wide switch is
restored -- an async save, which runs while training goes on, leaves it alone."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from peftckpt.checkpoint.api import Checkpointer, SaveOptions
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


def test_async_save_keeps_zip_crc32(tmp_path: Path) -> None:
    ckpt, _ = _checkpointer()
    path = ckpt.save(tmp_path, 1, options=SaveOptions(async_save=True))
    ckpt.wait()
    assert torch.serialization.get_crc32_options() is True
    assert 0 not in _data_crcs(path).values()
