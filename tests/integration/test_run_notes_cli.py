"""What a run says about itself (issue 25): the start-up summary (world, layout, model, parameters total /
trainable / frozen), values inherited from a base that say where they came from -- with the defaults that
depend on them following them -- and the note when ``--exit-interval`` ends a run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from peftckpt.checkpoint.location.directory import read_tracker
from peftckpt.train.args import parse_train_args
from peftckpt.train.trainer import Trainer

from .cli import peftckpt

pytestmark = pytest.mark.slow

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "128",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size",
        "4", "--mock-data", "--device", "cpu", "--log-interval", "100"]
SMALL_RUN = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu"]


def _counts(text: str) -> tuple[int, int, int]:
    m = re.search(r"parameters: ([\d,]+) total, ([\d,]+) trainable \([\d.]+ %\), ([\d,]+) frozen", text)
    assert m, text
    total, trainable, frozen = (int(g.replace(",", "")) for g in m.groups())
    return total, trainable, frozen


def _summary(*flags: str) -> tuple[Trainer, tuple[int, int, int]]:
    trainer = Trainer(parse_train_args([*BASE, *flags], 1))
    return trainer, _counts(trainer.summary())


def test_summary_counts_the_whole_model() -> None:
    trainer, (total, trainable, frozen) = _summary("--lora-rank", "4", "--lora-train-params", "decoder.final_layernorm.weight")
    params = [p for c in trainer.chunks for p in c.parameters()]
    assert total == sum(p.numel() for p in params) == trainable + frozen
    assert trainable == sum(p.numel() for p in params if p.requires_grad)
    # frozen = the base without its one unfrozen norm; the adapters' share grows with the rank
    _, (base_total, base_trainable, _) = _summary()
    assert base_total == base_trainable and frozen == base_total - 32
    _, (_, trainable_8, _) = _summary("--lora-rank", "8", "--lora-train-params", "decoder.final_layernorm.weight")
    assert trainable_8 - 32 == 2 * (trainable - 32) > 0
    assert "world 1: TP 1 x PP 1 x DP 1 on cpu" in trainer.summary()
    assert "LoRA rank 4 alpha 8 on linear_qkv linear_proj linear_fc1 linear_fc2" in trainer.summary()


def test_inherited_values_say_where_they_came_from(tmp_path: Path) -> None:
    base, lora = tmp_path / "base", tmp_path / "lora"
    peftckpt(["train", *BASE, "--train-iters", "1", "--save", str(base)])

    # 1. no architecture flags: taken from the base, each value said; --seq-length follows the base's 16
    run = peftckpt(["train", *SMALL_RUN, "--pretrained-checkpoint", str(base), "--lora-rank", "2",
                    "--train-iters", "4", "--exit-interval", "2", "--save", str(lora)])
    out = run.stdout
    assert (f"architecture flags from --pretrained-checkpoint {base}: --num-layers 2, --hidden-size 32, "
            "--num-attention-heads 4") in out
    assert "--max-position-embeddings 16" in out and "--swiglu" in out and "--swiglu True" not in out
    assert (f"--seq-length 16: the longest sequence the base supports (its max_position_embeddings, from "
            f"--pretrained-checkpoint {base})") in out
    assert out.count("world 1: TP 1 x PP 1 x DP 1 on cpu; model: 2 layers, hidden 32, 4 heads, vocab 128, "
                     "seq 16; LoRA rank 2") == 1
    total, trainable, frozen = _counts(out)
    assert frozen == _counts(peftckpt(["train", *BASE, "--train-iters", "0"]).stdout)[0]  # the base, all of it
    # 2. --exit-interval ended the run: said, with where to resume
    assert read_tracker(lora) == 2
    assert (f"--exit-interval 2: stopped at iteration 2 of 4; last committed checkpoint: {lora}/iter_0000002; "
            "rerun the same command to resume") in out

    # 3. an error about an inherited value names its source
    long = peftckpt(["train", *SMALL_RUN, "--pretrained-checkpoint", str(base), "--lora-rank", "2",
                     "--train-iters", "1", "--seq-length", "64"], check=False)
    assert long.returncode == 2
    assert long.stderr.strip() == (
        f"peftckpt train: error: --seq-length (64) exceeds --max-position-embeddings (16) "
        f"(--max-position-embeddings 16 came from --pretrained-checkpoint {base}; pass the flag to override)")

    # 4. eval of that base needs no flags beyond the data: it evaluates at the base's 16 positions
    ev = peftckpt(["eval", "--pretrained-checkpoint", str(base), "--mock-data", "--device", "cpu", "--json"])
    assert '"seq_length": 16' in ev.stdout
