"""``--bf16`` through the real CLI: a bf16 frozen base under fp32 adapters trains at TP=2 x PP=2, saves
adapter-only checkpoints and resumes bit-exactly; unsupported precision flags are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from peftckpt.train.args import ArgumentError, parse_train_args

from .cli import TINY, peftckpt, read_dcp_tensors, train_records

LORA_BF16 = ["--lora-rank", "8", "--bf16", "--seed", "5", "--train-iters", "6", "--save-trainable-params-only",
             "--lora-train-params", "decoder.final_layernorm.weight"]
TP2PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.mark.slow
def test_bf16_trains_saves_adapters_only_and_resumes_bit_exactly(tmp_path: Path) -> None:
    base_dir = tmp_path / "base"
    peftckpt(["train", *TINY, "--train-iters", "2", "--seed", "11", "--save", str(base_dir)])
    base = base_dir / "iter_0000002"
    common = ["train", *TINY, *TP2PP2, *LORA_BF16, "--pretrained-checkpoint", str(base)]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    peftckpt([*common, "--save", str(first), "--save-interval", "3", "--metrics-file", str(tmp_path / "a.jsonl")], 4)
    peftckpt([*common, "--load", str(first / "iter_0000003"), "--save", str(resumed),
              "--metrics-file", str(tmp_path / "b.jsonl")], 4)
    a, b = train_records(tmp_path / "a.jsonl"), train_records(tmp_path / "b.jsonl")
    assert [r["iteration"] for r in a] == [1, 2, 3, 4, 5, 6] and [r["iteration"] for r in b] == [4, 5, 6]
    assert a[-1]["loss"] < a[0]["loss"], "it does not train"
    assert [(r["loss"], r["lr"]) for r in b] == [(r["loss"], r["lr"]) for r in a[3:]]
    # on disk: only the fp32 trainable tensors and their fp32 Adam moments; the bf16 base is left out
    manifest = json.loads((first / "iter_0000003" / "metadata.json").read_text())
    assert manifest["trainable_only"] is True
    assert {r["dtype"] for r in manifest["saved_keys"].values()} == {"float32"}
    assert {r["dtype"] for r in manifest["excluded_keys"].values()} == {"bfloat16"}
    assert "model.decoder.final_layernorm.weight" in manifest["saved_keys"]
    assert len(manifest["saved_keys"]) == 4 * 4 * 2 + 1
    x = read_dcp_tensors(first / "iter_0000006")
    y = read_dcp_tensors(resumed / "iter_0000006")
    assert set(x) == set(y) and sum(k.endswith("exp_avg_sq") for k in x) == len(manifest["saved_keys"])
    assert {v.dtype for v in x.values()} == {torch.float32}
    assert [k for k in x if not torch.equal(x[k], y[k])] == [], "adapters or Adam moments differ after resume"
    # the base the adapter was trained on: the fp32 base rounded to bf16, the same in both runs
    assert json.loads((resumed / "iter_0000006" / "metadata.json").read_text())["base_fingerprint"] == \
        json.loads((first / "iter_0000006" / "metadata.json").read_text())["base_fingerprint"]


@pytest.mark.parametrize("extra,flag", [
    (["--fp16"], "--fp16"),
    (["--fp16", "--lora-rank", "4"], "--fp16"),
    (["--bf16"], "--lora-rank 0"),
])
def test_unsupported_precision_is_refused_naming_the_flag(extra: list[str], flag: str) -> None:
    with pytest.raises(ArgumentError, match=flag):
        parse_train_args([*TINY, *extra], 1)

