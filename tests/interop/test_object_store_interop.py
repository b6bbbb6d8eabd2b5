"""HF and PEFT round trips with every checkpoint on S3 (moto's real S3 server on 127.0.0.1): import-hf to s3://,
fine-tune from the S3 base saving adapter-only to s3://, export-hf / export-peft from S3 (the base found through
the adapter's records, itself a URL), import-peft to s3:// against an S3 base, eval from S3. The exports from S3
are byte-identical to the same exports of local copies."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from peftckpt.interop.hf_dir import hf_file
from tests.integration.cli import assert_runs_alike, peftckpt
from tests.s3_server import S3Server, s3_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("cache")) as server:
        yield server


def test_hf_and_peft_round_trips_through_s3(s3: S3Server, hf_dir: Path, data: Path, tmp_path: Path) -> None:
    base, lora = s3.url("interop/base"), s3.url("interop/lora")
    imported = peftckpt(["import-hf", str(hf_dir), base], extra_env=s3.env)
    assert f"-> {base}/iter_0000000" in imported.stdout
    peftckpt(["train", "--pretrained-checkpoint", base, "--data-path", str(data), "--seq-length", "16", "--lora-rank",
              "4", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "5e-3",
              "--save", lora, "--save-trainable-params-only", "--log-interval", "100", "--device", "cpu"],
             extra_env=s3.env)
    manifest = json.loads(s3.fs().cat_file("peftckpt-test/interop/lora/iter_0000002/metadata.json"))
    assert manifest["trainable_only"] and manifest["args"]["pretrained_checkpoint"] == base

    peftckpt(["export-hf", lora, str(tmp_path / "hf_s3")], extra_env=s3.env)  # the base: the recorded URL
    peftckpt(["export-peft", lora, str(tmp_path / "peft_s3")], extra_env=s3.env)
    config = json.loads((tmp_path / "peft_s3" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_dir.absolute())  # import-hf's record, read from S3
    # The same exports of local copies of the two checkpoints: byte-identical files.
    local_base = s3.download("interop/base/iter_0000000", tmp_path / "base" / "iter_0000000")
    local_lora = s3.download("interop/lora/iter_0000002", tmp_path / "lora" / "iter_0000002")
    peftckpt(["export-hf", str(local_lora), str(tmp_path / "hf_local"), "--base", str(local_base)])
    for f in sorted((tmp_path / "hf_local").iterdir()):
        if f.suffix == ".safetensors":
            assert f.read_bytes() == (tmp_path / "hf_s3" / f.name).read_bytes(), f.name

    adapter = s3.url("interop/imported")
    out = peftckpt(["import-peft", str(tmp_path / "peft_s3"), adapter, "--base", base], extra_env=s3.env)
    assert f"-> {adapter}/iter_0000000" in out.stdout
    ev = peftckpt(["eval", "--pretrained-checkpoint", base, "--load", adapter, "--data-path", str(data),
                   "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--device", "cpu"],
                  extra_env=s3.env)
    assert "loss" in ev.stdout
    # An import into a location that already holds objects is refused, and nothing there changes.
    before = s3.keys("interop/imported")
    again = peftckpt(["import-peft", str(tmp_path / "peft_s3"), adapter, "--base", base], check=False,
                     extra_env=s3.env)
    assert again.returncode == 1 and f"OUT {adapter} already holds objects" in again.stderr
    assert s3.keys("interop/imported") == before


def test_tp2_lora_from_an_hf_directory_on_the_store_is_the_local_run(s3: S3Server, hf_dir: Path, data: Path,
                                                                      tmp_path: Path) -> None:
    """``--pretrained-checkpoint s3://.../hf``: the first run on a host fetches the directory's JSON and safetensors
    files whole into the host's base cache (each checked against the listing's size and MD5 ETag), the next reads
    the cached copy; with ``--no-base-cache`` config, index and safetensors headers come by ranged reads, each TP
    rank reading the rows of its shards. Every run's adapters, Adam moments and base fingerprint are those of the
    same run from the local directory, bit for bit."""
    s3.fs().put(str(hf_dir), "peftckpt-test/interop/hf", recursive=True)
    assert sorted(s3.keys("interop/hf")) == sorted(p.name for p in hf_dir.iterdir())
    url = s3.url("interop/hf")
    said = {}
    runs = {"local": [str(hf_dir)], "filled": [url], "cached": [url], "ranged": [url, "--no-base-cache"]}
    for name, where in runs.items():
        run = peftckpt(["train", "--pretrained-checkpoint", *where, "--data-path", str(data), "--seq-length", "16",
                        "--tensor-model-parallel-size", "2", "--lora-rank", "4", "--micro-batch-size", "2",
                        "--global-batch-size", "4", "--train-iters", "2", "--lr", "5e-3", "--save",
                        str(tmp_path / name), "--save-trainable-params-only", "--log-interval", "100",
                        "--device", "cpu"], nproc=2, extra_env=s3.env)
        said[name] = run.stdout
    assert f"loaded base weights from {hf_dir} (HF safetensors)" in said["local"], said["local"]
    assert f"loaded base weights from {url} (HF safetensors; fetched whole into the host's base cache)" in said["filled"]
    assert f"loaded base weights from {url} (HF safetensors; read from the host's base cache)" in said["cached"]
    fetched = re.search(rf"loaded base weights from {re.escape(url)} \(HF safetensors; rank 0 "
                        r"fetched ([\d,]+) bytes by ranged reads\)", said["ranged"])
    assert fetched is not None, said["ranged"]
    stored = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    assert int(fetched.group(1).replace(",", "")) < 0.75 * stored  # the rows of its shards, not the files
    (entry,) = [p for p in (Path(s3.env["PEFTCKPT_CACHE_DIR"]) / "bases").iterdir() if (p / "config.json").exists()]
    assert sorted(p.name for p in entry.iterdir()) == sorted(p.name for p in hf_dir.iterdir() if hf_file(p.name))
    assert_runs_alike(tmp_path, ["filled", "cached", "ranged"], 2)
