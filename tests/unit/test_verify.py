"""Offline verification of a real (single-process) DCP checkpoint, and the ``peftckpt verify`` CLI."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from peftckpt.checkpoint.errors import CheckpointFormatError, CheckpointNotFoundError
from peftckpt.checkpoint.location.directory import commit_staging, new_staging_dir
from peftckpt.checkpoint.storage.checksums import checksum_files
from peftckpt.checkpoint.storage.manifest import Manifest
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from peftckpt.checkpoint.tools.verify import verify_checkpoint
from peftckpt.cli.verify import verify_main


def _make_checkpoint(save: Path, iteration: int = 100, shape_in_manifest: list[int] | None = None) -> Path:
    staging = new_staging_dir(save, iteration, "tok")
    state = {"model": {"lora_A": torch.randn(4, 16), "lora_B": torch.zeros(16, 4)}, "iteration": iteration}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(staging))
    files = checksum_files([p for p in staging.rglob("*") if p.is_file()], staging)
    manifest = Manifest(
        format="torch_dist",
        iteration=iteration,
        sections=["model", "iteration"],
        layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1},
        trainable_only=True,
        saved_keys={
            "model.lora_A": {
                "shape": shape_in_manifest or [4, 16],
                "dtype": "float32",
                "requires_grad": True,
            },
            "model.lora_B": {"shape": [16, 4], "dtype": "float32", "requires_grad": True},
        },
        files=files,
    )
    return commit_staging(staging, save, iteration, manifest.to_json())


def test_intact_checkpoint_ok_via_save_dir_and_iter_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _make_checkpoint(tmp_path)
    report = verify_checkpoint(tmp_path)
    assert report.ok and report.problems == []
    assert (report.path, report.iteration, report.num_files) == (ckpt, 100, 2)
    assert report.total_bytes == sum(p.stat().st_size for p in ckpt.iterdir() if p.name != "metadata.json")
    assert verify_checkpoint(ckpt).ok

    assert verify_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out == f"OK {ckpt} (iteration 100, 2 files, {report.total_bytes / 2**20:.1f} MiB)\n"
    assert verify_main([str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_corrupted_shard_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = _make_checkpoint(tmp_path)
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    report = verify_checkpoint(tmp_path)
    assert not report.ok
    assert len(report.problems) == 1 and report.problems[0].startswith(f"{shard}: xxh3_128 checksum mismatch")

    assert verify_main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"{shard}: xxh3_128 checksum mismatch" in err and "FAILED" in err
    assert verify_main([str(tmp_path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["problems"] == report.problems


def test_shape_mismatch_and_missing_key(tmp_path: Path) -> None:
    ckpt = _make_checkpoint(tmp_path, shape_in_manifest=[8, 16])
    problems = verify_checkpoint(ckpt).problems
    assert problems == [
        f"{ckpt / '.metadata'}: saved key 'model.lora_A' has global shape [4, 16] in DCP metadata, manifest says [8, 16]"
    ]


def test_unsafe_metadata_is_a_problem_not_an_execution(tmp_path: Path) -> None:
    ckpt = _make_checkpoint(tmp_path)
    md = load_dcp_metadata(ckpt / ".metadata")

    class Evil:
        def __reduce__(self) -> tuple[object, tuple[object, ...]]:
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    md.planner_data = Evil()
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    problems = verify_checkpoint(ckpt).problems
    assert any("refers to posix.system" in p for p in problems)
    assert any(p.startswith(f"{ckpt / '.metadata'}: size mismatch") for p in problems)
    assert not (tmp_path / "pwned").exists()


def test_not_a_checkpoint_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        verify_checkpoint(tmp_path)
    (tmp_path / "junk.txt").write_text("x")
    with pytest.raises(CheckpointFormatError, match="neither a peftckpt checkpoint"):
        verify_checkpoint(tmp_path)
    assert verify_main([str(tmp_path)]) == 1
    assert "neither a peftckpt checkpoint" in capsys.readouterr().err

    assert verify_main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"peftckpt verify: error: DIR {tmp_path / 'missing'} does not exist\n"
    assert verify_main([]) == 2
    assert "usage: peftckpt verify [-h] [--json] [--all] DIR" in capsys.readouterr().err
