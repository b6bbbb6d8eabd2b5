"""Fixtures of the interop tests: one tiny HF Llama, its imported base, and one LoRA run at TP=2 x PP=2."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the [hf] extra (transformers, peft) is needed for interop tests")
pytest.importorskip("peft")

from tests.integration.cli import peftckpt  # noqa: E402
from tests.interop.common import make_llama, write_data  # noqa: E402


@pytest.fixture(scope="session")
def interop_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("interop")


@pytest.fixture(scope="session")
def hf_dir(interop_root: Path) -> Path:
    path = interop_root / "hf"
    make_llama(path)
    return path


@pytest.fixture(scope="session")
def base(interop_root: Path, hf_dir: Path) -> Path:
    """``peftckpt import-hf`` of the tiny Llama (through the CLI, as a user runs it)."""
    out = interop_root / "base"
    proc = peftckpt(["import-hf", str(hf_dir), str(out)])
    assert f"-> {out}/iter_0000000" in proc.stdout
    return out


@pytest.fixture(scope="session")
def data(interop_root: Path) -> Path:
    return write_data(interop_root / "data.jsonl", num_samples=48)


@pytest.fixture(scope="session")
def lora_run(interop_root: Path, base: Path, data: Path) -> Path:
    """LoRA (whole fused layers, every target) trained at TP=2 x PP=2 with adapter-only checkpoints.
    No architecture flag: it comes from the imported base's manifest."""
    save = interop_root / "lora"
    peftckpt(["train", "--pretrained-checkpoint", str(base), "--data-path", str(data), "--seq-length", "16",
              "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--lora-rank", "4",
              "--lora-alpha", "8", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
              "--lr", "5e-3", "--save", str(save), "--save-interval", "2", "--save-trainable-params-only",
              "--log-interval", "100"], nproc=4)
    return save
