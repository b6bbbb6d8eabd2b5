"""The request budget of a job on an object store (issue 27): the LIST requests of a load and a save do not grow
with the world size (at 512 ranks, every rank listing a bucket made S3 answer SlowDown), and what each further
rank adds -- HEAD and GET of the manifest and tracker it reads, PUT of its own data file -- is a few requests.
Counted by the server (moto's request recorder), for one LoRA run that loads a checkpoint from the store, trains
one iteration and saves to the store, at world sizes 1, 2 and 4 (data parallel)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tests.s3_server import s3_server

from .cli import peftckpt

pytestmark = pytest.mark.slow

RUN = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
       "--vocab-size", "128", "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
       "--mock-data", "--lora-rank", "4", "--device", "cpu", "--log-interval", "100", "--save-trainable-params-only"]


def test_list_requests_do_not_grow_with_the_world_size(tmp_path: Path) -> None:
    counts: dict[int, Counter[str]] = {}
    with s3_server(tmp_path / "cache", recording=tmp_path / "requests.jsonl") as s3:
        peftckpt(["train", *RUN, "--train-iters", "1", "--save", s3.url("first")], extra_env=s3.env)
        for world in (1, 2, 4):
            s3.record()
            peftckpt(["train", *RUN, "--train-iters", "2", "--load", s3.url("first"), "--save", s3.url(f"ws{world}")],
                     nproc=world if world > 1 else 0, extra_env=s3.env)
            counts[world] = s3.requests()
            assert s3.keys(f"ws{world}")  # it did save there
    print({w: dict(c) for w, c in counts.items()})
    assert counts[1]["LIST"] == counts[2]["LIST"] == counts[4]["LIST"] > 0, counts
    for kind in ("HEAD", "GET"):  # the manifest and tracker each rank reads before the job starts, and its own files
        assert counts[4][kind] - counts[1][kind] <= 3 * 12, (kind, counts)
    assert counts[4]["PUT"] - counts[1]["PUT"] <= 3 * 2, counts  # each rank's data file (lease renewals aside)
