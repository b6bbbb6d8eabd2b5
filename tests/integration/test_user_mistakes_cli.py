"""One message per mistake (issue 16): each class of user error -- a flag, a file, a checkpoint made for another
adapter or architecture, the data -- is said once, naming the flag, with exit 2 (usage) or 1 (the rest) and no
traceback, alone and under torchrun (where torchrun adds its own ChildFailedError report and exits 1, naming the
worker's exit code). ``PEFTCKPT_DEBUG=1`` shows the traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .cli import TINY, no_worker_traceback, peftckpt

pytestmark = pytest.mark.slow
LORA = ["--lora-rank", "4", "--save-trainable-params-only"]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("mistakes") / "adapter"
    peftckpt(["train", *TINY, *LORA, "--train-iters", "1", "--save", str(save)])
    peftckpt(["train", *TINY, "--train-iters", "1", "--save", str(save.parent / "base")])  # no LoRA: a base
    return save


# (case, extra flags given the adapter's directory, text the one message holds ({dir}: the adapter's
# parent), exit code of the worker)
CASES = [
    ("flag", lambda a: ["--mock-data", "--exit-signal-handler"],
     "--exit-signal-handler needs --save", 2),
    ("typo", lambda a: ["--mock-data", "--lora-rnak", "4"],
     "peftckpt train: error: unrecognized arguments: --lora-rnak (did you mean --lora-rank?) 4\n"
     "(`peftckpt train --help` lists every option)", 2),
    ("file", lambda a: ["--mock-data", "--pretrained-checkpoint", str(a.parent / "no-such-base")],
     "--pretrained-checkpoint {dir}/no-such-base does not exist", 2),
    ("data", lambda a: ["--data-path", str(a.parent / "no-such.jsonl")],
     "{dir}/no-such.jsonl", 2),
    ("adapter", lambda a: ["--mock-data", "--lora-rank", "8", "--lora-alpha", "8", "--load", str(a)],
     "was saved with a different adapter configuration:\n  rank (--lora-rank): checkpoint 4, model 8\nfix those", 1),
    ("base as --load", lambda a: ["--mock-data", "--lora-rank", "4", "--load", str(a.parent / "base")],
     "--load {dir}/base is a checkpoint without adapters (a base, or a run without LoRA; iteration 1): a LoRA run "
     "resumed from it would restart at its iteration", 1),
    ("architecture", lambda a: ["--mock-data", "--lora-rank", "4", "--hidden-size", "64", "--load", str(a)],
     "was saved for a different architecture:\n  hidden_size: checkpoint 32, model 64\n", 1),
] + ([] if torch.cuda.is_available() else [  # the later --device wins over TINY's
    ("device", lambda a: ["--mock-data", "--device", "cuda"],
     "--device cuda: this process sees no CUDA device (torch.cuda.is_available() is False", 2),
])


@pytest.mark.parametrize("nproc", [0, 2])
def test_each_mistake_is_said_once_with_its_exit_code(adapter: Path, nproc: int) -> None:
    for case, extra, said, code in CASES:
        flags = [f for f in TINY if f != "--mock-data"]
        proc = peftckpt(["train", *flags, "--train-iters", "2", *extra(adapter)], nproc, check=False)
        err, said = proc.stderr, said.format(dir=adapter.parent)
        assert err.count("peftckpt train: error:") == 1, (case, err[-3000:])
        assert said in err, (case, err[-3000:])
        assert proc.returncode == (1 if nproc else code), (case, proc.returncode)
        if nproc:  # torchrun's report names the worker's own code
            assert f"(exitcode: {code})" in err, (case, err[-3000:])
        no_worker_traceback(err, nproc)
        assert not list(adapter.parent.glob("no-such*")), case


def test_debug_env_adds_the_traceback(adapter: Path) -> None:
    flags = [*TINY, "--lora-rank", "8", "--lora-alpha", "8", "--load", str(adapter), "--train-iters", "2"]
    proc = peftckpt(["train", *flags], check=False, extra_env={"PEFTCKPT_DEBUG": "1"})
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "peftckpt/checkpoint/" in proc.stderr
    assert proc.stderr.count("peftckpt train: error: checkpoint") == 1
