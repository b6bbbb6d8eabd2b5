"""Issue 5 / must show 2 and 5: every kind of damage to every kind of file is detected, with the file named,
by ``peftckpt verify`` and by a load; a ``.metadata`` crafted to run code is refused and runs nothing."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from peftckpt.checkpoint.api import LoadOptions
from peftckpt.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from peftckpt.checkpoint.tools.verify import verify_checkpoint
from peftckpt.cli.verify import verify_main
from tests.unit.small_model import small_checkpointer


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("pristine")
    small_checkpointer()[0].save(save, 3, {"iteration": 3})
    return save


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))


FILES = ["__0_0.distcp", ".metadata", "metadata.json"]
DAMAGE = {"truncated": _truncate, "bit-flipped": _flip, "deleted": Path.unlink}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("name", FILES)
def test_damage_is_detected_and_named(pristine: Path, tmp_path: Path, name: str, damage: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    save = tmp_path / "save"
    shutil.copytree(pristine, save)
    ckpt = save / "iter_0000003"
    DAMAGE[damage](ckpt / name)
    # offline verify: non-zero exit, the file named
    if name == "metadata.json" and damage == "deleted":
        expected = "not a committed"  # without its manifest the directory is not a checkpoint at all
    else:
        expected = name
    assert verify_main([str(ckpt)]) != 0
    out = capsys.readouterr()
    assert expected in out.err + out.out
    # load, everything verified before anything is read: an error naming the file, the model untouched
    target, model = small_checkpointer(seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as info:
        target.load(ckpt, LoadOptions(objects=["iteration"], verify_while_reading=False))
    assert expected in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # load with the data files hashed while they are read (the default): the same error; only damage that
    # presence and size checks cannot see (a flipped byte in a data file) is found after the read
    after_read = name.endswith(".distcp") and damage == "bit-flipped"
    with pytest.raises(CheckpointError) as info:
        target.load(ckpt, LoadOptions(objects=["iteration"]))
    assert expected in str(info.value)
    assert ("the model and optimizer may hold values from them" in str(info.value)) == after_read
    if not after_read:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_pristine_checkpoint_verifies_and_loads(pristine: Path) -> None:
    report = verify_checkpoint(pristine)
    assert report.ok and report.iteration == 3 and report.num_files == 2
    target, model = small_checkpointer(seed=1)
    result = target.load(pristine, LoadOptions(objects=["iteration"]))
    assert result.objects == {"iteration": 3}
    source, saved = small_checkpointer(seed=0)
    assert all(torch.equal(a, b) for a, b in zip(saved.parameters(), model.parameters()))


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


def test_crafted_metadata_is_refused_by_verify_and_load(pristine: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    save = tmp_path / "save"
    shutil.copytree(pristine, save)
    ckpt = save / "iter_0000003"
    md = load_dcp_metadata(ckpt / ".metadata")
    marker = tmp_path / "code-ran"
    md.planner_data = {"x": _Payload(marker)}
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    # re-record the manifest's checksum of the crafted file, as an attacker would
    from peftckpt.checkpoint.storage.checksums import checksum_files

    manifest = json.loads((ckpt / "metadata.json").read_text())
    manifest.pop("manifest_sha256")
    manifest["files"].update(checksum_files([ckpt / ".metadata"], ckpt))
    (ckpt / "metadata.json").write_text(json.dumps(manifest))
    assert verify_main([str(ckpt)]) != 0
    assert "pathlib" in capsys.readouterr().err
    target, _ = small_checkpointer(seed=1)
    with pytest.raises(UnsafeCheckpointError, match="pathlib"):
        target.load(ckpt, LoadOptions())
    assert not marker.exists()


def test_a_data_file_gone_while_it_is_verified_is_reported(pristine: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data file that disappears between the size check and its hashing (verified while reading) is an
    integrity error naming it -- raised collectively, not an OSError escaping on one rank. (Data files without a
    block index -- an earlier release's -- are hashed whole while the load reads them.)"""
    from peftckpt.checkpoint.storage import checkpoint_files as api

    ckpt = pristine / "iter_0000003"
    monkeypatch.setattr(api, "has_block_index", lambda path: False)

    def vanished(root: Path, manifest: object, rels: list[str]) -> list[str]:
        raise FileNotFoundError(2, "No such file or directory", str(Path(root) / rels[0]))

    monkeypatch.setattr(api, "verify_checksums", vanished)
    target, _ = small_checkpointer(seed=1)
    with pytest.raises(CheckpointError) as info:
        target.load(ckpt, LoadOptions(objects=["iteration"]))
    assert f"{ckpt / '__0_0.distcp'}: cannot be read to verify" in str(info.value)
