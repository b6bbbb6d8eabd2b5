"""``bench/ckpt_bench.py`` runs end to end on a tiny model and reports every row, ratio and target.

Timings are not asserted (bench/, not tests, holds performance): these tests pin that one run measures
everything the issue asks for, that sizes are consistent, and that the report can be re-rendered.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.cli import env

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-attention-heads", "4", "--num-query-groups", "2",
        "--ffn-hidden-size", "128", "--vocab-size", "256", "--lora-rank", "4", "--repeats", "2",
        "--scaling-layers", "1", "3", "--scaling-hidden-size", "64"]
ROWS = ["ours_full", "ours_trainable", "ours_model_only", "bare_full", "bare_trainable", "plain_dcp",
        "torch_save", "torch_save_fsync", "hf_peft", "hf_peft_fsync", "s3_trainable",
        "s3_plain"]
TARGETS = [
    "trainable-only save <= plain DCP save",
    "adapter-only save <= HF PEFT save_pretrained + fsync",
    "trainable-only save (adapter + Adam) <= HF PEFT model-only save + fsync",
    "trainable-only save <= 1.5x raw write+fsync of its bytes",
    "full save bandwidth >= 0.9x raw write+fsync bandwidth",
    "full load bandwidth (checksums verified while reading, the default)",
    "full load bandwidth (--no-verify-checksums)",
    "async trainable-only save: blocked <= 1% of the sync save",
    "async full save: blocked <= 1% of the sync save",
    "training step with a checkpoint every step (--save-interval 1 --async-save) <= 1.02x",
    "save to S3 bandwidth >= 0.8x a plain parallel put of the same bytes",
    "load from S3 bandwidth >= 0.8x a plain parallel get of the same bytes",
    "load from S3 bandwidth >= 0.8x plain ranged GETs of the same parts",
    "cost per stored tensor (trainable-only save, scaling fit) <= 25 us",
    "checksums + base fingerprint add <= 10% to a full save",
    "base fingerprint (once per run",
]


def _bench(args: list[str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ckpt_bench.py"), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT, env=env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _stat_ok(stat: dict[str, Any], repeats: int) -> None:
    assert len(stat["samples_s"]) == repeats
    assert 0 < stat["min_s"] <= stat["median_s"] <= stat["max_s"]


def _check(r: dict[str, Any], repeats: int, layout: dict[str, int], hf: bool = True) -> None:
    rows = r["rows"]
    names = [n for n in ROWS if hf or not n.startswith("hf_")]
    train_loop = "train_loop" in r
    targets = [t for t in TARGETS if (hf or "HF PEFT" not in t) and (train_loop or "every step" not in t)]
    assert sorted(rows) == sorted(names)
    for name in names:
        _stat_ok(rows[name]["save"], repeats)
        assert rows[name]["bytes"] > 0
    for name in ("ours_full", "ours_trainable", "ours_model_only"):
        for load in ("load", "load_noverify"):
            _stat_ok(rows[name][load], repeats)
    _stat_ok(rows["ours_full"]["load_verify_first"], repeats)
    for name in ("plain_dcp", "torch_save_fsync", "s3_trainable", "s3_plain", *(["hf_peft_fsync"] if hf else [])):
        _stat_ok(rows[name]["load"], repeats)
    _stat_ok(r["s3_plain_ranged_load"], repeats)
    # the S3 server's log of one save and one load: objects put, then got; the tracker read, never the bucket listed
    # more than a few times
    requests = r["s3_requests"]
    assert requests["save"]["PUT"] >= 3 and requests["load"]["GET"] >= 3, requests
    assert requests["save"].get("LIST", 0) <= 4 and requests["load"].get("LIST", 0) <= 4, requests
    # the load read the data objects in place, each byte of them at most once per rank (the replicated adapter
    # tensors every TP rank reads are why the ranks' sum may exceed the checkpoint)
    load_bytes = r["s3_load_bytes"]
    assert all(0 < b <= load_bytes["checkpoint"] for b in load_bytes["fetched_per_rank"]), load_bytes
    # a base from the store: the first run on a host fetches it whole into the cache, later runs read the cache,
    # --no-base-cache fetches by ranges (nothing beyond its bytes)
    base = r["base_from_store"]
    for key in ("local", "store_first_run", "store_cached", "store_ranged"):
        _stat_ok(base[key], repeats)
    assert [base[k]["cache_hit"] for k in ("local", "store_first_run", "store_cached", "store_ranged")] == [
        None, False, True, None], base
    assert base["local"]["bytes_fetched"] is None and not base["store_cached"]["bytes_fetched"], base
    assert 0.9 * base["bytes"] < base["store_first_run"]["bytes_fetched"] <= base["bytes"], base
    assert 0 < base["store_ranged"]["bytes_fetched"] <= base["bytes"], base
    # sizes: the adapter without its optimizer < adapter + Adam state < the whole model
    full, trainable, model_only = (rows[f"ours_{k}"]["bytes"] for k in ("full", "trainable", "model_only"))
    assert model_only < trainable < full
    # the same entries in stock DCP framing, no manifest: our leaner records (no serialisation id) are smaller
    assert 0.7 * rows["bare_trainable"]["bytes"] < trainable < 1.05 * rows["bare_trainable"]["bytes"]
    assert rows["s3_trainable"]["bytes"] == trainable  # the same checkpoint, on the S3 server
    assert r["raw"]["full"]["bytes"] == full and r["raw"]["trainable"]["bytes"] == trainable
    for kind in ("full", "trainable"):
        _stat_ok(r["raw"][kind]["write"], repeats)
        _stat_ok(r["raw"][kind]["read"], repeats)
        _stat_ok(r["async"][kind]["blocked"], repeats)
        _stat_ok(r["async"][kind]["until_committed"], repeats)
    _stat_ok(r["fingerprint"], repeats)
    assert r["layout"] == layout
    # a LoRA-shaped model: the frozen base dominates (summed over ranks; the TP-split vocabulary counts once)
    assert r["numel"]["trainable"] > 0 and r["numel"]["frozen"] > 5 * r["numel"]["trainable"]
    # scaling: more layers, more adapter tensors; three stored tensors (weight + two Adam moments) each
    points = r["scaling"]["points"]
    assert [p["layers"] for p in points] == [1, 3]
    assert points[0]["adapter_tensors"] < points[1]["adapter_tensors"]
    assert all(p["stored_tensors"] == 3 * p["adapter_tensors"] for p in points)
    assert all(math.isfinite(f["per_tensor_s"]) for f in r["scaling"]["fit"].values())
    # every target, with a finite ratio and a verdict
    assert len(r["targets"]) == len(targets)
    for target, prefix in zip(r["targets"], targets):
        assert target["target"].startswith(prefix), (target["target"], prefix)
        assert math.isfinite(target["value"]) and target["met"] in (True, False)


@pytest.mark.slow
def test_bench_one_process_then_rerender(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    work = tmp_path / "work"
    work.mkdir()
    proc = _bench([*TINY, "--output", str(out), "--workdir", str(work)])
    r = json.loads(out.read_text())
    _check(r, repeats=2, layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1})
    assert r["rows"]["hf_peft"]["same_adapter"] is True
    loop = r["train_loop"]  # the LoRA run with a checkpoint every step, against none
    assert loop["checkpoints_committed"] == loop["rounds"] * loop["iters"]
    assert all(len(loop[m]["samples_s"]) == loop["rounds"] * (loop["iters"] - 3) for m in ("no_saves", "every_step_async"))
    assert "| target | ratio | limit | met |" in proc.stdout
    assert "| trainable-only on S3 / on local disk (medians): save x" in proc.stdout
    assert "| S3 requests of one trainable-only save (by operation, server's log) | " in proc.stdout
    assert list(work.iterdir()) == []  # the run's checkpoints are gone
    # --from-json measures nothing and prints the same report
    again = _bench(["--from-json", str(out), "--output", str(tmp_path / "again.json")])
    table = proc.stdout[proc.stdout.index("model: "):proc.stdout.index("[bench] wrote")].strip()
    assert again.stdout.strip() == table
    assert json.loads((tmp_path / "again.json").read_text())["targets"] == r["targets"]


@pytest.mark.slow
def test_bench_under_torchrun_at_tp2(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    _bench([*TINY, "--world-size", "2", "--tp", "2", "--no-hf", "--no-train-loop", "--output", str(out)])
    r = json.loads(out.read_text())
    assert r["world"] == 2
    # ours, plain DCP, raw, async and scaling under torchrun; torch.save in the parent, on one process
    _check(r, repeats=2, layout={"tp": 2, "pp": 1, "dp": 1, "vpp": 1}, hf=False)
