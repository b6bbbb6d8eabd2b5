"""A checkpoint path given as a URL peftckpt cannot use -- a scheme it does not store on, no bucket, or a URL where
the path must be local (an export's output) -- is one usage error before anything is read or written. (Before
object storage was supported, ``--save s3://bucket/run`` wrote a local directory ``s3:/bucket/run``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from peftckpt.cli import main

SCHEME = "has scheme hdfs://, which peftckpt does not store checkpoints on"
NO_BUCKET = "names no bucket (expected s3://BUCKET/PREFIX)"
LOCAL = "is a URL, but this path must be a local (or mounted) file system path"
UNTESTED = "which peftckpt does not support yet: its commit protocol has run only against S3"
CASES = [
    (["train", "--mock-data", "--save", "hdfs://nn/run"], SCHEME),
    (["train", "--mock-data", "--load", "s3:///run"], NO_BUCKET),
    (["train", "--mock-data", "--lora-rank", "4", "--pretrained-checkpoint", "hdfs://nn/base"], SCHEME),
    (["train", "--mock-data", "--load", "run", "--ckpt-convert-format", "torch", "--ckpt-convert-save", "hdfs://n/c"],
     SCHEME),
    (["eval", "--mock-data", "--load", "hdfs://nn/run"], SCHEME),
    (["inspect", "hdfs://nn/run"], SCHEME),
    (["verify", "s3:///run"], NO_BUCKET),
    (["export-hf", "hdfs://nn/run", "out"], SCHEME),
    (["export-peft", "run", "s3://bucket/out"], LOCAL),
    (["import-hf", "hf", "hdfs://nn/out"], SCHEME),
    (["import-hf", "s3://bucket/hf", "out"], LOCAL),
    (["import-peft", "peft", "out", "--base", "hdfs://nn/base"], SCHEME),
    # stores the protocol has never run against: refused, whatever is installed
    (["train", "--mock-data", "--save", "gs://bucket/run"], f"is on Google Cloud Storage (gs://), {UNTESTED}"),
    (["inspect", "az://container/run"], f"is on Azure Blob Storage (az://), {UNTESTED}"),
    (["export-hf", "abfs://container/run", "out"], UNTESTED),
]


@pytest.mark.parametrize("argv,said", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_a_bad_url_is_one_usage_error_and_nothing_is_written(argv: list[str], said: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage error (the one-process tools)
        code = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("error:") == 1 and said in err, err
    assert list(tmp_path.iterdir()) == []  # no directory "s3:" (or anything else) appeared


def test_the_library_refuses_a_bad_url_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from peftckpt import Checkpointer, CheckpointError

    monkeypatch.chdir(tmp_path)
    ckpt = Checkpointer(torch.nn.Linear(2, 2))
    for call in (lambda: ckpt.save("hdfs://nn/run", 1), lambda: ckpt.async_save("hdfs://nn/run", 1),
                 lambda: ckpt.lock("hdfs://nn/run"),
                 lambda: ckpt.load("hdfs://nn/run"), lambda: ckpt.load_pretrained("hdfs://nn/base")):
        with pytest.raises(CheckpointError, match=SCHEME):
            call()
    assert list(tmp_path.iterdir()) == []
