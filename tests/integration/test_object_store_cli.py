"""Checkpoints on S3 through the real CLI, against a real S3-compatible server (moto's, on 127.0.0.1).

A TP=2 LoRA run saves adapter-only checkpoints to ``s3://`` and a second launch resumes from one bit-exactly
(async saves); a kill at each commit step leaves the tracker on the previous checkpoint and the rerun resumes;
a flipped byte is named by its object URL (``verify``, ``inspect``, a load); ``export-peft`` reads from S3; a
missing bucket, missing credentials and bad URLs get one message.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ..s3_server import BUCKET, S3Server, s3_server
from .cli import TINY, assert_runs_alike, peftckpt, read_dcp_tensors, train_records

pytestmark = pytest.mark.slow

LORA = ["--lora-rank", "4", "--seed", "5", "--train-iters", "6", "--save-trainable-params-only"]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("cache")) as server:
        yield server


@pytest.fixture(scope="module")
def tp2_runs(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A TP=2 LoRA run saving adapter-only checkpoints to S3 at iterations 3 and 6 (its --load, the same empty
    location, starts from scratch), and a second launch that
    resumes from S3's iteration 3 with async saves (metrics in a.jsonl / b.jsonl)."""
    tmp = tmp_path_factory.mktemp("tp2")
    common = ["train", *TINY, "--tensor-model-parallel-size", "2", *LORA]
    first = peftckpt([*common, "--save", s3.url("first"), "--load", s3.url("first"), "--save-interval", "3",
                      "--metrics-file", str(tmp / "a.jsonl")], 2, extra_env=s3.env)
    # A --load location with nothing committed yet starts from scratch on every rank (said once).
    assert (first.stdout + first.stderr).count(f"--load {s3.url('first')} holds no committed checkpoint; "
                                               "starting from scratch") == 1
    peftckpt([*common, "--load", s3.url("first/iter_0000003"), "--save", s3.url("resumed"), "--async-save",
              "--save-interval", "2", "--metrics-file", str(tmp / "b.jsonl")], 2, extra_env=s3.env)
    return tmp


def test_tp2_adapter_only_to_s3_resumes_bit_exactly(s3: S3Server, tp2_runs: Path, tmp_path: Path) -> None:
    a, b = train_records(tp2_runs / "a.jsonl"), train_records(tp2_runs / "b.jsonl")
    assert [r["iteration"] for r in b] == [4, 5, 6]
    assert [(r["loss"], r["lr"]) for r in b] == [(r["loss"], r["lr"]) for r in a[3:]]
    # What is on the store: committed checkpoints, adapter-only, the tracker; no run lock left (both runs ended);
    # nothing left in the spool.
    assert s3.fs().cat_file(f"{BUCKET}/first/latest_checkpointed_iteration.txt") == b"6\n"
    assert s3.keys("first") == ["iter_0000003/.metadata", "iter_0000003/__0_0.distcp", "iter_0000003/__1_0.distcp",
                                "iter_0000003/metadata.json", "iter_0000006/.metadata", "iter_0000006/__0_0.distcp",
                                "iter_0000006/__1_0.distcp", "iter_0000006/metadata.json",
                                "latest_checkpointed_iteration.txt"]
    assert s3.fs().cat_file(f"{BUCKET}/resumed/latest_checkpointed_iteration.txt") == b"6\n"
    spool = Path(s3.env["PEFTCKPT_CACHE_DIR"]) / "spool" / "s3" / BUCKET
    assert [p for p in spool.rglob("*") if p.is_file()] == []  # shards uploaded and deleted, locks released
    assert not any((Path(s3.env["PEFTCKPT_CACHE_DIR"]) / "fetch").rglob("*.distcp"))  # load copies deleted
    manifest = json.loads(s3.fs().cat_file(f"{BUCKET}/first/iter_0000006/metadata.json"))
    assert manifest["trainable_only"] and manifest["excluded_keys"]
    assert all("lora" in k for k in manifest["saved_keys"])
    # The resumed run's final adapters and Adam moments are the uninterrupted run's, bit for bit.
    first = read_dcp_tensors(s3.download("first/iter_0000006", tmp_path / "a"))
    resumed = read_dcp_tensors(s3.download("resumed/iter_0000006", tmp_path / "b"))
    assert first.keys() == resumed.keys() and any(k.startswith("optimizer.") for k in first)
    for k in first:
        assert torch.equal(first[k], resumed[k]), k


