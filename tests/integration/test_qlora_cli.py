"""QLoRA (``--base-quantization nf4``) through the CLI, as a user runs it: LoRA on a base whose linear weights are
held in NF4, quantized identically at every layout. The quantized base is the same at TP=1 and TP=2 x PP=2 (its
fingerprint, which covers the quantized storage, is the same), so are the losses (rel 1e-5), with the distributed
optimizer too; a stopped run
resumes bit-exact; an adapter trained at TP=2 x PP=2 resumes at TP=1 with the same numbers; an adapter checkpoint
is as small as without quantization; and resuming on a base held otherwise is one message naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from peftckpt.checkpoint.storage.manifest import read_manifest

from .cli import dir_bytes, peftckpt, train_records

pytestmark = pytest.mark.slow

MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "256", "--vocab-size", "128", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--mock-data", "--lr", "1e-2", "--lr-warmup-iters", "1", "--log-interval",
         "100", "--device", "cpu"]
"""Widths NF4 can split over 2 TP ranks (every shard's columns in whole blocks of 64)."""
LORA = [*MODEL, "--lora-rank", "8", "--train-iters", "4", "--save-trainable-params-only", "--save-interval", "2"]


def _losses(path: Path) -> dict[int, float]:
    return {r["iteration"]: r["loss"] for r in train_records(path)}


def _close(a: dict[int, float], b: dict[int, float]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-5 * abs(a[k]), (k, a[k], b[k])


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A full-precision base, pretrained for 2 iterations (its weights are no longer the initial ones)."""
    root = tmp_path_factory.mktemp("qlora-base")
    peftckpt(["train", *MODEL, "--train-iters", "2", "--save", str(root / "base")])
    return root / "base"


def test_qlora_is_layout_independent_resumes_exactly_and_reshards(base: Path, tmp_path: Path) -> None:
    common = [*LORA, "--pretrained-checkpoint", str(base), "--base-quantization", "nf4"]
    # 1. one process, uninterrupted
    one = tmp_path / "one"
    peftckpt(["train", *common, "--save", str(one), "--metrics-file", str(tmp_path / "one.jsonl")])
    straight = _losses(tmp_path / "one.jsonl")
    # 2. one process, from its own iteration-2 checkpoint: bit-exact
    peftckpt(["train", *common, "--load", str(one / "iter_0000002"), "--save", str(tmp_path / "again"),
              "--metrics-file", str(tmp_path / "again.jsonl")])
    assert _losses(tmp_path / "again.jsonl") == {3: straight[3], 4: straight[4]}
    # 2b. two data-parallel ranks with the distributed optimizer (FSDP2 shards adapters and Adam; the NF4 base is
    # held per rank), from the same checkpoint: the same numbers, the same quantized base
    sharded = tmp_path / "sharded"
    peftckpt(["train", *common, "--use-distributed-optimizer", "--load", str(one / "iter_0000002"), "--save",
              str(sharded), "--metrics-file", str(tmp_path / "sharded.jsonl")], nproc=2)
    _close(_losses(tmp_path / "sharded.jsonl"), {3: straight[3], 4: straight[4]})
    assert read_manifest(sharded / "iter_0000004").base_fingerprint == \
        read_manifest(one / "iter_0000004").base_fingerprint
    # 3. TP=2 x PP=2, stopped after iteration 2: the same quantized base, the same losses
    wide = tmp_path / "wide"
    peftckpt(["train", *common, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
              "--exit-interval", "2", "--save", str(wide), "--metrics-file", str(tmp_path / "wide.jsonl")], nproc=4)
    _close(_losses(tmp_path / "wide.jsonl"), {1: straight[1], 2: straight[2]})
    at_one, at_wide = read_manifest(one / "iter_0000002"), read_manifest(wide / "iter_0000002")
    assert at_wide.base_fingerprint == at_one.base_fingerprint  # the quantized storage, bit for bit
    assert at_one.model_config["base_quantization"]["method"] == "nf4"
    assert any(k.endswith("linear_fc2.weight_nf4") for k in at_one.excluded_keys)
    # 4. the TP=2 x PP=2 adapter resumed in one process: the numbers of the one-process run
    peftckpt(["train", *common, "--load", str(wide), "--save", str(tmp_path / "narrow"),
              "--metrics-file", str(tmp_path / "narrow.jsonl")])
    _close(_losses(tmp_path / "narrow.jsonl"), {3: straight[3], 4: straight[4]})
    # 5. as small as an adapter checkpoint of the same run without quantization
    plain = tmp_path / "plain"
    peftckpt(["train", *LORA, "--pretrained-checkpoint", str(base), "--train-iters", "2", "--save", str(plain)])
    data = {d: sum(f.stat().st_size for f in (d / "iter_0000002").glob("*.distcp")) for d in (one, plain)}
    assert data[one] == data[plain], data  # adapters and Adam: the same tensors
    assert dir_bytes(one / "iter_0000002") < 1.1 * dir_bytes(plain / "iter_0000002")


def test_a_base_held_otherwise_is_refused_once_naming_the_flag(base: Path, tmp_path: Path) -> None:
    save = tmp_path / "save"
    peftckpt(["train", *LORA, "--pretrained-checkpoint", str(base), "--base-quantization", "nf4", "--train-iters",
              "2", "--save", str(save)])
    before = sorted(p.name for p in save.iterdir())
    for nproc, extra in ((2, ["--tensor-model-parallel-size", "2"]), (0, [])):
        done = peftckpt(["train", *LORA, *extra, "--pretrained-checkpoint", str(base), "--load", str(save),
                         "--save", str(save)], nproc=nproc, check=False, launcher="peftckpt")
        assert done.returncode == 1, done.stderr
        said = [line for line in done.stderr.splitlines() if "error:" in line]
        assert len(said) == 1 and "held in nf4" in said[0] and "in full precision (not quantized)" in said[0]
        assert said[0].endswith("pass the --base-quantization it was trained with"), said
        assert "Traceback" not in done.stderr
    assert sorted(p.name for p in save.iterdir()) == before  # nothing written
    # a geometry NF4 cannot split is refused before anything runs, naming the flags
    done = peftckpt(["train", *LORA, "--hidden-size", "96", "--base-quantization", "nf4", "--save",
                     str(tmp_path / "x")], check=False)
    assert done.returncode == 2 and "--base-quantization nf4: the linear_qkv/linear_fc1 input (--hidden-size" \
        in done.stderr, done.stderr
