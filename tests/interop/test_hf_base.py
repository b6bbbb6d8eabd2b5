"""Issue 12: an HF Llama directory is a base wherever a base is taken, read per rank without conversion, and is
the same base as its import; bad HF directories are one message naming the file and the key."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peftckpt.checkpoint.location.directory import resolve_checkpoint_dir
from peftckpt.checkpoint.storage.manifest import read_manifest
from peftckpt.interop import InteropError, import_hf
from tests.integration.cli import peftckpt, read_dcp_tensors
from tests.interop.common import make_llama

# The flags of the `lora_run` fixture (conftest.py), with the base given as an HF directory instead.
LORA = ["--seq-length", "16", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--lora-rank", "4", "--lora-alpha", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "4", "--lr", "5e-3", "--save-interval", "2", "--save-trainable-params-only",
        "--log-interval", "100"]


def test_hf_directory_as_base_trains_exactly_like_its_import(lora_run: Path, hf_dir: Path, base: Path, data: Path,
                                                             tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    make_llama(sharded, max_shard_size="40KB")  # the same weights as hf_dir, in several files + index
    assert (sharded / "model.safetensors.index.json").is_file()
    reference_dir, _ = resolve_checkpoint_dir(lora_run)
    reference = read_dcp_tensors(reference_dir)
    fingerprint = read_manifest(reference_dir).base_fingerprint
    # import-hf recorded every tensor's fingerprint sums: the run on it took them (its reads verified), the runs
    # on the HF directory below sum what they read, and the fingerprints agree
    imported = read_manifest(resolve_checkpoint_dir(base)[0])
    assert imported.base_sums is not None and sorted(imported.base_sums) == sorted(imported.saved_keys)
    for source in (hf_dir, sharded):
        save = tmp_path / f"lora-{source.name}"
        proc = peftckpt(["train", "--pretrained-checkpoint", str(source), "--data-path", str(data), *LORA,
                         "--save", str(save)], nproc=4)
        assert f"architecture flags from --pretrained-checkpoint {source}" in proc.stdout + proc.stderr
        ckpt, _ = resolve_checkpoint_dir(save)
        # the same fingerprint as the imported base, and bit-identical training: adapters and Adam moments
        assert read_manifest(ckpt).base_fingerprint == fingerprint
        got = read_dcp_tensors(ckpt)
        assert sorted(got) == sorted(reference)
        assert all(torch.equal(got[k], reference[k]) for k in reference)
    # an adapter trained on the HF directory resumes on the imported base (one process, resharded)
    proc = peftckpt(["train", "--pretrained-checkpoint", str(base), "--load", str(tmp_path / "lora-sharded"),
                     "--data-path", str(data), "--seq-length", "16", "--micro-batch-size", "2",
                     "--global-batch-size", "4", "--train-iters", "5", "--lr", "5e-3"])
    assert "resumed from" in proc.stdout + proc.stderr


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])


@pytest.mark.parametrize("damage", ["missing-shard", "truncated", "int-dtype", "bad-header"])
def test_bad_hf_directories_are_one_message(tmp_path: Path, damage: str) -> None:
    src = tmp_path / "hf"
    make_llama(src, seed=4, max_shard_size="40KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    key = "model.layers.1.mlp.down_proj.weight"
    shard = src / index[key]
    if damage == "missing-shard":
        shard.unlink()
        expected = f"lists shard {shard.name} (e.g. for tensor '"
    elif damage == "truncated":
        _truncate(shard)
        expected = f"{shard} is truncated: tensor '"
    elif damage == "int-dtype":
        tensors = load_file(str(shard))
        tensors[key] = tensors[key].to(torch.int32)
        save_file(tensors, str(shard), metadata={"format": "pt"})
        expected = f"tensor '{key}' in {shard.name} is torch.int32, not floating point"
    else:
        shard.write_bytes(b"\xff" * 8 + shard.read_bytes()[8:])
        expected = f"{shard} is truncated or not safetensors"
    with pytest.raises(InteropError, match=re.escape(expected)):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    if damage == "truncated":  # as a training base: one message, before any step, nothing saved
        proc = peftckpt(["train", "--pretrained-checkpoint", str(src), "--mock-data", "--lora-rank", "2",
                         "--train-iters", "2", "--save", str(tmp_path / "save")], check=False)
        assert proc.returncode == 1 and proc.stderr.count(expected) == 1, proc.stderr
        assert "Traceback" not in proc.stderr and not (tmp_path / "save" / "latest_checkpointed_iteration.txt").exists()
        shutil.rmtree(src)


def test_tools_take_an_hf_directory_as_base(lora_run: Path, hf_dir: Path, base: Path, tmp_path: Path) -> None:
    """export-hf --base and import-peft --base accept the HF directory and give what its import gives."""
    merged = {}
    for name, source in (("hf", hf_dir), ("imported", base)):
        peftckpt(["export-hf", str(lora_run), str(tmp_path / f"merged-{name}"), "--base", str(source)])
        merged[name] = load_file(str(tmp_path / f"merged-{name}" / "model.safetensors"))
    assert sorted(merged["hf"]) == sorted(merged["imported"])
    assert all(torch.equal(merged["hf"][k], merged["imported"][k]) for k in merged["hf"])
    done = peftckpt(["export-peft", str(lora_run), str(tmp_path / "peft")])
    # the adapter was trained on import-hf's base: its HF directory is recorded, files world-readable (#16)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir.absolute())
    assert f"(base_model_name_or_path: {hf_dir.absolute()})" in done.stdout
    for f in (tmp_path / "peft").iterdir():
        assert f.stat().st_mode & 0o644 == 0o644, f
    adapters = {}
    for name, source in (("hf", hf_dir), ("imported", base)):
        out = tmp_path / f"adapter-{name}"
        peftckpt(["import-peft", str(tmp_path / "peft"), str(out), "--base", str(source)])
        ckpt, _ = resolve_checkpoint_dir(out)
        adapters[name] = (read_manifest(ckpt).base_fingerprint, read_dcp_tensors(ckpt))
    assert adapters["hf"][0] == adapters["imported"][0] == read_manifest(resolve_checkpoint_dir(lora_run)[0]).base_fingerprint
    assert all(torch.equal(v, adapters["imported"][1][k]) for k, v in adapters["hf"][1].items())