def test_tp2_lora_from_a_torch_dist_base_on_the_store_is_the_local_base_run(s3: S3Server, tmp_path: Path) -> None:
    """``--pretrained-checkpoint s3://...`` (a torch_dist base): with ``--no-base-cache`` read where it lies, each TP
    rank fetching the rows of its shards, not the base; by default fetched whole into the host's base cache once
    and read from there by the next run. Every run's adapters, Adam moments and base fingerprint are the run's
    from the same base on local disk, bit for bit."""
    wide = [*TINY, "--hidden-size", "512", "--ffn-hidden-size", "2048", "--num-layers", "2", "--vocab-size", "1024"]
    base = tmp_path / "base"
    peftckpt(["train", *wide, "--train-iters", "1", "--no-save-optim", "--save", str(base)])
    s3.fs().put(str(base / "iter_0000001"), f"{BUCKET}/base/iter_0000001", recursive=True)
    assert sorted(s3.keys("base")) == sorted(f"iter_0000001/{p.name}" for p in (base / "iter_0000001").iterdir())
    data_bytes = sum(p.stat().st_size for p in (base / "iter_0000001").glob("*.distcp"))
    said = {}
    url = s3.url("base/iter_0000001")
    runs = {"local": [str(base / "iter_0000001")], "ranged": [url, "--no-base-cache"], "filled": [url],
            "cached": [url]}
    for name, where in runs.items():
        run = peftckpt(["train", *wide, "--tensor-model-parallel-size", "2", *LORA, "--save-interval", "6",
                        "--pretrained-checkpoint", *where, "--save", str(tmp_path / name)], 2, extra_env=s3.env)
        said[name] = run.stdout + run.stderr
    fetched = re.search(r"rank 0 fetched ([\d,]+) bytes by ranged reads", said["ranged"])
    assert fetched is not None, said["ranged"]
    assert int(fetched.group(1).replace(",", "")) < 0.7 * data_bytes  # its shards (and the small replicated norms)
    # By default the first run keeps the base in the host's cache, and the next one reads it from there.
    assert f"loaded base weights from {url} (fetched whole into the host's base cache)" in said["filled"]
    assert f"loaded base weights from {url} (read from the host's base cache)" in said["cached"]
    assert_runs_alike(tmp_path, ["ranged", "filled", "cached"], 6)


def test_tools_read_s3(s3: S3Server, tp2_runs: Path, tmp_path: Path) -> None:
    url = s3.url("first")
    ok = peftckpt(["verify", url], extra_env=s3.env)
    assert f"OK {url}/iter_0000006 (iteration 6" in ok.stdout
    report = json.loads(peftckpt(["inspect", url, "--json"], extra_env=s3.env).stdout)
    assert report["state"] == "committed" and report["checkpoint"]["path"] == f"{url}/iter_0000006"
    assert report["checkpoint"]["checksums_verified"] and report["checkpoint"]["trainable_only"]
    out = tmp_path / "peft"
    peftckpt(["export-peft", f"{url}/iter_0000003", str(out)], extra_env=s3.env)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and (out / "adapter_model.safetensors").stat().st_size > 0
    # A byte flipped in one object is named by its URL, by verify, inspect and a load alike.
    s3.fs().copy(f"{BUCKET}/first/iter_0000006", f"{BUCKET}/flipped/iter_0000006", recursive=True)
    s3.flip_byte("flipped/iter_0000006/__1_0.distcp")
    bad = f"{s3.url('flipped')}/iter_0000006/__1_0.distcp: xxh3_128 checksum mismatch"
    verify = peftckpt(["verify", s3.url("flipped")], check=False, extra_env=s3.env)
    assert verify.returncode == 1 and bad in verify.stderr, verify.stderr
    inspect = peftckpt(["inspect", s3.url("flipped"), "--json"], check=False, extra_env=s3.env)
    assert inspect.returncode == 1 and json.loads(inspect.stdout)["state"] == "corrupted"
    assert any(bad in r for r in json.loads(inspect.stdout)["reasons"])
    load = peftckpt(["train", *TINY, *LORA, "--load", s3.url("flipped")], check=False, extra_env=s3.env)
    # a load reads the object in place: the flipped byte (in its block index) is found by the ranged read
    in_place = f"{s3.url('flipped')}/iter_0000006/__1_0.distcp: xxh3_64 checksum mismatch of its block index"
    assert load.returncode == 1 and load.stderr.count(in_place) == 1, load.stderr


