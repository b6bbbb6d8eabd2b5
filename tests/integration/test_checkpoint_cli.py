"""The checkpoint flags end to end (issue 3 must show 3, 5, 6; issue 4 must show 2, 5; iteration 0)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from peftckpt.checkpoint.storage.checksums import checksum_files
from peftckpt.model.gpt import param_generator

from .cli import TINY, peftckpt, read_dcp_tensors, train_records

pytestmark = pytest.mark.slow
LORA = ["--lora-rank", "4", "--save-trainable-params-only"]
FC1 = "model.decoder.layers.1.mlp.linear_fc1.weight"


def _train(tmp: Path, name: str, *args: str, nproc: int = 0, check: bool = True):  # type: ignore[no-untyped-def]
    return peftckpt(["train", *TINY, "--metrics-file", str(tmp / f"{name}.jsonl"), *args], nproc, check=check)


def test_fused_swiglu_is_canonical_in_plain_dcp(tmp_path: Path) -> None:
    """Read with plain torch.distributed.checkpoint: linear_fc1 is [gate_full; up_full] at TP=1 and TP=2."""
    _train(tmp_path, "tp1", "--train-iters", "0", "--save", str(tmp_path / "tp1"))
    _train(tmp_path, "tp2", "--train-iters", "0", "--save", str(tmp_path / "tp2"), "--tensor-model-parallel-size",
           "2", nproc=2)
    init = torch.randn((2 * 64, 32), generator=param_generator(1234, FC1.removeprefix("model."))) * 0.02
    for layout in ("tp1", "tp2"):
        got = read_dcp_tensors(tmp_path / layout / "iter_0000000", "model.")[FC1]
        assert torch.equal(got, init), layout  # rows 0..63 = gate, 64..127 = up, whatever the TP size
    out = tmp_path / "converted.pt"
    dcp_to_torch_save(str(tmp_path / "tp2" / "iter_0000000"), str(out))
    converted = torch.load(out, weights_only=False)
    assert torch.equal(converted[FC1], init)


def test_legacy_roundtrip_and_conversion(tmp_path: Path) -> None:
    tp2 = ["--tensor-model-parallel-size", "2"]
    _train(tmp_path, "straight", "--train-iters", "8", *tp2, nproc=2)
    _train(tmp_path, "first", "--train-iters", "8", "--exit-interval", "4", "--ckpt-format", "torch",
           "--save", str(tmp_path / "legacy"), *tp2, nproc=2)
    files = sorted(p.relative_to(tmp_path / "legacy").as_posix() for p in (tmp_path / "legacy").rglob("*.pt"))
    assert files == ["iter_0000004/mp_rank_00/model_optim_rng.pt", "iter_0000004/mp_rank_01/model_optim_rng.pt"]
    _train(tmp_path, "resumed", "--train-iters", "8", "--load", str(tmp_path / "legacy"), *tp2, nproc=2)
    straight = train_records(tmp_path / "straight.jsonl")
    assert [r["loss"] for r in train_records(tmp_path / "resumed.jsonl")] == [r["loss"] for r in straight[4:]]
    # torch -> torch_dist (at the saving layout), then resume the converted one at TP=1
    _train(tmp_path, "conv", "--train-iters", "8", "--load", str(tmp_path / "legacy"), "--ckpt-convert-format",
           "torch_dist", "--ckpt-convert-save", str(tmp_path / "dist"), *tp2, nproc=2)
    assert not (tmp_path / "conv.jsonl").exists(), "conversion must not train"
    _train(tmp_path, "from-dist", "--train-iters", "8", "--load", str(tmp_path / "dist"))
    got = [r["loss"] for r in train_records(tmp_path / "from-dist.jsonl")]
    assert got == pytest.approx([r["loss"] for r in straight[4:]], rel=1e-5)
    # torch_dist -> torch at TP=1, resumed at TP=1
    _train(tmp_path, "conv2", "--train-iters", "8", "--load", str(tmp_path / "dist"), "--ckpt-convert-format",
           "torch", "--ckpt-convert-save", str(tmp_path / "legacy1"))
    assert (tmp_path / "legacy1" / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    _train(tmp_path, "from-legacy1", "--train-iters", "8", "--load", str(tmp_path / "legacy1"))
    assert [r["loss"] for r in train_records(tmp_path / "from-legacy1.jsonl")] == got


def _fails(tmp: Path, name: str, *args: str, nproc: int = 0) -> str:
    proc = _train(tmp, name, *args, nproc=nproc, check=False)
    assert proc.returncode != 0, proc.stdout
    return proc.stderr


def _no_checkpoint(save: Path) -> None:
    assert not save.exists() or not any(save.iterdir()), list(save.rglob("*"))


def test_bad_input_is_refused_with_nothing_written(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _train(tmp_path, "base", "--train-iters", "2", "--save", str(ckpt))
    out = tmp_path / "out"
    # wrong architecture: one message listing every differing arg
    err = _fails(tmp_path, "arch", "--train-iters", "4", "--load", str(ckpt), "--save", str(out),
                 "--hidden-size", "64", "--num-attention-heads", "8")
    assert "different architecture" in err and "hidden_size: checkpoint 32, model 64" in err
    assert "num_attention_heads: checkpoint 4, model 8" in err
    _no_checkpoint(out)
    # legacy format at another TP
    _train(tmp_path, "legacy", "--train-iters", "2", "--ckpt-format", "torch", "--save", str(tmp_path / "legacy"))
    err = _fails(tmp_path, "legacy-tp2", "--train-iters", "4", "--load", str(tmp_path / "legacy"), "--save", str(out),
                 "--tensor-model-parallel-size", "2", nproc=2)
    assert "loads only at that layout" in err and "--ckpt-convert-format torch_dist" in err
    _no_checkpoint(out)
    # --exit-on-missing-checkpoint with an empty --load
    (tmp_path / "empty").mkdir()
    err = _fails(tmp_path, "missing", "--train-iters", "4", "--load", str(tmp_path / "empty"),
                 "--exit-on-missing-checkpoint", "--save", str(out))
    assert "--exit-on-missing-checkpoint" in err and str(tmp_path / "empty") in err
    _no_checkpoint(out)
    # a manifest with a newer format version
    newer = tmp_path / "newer"
    shutil.copytree(ckpt, newer)
    manifest = newer / "iter_0000002" / "metadata.json"
    data = json.loads(manifest.read_text())
    data["format_version"] = 99
    manifest.write_text(json.dumps(data))
    err = _fails(tmp_path, "newer", "--train-iters", "4", "--load", str(newer), "--save", str(out))
    assert "format version 99" in err and "upgrade peftckpt" in err
    _no_checkpoint(out)
    # --load at a directory that is not a checkpoint
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    err = _fails(tmp_path, "junk", "--train-iters", "4", "--load", str(junk), "--save", str(out))
    assert str(junk) in err and "checkpoint" in err
    _no_checkpoint(out)


def test_iteration0_and_partial_adapters(tmp_path: Path) -> None:
    """An adapter checkpoint saved before the first step (LoRA on fused SwiGLU fc1 included) resumes exactly;
    adapters on some layers only, plus a trainable non-LoRA parameter."""
    extra = [*LORA, "--lora-layers", "1", "3", "--lora-train-params", "decoder.final_layernorm.weight",
             "--train-iters", "4"]
    _train(tmp_path, "straight", *extra)
    _train(tmp_path, "zero", *extra, "--train-iters", "0", "--save", str(tmp_path / "z"))
    manifest = json.loads((tmp_path / "z" / "iter_0000000" / "metadata.json").read_text())
    saved = set(manifest["saved_keys"])
    assert "model.decoder.final_layernorm.weight" in saved
    assert "model.decoder.layers.1.mlp.linear_fc1.lora_B" in saved
    assert not any(".layers.0." in k or ".layers.2." in k for k in saved)
    assert len(saved) == 2 * 4 * 2 + 1
    assert "model.decoder.layers.0.mlp.linear_fc1.weight" in manifest["excluded_keys"]
    _train(tmp_path, "resumed", *extra, "--load", str(tmp_path / "z"), "--save", str(tmp_path / "z"))
    assert train_records(tmp_path / "resumed.jsonl") == [
        {**r, "tokens_per_s": got["tokens_per_s"]}
        for r, got in zip(train_records(tmp_path / "straight.jsonl"), train_records(tmp_path / "resumed.jsonl"))
    ]


def test_trainable_only_errors(tmp_path: Path) -> None:
    base = tmp_path / "base"
    _train(tmp_path, "pre", "--train-iters", "2", "--seed", "3", "--save", str(base))
    other = tmp_path / "other"
    _train(tmp_path, "pre2", "--train-iters", "2", "--seed", "4", "--save", str(other))
    adapter = tmp_path / "adapter"
    _train(tmp_path, "ft", *LORA, "--train-iters", "2", "--pretrained-checkpoint", str(base), "--save", str(adapter))
    out = tmp_path / "out"
    # the flag with the legacy format: refused at parse time
    proc = _train(tmp_path, "legacy", *LORA, "--train-iters", "2", "--ckpt-format", "torch", "--save", str(out),
                  check=False)
    assert proc.returncode == 2 and "--save-trainable-params-only needs --ckpt-format torch_dist" in proc.stderr
    _no_checkpoint(out)
    # ... and where the filter runs, when the effective format changes later
    err = _fails(tmp_path, "convert", *LORA, "--train-iters", "2", "--pretrained-checkpoint", str(base), "--load",
                 str(adapter), "--ckpt-convert-format", "torch", "--ckpt-convert-save", str(out))
    assert "--save-trainable-params-only needs --ckpt-format torch_dist" in err and "nothing was written" in err
    _no_checkpoint(out)
    # an adapter onto a different base: both fingerprints named; --no-verify-base overrides
    err = _fails(tmp_path, "wrong-base", *LORA, "--train-iters", "4", "--pretrained-checkpoint", str(other),
                 "--load", str(adapter), "--save", str(out))
    fingerprints = json.loads((adapter / "iter_0000002" / "metadata.json").read_text())["base_fingerprint"]
    assert "different base model" in err and fingerprints in err and "--no-verify-base" in err
    _no_checkpoint(out)
    _train(tmp_path, "override", *LORA, "--train-iters", "3", "--pretrained-checkpoint", str(other), "--load",
           str(adapter), "--no-verify-base")
    # a checkpoint with an adapter key removed from its files (re-written consistently, manifest re-checksummed)
    broken = tmp_path / "broken"
    shutil.copytree(adapter, broken)
    ckpt = broken / "iter_0000002"
    key = "model.decoder.layers.2.self_attention.linear_proj.lora_A"
    dcp_to_torch_save(str(ckpt), str(tmp_path / "all.pt"))
    everything = torch.load(tmp_path / "all.pt", weights_only=False)
    assert key in everything and "iteration" in everything
    del everything[key]
    for f in ckpt.glob("__*"):
        f.unlink()
    (ckpt / ".metadata").unlink()
    dcp.save(everything, storage_writer=FileSystemWriter(str(ckpt)), no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    manifest = json.loads((ckpt / "metadata.json").read_text())
    manifest.pop("manifest_sha256")  # edited by hand: drop the self-checksum instead of forging it
    manifest["files"] = checksum_files([p for p in ckpt.iterdir() if p.name != "metadata.json"], ckpt)
    (ckpt / "metadata.json").write_text(json.dumps(manifest))
    err = _fails(tmp_path, "broken", *LORA, "--train-iters", "4", "--pretrained-checkpoint", str(base), "--load",
                 str(broken), "--save", str(out))
    # the whole-checkpoint check finds it before any strictness mode is consulted (issue 13)
    assert key in err and "listed in the manifest is absent from DCP metadata" in err
    _no_checkpoint(out)
