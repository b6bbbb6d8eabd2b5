"""Restricted loading of DCP's pickled metadata and of DCP non-tensor items."""

from __future__ import annotations

import pickle
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from peftckpt.checkpoint.errors import CheckpointFormatError, UnsafeCheckpointError
from peftckpt.checkpoint.storage.safe_pickle import SafeFileSystemReader, load_dcp_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _TouchOnLoad:
    """Unpickling this object creates ``marker``: stands in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.touch, (self.marker,))


class _ShellOnLoad(_TouchOnLoad):
    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        import os

        return (os.system, (f"touch {self.marker}",))


def _state_dict() -> dict[str, object]:
    return {
        "model": {
            "w": torch.randn(4, 3),
            "b": torch.zeros(3, dtype=torch.bfloat16),
            "cl": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "mask": torch.ones(2, dtype=torch.bool),
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 1e-3, "params": [0]}],
        },
        "iteration": 100,
        "rng_state": {"python": (3, tuple(range(5)), None)},
        "blob": b"abc",
        "od": OrderedDict(a=1),
    }


def _dcp_save(path: Path, state_dict: dict[str, object]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict, storage_writer=FileSystemWriter(path))


def test_real_dcp_metadata_loads(tmp_path: Path) -> None:
    _dcp_save(tmp_path, _state_dict())
    md = load_dcp_metadata(tmp_path / ".metadata")
    assert isinstance(md, Metadata)
    entry = md.state_dict_metadata["model.b"]
    assert isinstance(entry, TensorStorageMetadata)
    assert list(entry.size) == [3] and entry.properties.dtype == torch.bfloat16
    with open(tmp_path / ".metadata", "rb") as f:
        assert pickle.load(f).state_dict_metadata.keys() == md.state_dict_metadata.keys()


@pytest.mark.parametrize(
    ("payload", "refused"), [(_TouchOnLoad, "pathlib.Path.touch"), (_ShellOnLoad, "posix.system")]
)
def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path: Path, payload: type, refused: str) -> None:
    ckpt = tmp_path / "ckpt"
    _dcp_save(ckpt, _state_dict())
    md = load_dcp_metadata(ckpt / ".metadata")
    marker = tmp_path / "pwned"
    md.planner_data = {"x": payload(marker)}
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)

    with pytest.raises(UnsafeCheckpointError) as exc:
        load_dcp_metadata(ckpt / ".metadata")
    assert str(ckpt / ".metadata") in str(exc.value)
    assert f"refers to {refused}," in str(exc.value)
    assert not marker.exists()

    # Control: the payload is real, an unrestricted load does run it.
    with open(ckpt / ".metadata", "rb") as f:
        pickle.load(f)
    assert marker.exists()


def test_corrupt_missing_and_wrong_type(tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match=f"DCP metadata file {tmp_path / 'nope'} is missing"):
        load_dcp_metadata(tmp_path / "nope")
    (tmp_path / "trunc").write_bytes(pickle.dumps({"a": 1})[:-3])
    with pytest.raises(CheckpointFormatError, match="trunc is corrupt"):
        load_dcp_metadata(tmp_path / "trunc")
    (tmp_path / "dict").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointFormatError, match="holds a dict, expected torch.distributed"):
        load_dcp_metadata(tmp_path / "dict")


def test_safe_reader_round_trip(tmp_path: Path) -> None:
    saved = _state_dict()
    _dcp_save(tmp_path, saved)
    target = _state_dict()
    target["model"] = {k: torch.zeros_like(v) for k, v in saved["model"].items()}  # type: ignore[attr-defined]
    target["iteration"] = 0
    target["blob"] = b""
    reader = SafeFileSystemReader(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=reader)
    for key, value in saved["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(target["model"][key], value)  # type: ignore[index]
    assert target["iteration"] == 100
    assert target["blob"] == b"abc"
    assert target["rng_state"] == {"python": (3, (0, 1, 2, 3, 4), None)}
    assert reader.read_metadata().storage_meta.load_id == reader.load_id  # type: ignore[union-attr]


def test_safe_reader_unpickles_the_metadata_once_per_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked again within one load (the checkpoint opened, then DCP's own call), the same metadata; a new load
    (``reset``: a new load id) reads the file again."""
    from peftckpt.checkpoint.storage import safe_pickle

    _dcp_save(tmp_path, _state_dict())
    parsed = []
    monkeypatch.setattr(safe_pickle, "load_dcp_metadata",
                        lambda path, **kw: parsed.append(path) or load_dcp_metadata(path, **kw))
    reader = SafeFileSystemReader(tmp_path)
    first = reader.read_metadata()
    assert reader.read_metadata() is first and len(parsed) == 1
    reader.reset()
    again = reader.read_metadata()
    assert again is not first and len(parsed) == 2
    assert again.storage_meta.load_id == reader.load_id  # type: ignore[union-attr]


def test_a_loads_integrity_check_hands_its_metadata_to_the_reader_once(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's integrity check keeps the metadata it unpickled for the reader (one unpickling per load, not two),
    once: the next load unpickles again, and bytes that changed in between are never taken for the kept ones."""
    from peftckpt.checkpoint.storage import safe_pickle

    _dcp_save(tmp_path, _state_dict())
    path = tmp_path / ".metadata"
    unpickled = []
    real = safe_pickle.RestrictedUnpickler.load
    monkeypatch.setattr(safe_pickle.RestrictedUnpickler, "load", lambda self: unpickled.append(1) or real(self))
    checked = load_dcp_metadata(path, hand_on=True)
    assert load_dcp_metadata(path, handed=True) is checked and len(unpickled) == 1
    assert load_dcp_metadata(path, handed=True) is not checked and len(unpickled) == 2  # handed on once only
    load_dcp_metadata(path, hand_on=True)
    reader = SafeFileSystemReader(tmp_path)
    assert reader.read_metadata().state_dict_metadata.keys() == checked.state_dict_metadata.keys()
    assert len(unpickled) == 3  # the reader took what the check kept
    load_dcp_metadata(path, hand_on=True)
    _dcp_save(tmp_path, {**_state_dict(), "extra": torch.zeros(3)})  # other bytes at the same path
    assert "extra" in load_dcp_metadata(path, handed=True).state_dict_metadata and len(unpickled) == 5


def test_safe_reader_refuses_unsafe_bytes_item(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    _dcp_save(ckpt, {"w": torch.ones(2), "evil": _TouchOnLoad(marker)})
    target: dict[str, object] = {"w": torch.zeros(2), "evil": None}
    with pytest.raises(CheckpointException) as exc, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=SafeFileSystemReader(ckpt))
    # DCP wraps per-rank failures into CheckpointException (a BaseException): unwrap rank 0's.
    original, _trace = exc.value.failures[0]
    assert isinstance(original, UnsafeCheckpointError)
    assert str(original).startswith(
        f"non-tensor item 'evil' in {ckpt / '__0_0.distcp'} cannot be loaded with torch.load(weights_only=True), "
        f"so it is refused (it could run code): WeightsUnpickler error: Unsupported global: GLOBAL getattr"
    )
    assert "Re-running `torch.load` with `weights_only` set to `False`" not in str(original)
    assert not marker.exists()