@pytest.mark.parametrize("point", ["upload", "before_manifest", "before_tracker"])
def test_a_kill_during_the_commit_leaves_the_tracker_on_the_previous_checkpoint(
        point: str, s3: S3Server, tmp_path: Path) -> None:
    prefix = f"kill-{point}"
    common = ["train", *TINY, *LORA, "--save", s3.url(prefix), "--save-interval", "3"]
    killed = peftckpt(common, check=False, extra_env={**s3.env, "PEFTCKPT_FAULT_INJECT": f"{point}:kill:iteration=6"})
    assert killed.returncode != 0
    assert s3.fs().cat_file(f"{BUCKET}/{prefix}/latest_checkpointed_iteration.txt") == b"3\n"
    stored = s3.keys(prefix)
    committed6 = "iter_0000006/metadata.json" in stored
    assert committed6 == (point == "before_tracker"), stored
    if point != "before_tracker":
        assert any(k.startswith("iter_0000006/") for k in stored)  # uploaded, never committed
    # verify follows the tracker; the rerun resumes from iteration 3 and its save cleans up what was left.
    assert "(iteration 3" in peftckpt(["verify", s3.url(prefix)], extra_env=s3.env).stdout
    rerun = peftckpt([*common, "--load", s3.url(prefix)], extra_env=s3.env)
    assert f"resumed from {s3.url(prefix)}/iter_0000003 at iteration 3" in rerun.stdout + rerun.stderr
    assert s3.fs().cat_file(f"{BUCKET}/{prefix}/latest_checkpointed_iteration.txt") == b"6\n"
    assert sorted({k.split("/")[0] for k in s3.keys(prefix)}) == ["iter_0000003", "iter_0000006",
                                                                   "latest_checkpointed_iteration.txt"]


def test_store_mistakes_are_one_message(s3: S3Server, tmp_path: Path) -> None:
    cases = [
        (["--save", "s3://no-such-bucket-here/run"], 2, "--save s3://no-such-bucket-here/run: bucket "
                                                        "no-such-bucket-here does not exist"),
        (["--load", "s3:///run"], 2, "--load s3:///run names no bucket"),
        (["--save", "hdfs://cluster/run"], 2, "has scheme hdfs://, which peftckpt does not store checkpoints on"),
    ]
    for flags, code, said in cases:
        proc = peftckpt(["train", *TINY, "--train-iters", "1", *flags], check=False, cwd=tmp_path, extra_env=s3.env)
        assert proc.returncode == code and proc.stderr.count(said) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    no_credentials = {**s3.env, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    proc = peftckpt(["train", *TINY, "--train-iters", "1", "--save", s3.url("nocred")], 2, check=False,
                    cwd=tmp_path, extra_env=no_credentials)
    said = f"--save {s3.url('nocred')}: no credentials for the object store"
    assert proc.returncode != 0 and proc.stderr.count(said) == 1, proc.stderr
    proc = peftckpt(["verify", s3.url("nocred")], check=False, extra_env=no_credentials)
    assert proc.returncode == 1 and proc.stderr.count("no credentials for the object store") == 1, proc.stderr
    assert list(tmp_path.iterdir()) == [] and s3.keys("nocred") == []
