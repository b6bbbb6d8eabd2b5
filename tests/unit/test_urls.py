"""A checkpoint path given as a URL (``s3://...``) is refused before anything is read or written. Object storage
is not supported yet, and without the refusal ``--save s3://bucket/run`` wrote a local directory ``s3:/bucket/run``
-- a checkpoint the user believed was in the bucket."""

from __future__ import annotations

from pathlib import Path

import pytest

from peftckpt.cli import main

REFUSAL = "is a URL: checkpoints on object storage are not supported yet; give a local or mounted file system path"
CASES = [
    ["train", "--mock-data", "--save", "s3://bucket/run"],
    ["train", "--mock-data", "--load", "s3://bucket/run"],
    ["train", "--mock-data", "--lora-rank", "4", "--pretrained-checkpoint", "gs://bucket/base"],
    ["train", "--mock-data", "--load", "run", "--ckpt-convert-format", "torch", "--ckpt-convert-save", "s3://b/c"],
    ["eval", "--mock-data", "--load", "s3://bucket/run"],
    ["inspect", "s3://bucket/run"],
    ["verify", "file:///tmp/run"],
    ["export-hf", "s3://bucket/run", "out"],
    ["export-peft", "run", "s3://bucket/out"],
    ["import-hf", "hf", "s3://bucket/out"],
    ["import-peft", "peft", "out", "--base", "s3://bucket/base"],
]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(a[:1] + a[-2:]) for a in CASES])
def test_a_url_is_one_usage_error_and_nothing_is_written(argv: list[str], tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage error (the one-process tools)
        code = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error:") == 1 and REFUSAL in err, err
    assert list(tmp_path.iterdir()) == []  # no directory "s3:" (or anything else) appeared


def test_the_library_refuses_a_url_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from peftckpt import Checkpointer, CheckpointError

    monkeypatch.chdir(tmp_path)
    ckpt = Checkpointer(torch.nn.Linear(2, 2))
    for call in (lambda: ckpt.save("s3://bucket/run", 1), lambda: ckpt.async_save("s3://bucket/run", 1),
                 lambda: ckpt.lock("s3://bucket/run"),
                 lambda: ckpt.load("s3://bucket/run"), lambda: ckpt.load_pretrained("s3://bucket/base")):
        with pytest.raises(CheckpointError, match=REFUSAL):
            call()
    assert list(tmp_path.iterdir()) == []
