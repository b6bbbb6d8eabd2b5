"""``peftckpt inspect``: offline reports on real single-process checkpoints, committed or not, damaged or
crafted, in both formats; the ``--json`` document is validated against the shipped JSON Schema."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from torch import nn

from peftckpt.checkpoint.api import Checkpointer, SaveOptions
from peftckpt.checkpoint.location.directory import new_staging_dir, write_tracker
from peftckpt.checkpoint.storage.checksums import checksum_files
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from peftckpt.checkpoint.tools.inspect import (
    COMMITTED,
    CORRUPTED,
    SCHEMA_PATH,
    UNCOMMITTED,
    InspectReport,
    inspect_path,
)
from peftckpt.cli.inspect import inspect_main
from peftckpt.cli.inspect_text import render_text

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

LAYOUT = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
COORDS = {"tp": 0, "pp": 0, "dp": 0}
SCHEMA = json.loads(SCHEMA_PATH.read_text())
F32 = 4
W = 128  # model width; the rank-4 adapter is ~6% of the model


class _Adapted(nn.Module):
    """A frozen W x W base linear with a rank-4 adapter (trainable by ``requires_grad``, not by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(W, W)
        self.lora_A = nn.Parameter(torch.randn(4, W) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(W, 4))
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()


def _checkpointer() -> tuple[Checkpointer, nn.Module]:
    torch.manual_seed(0)
    model = _Adapted()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(torch.randn(4, W)).sum().backward()
    opt.step()
    ckpt = Checkpointer([model], opt, layout=LAYOUT, coords=COORDS, model_config={"width": W},
                        adapter_config={"rank": 4})
    return ckpt, model


# Byte counts from the tensors themselves.
BASE_BYTES = (W * W + W) * F32
ADAPTER_BYTES = (4 * W + W * 4) * F32
FULL_BYTES = BASE_BYTES + ADAPTER_BYTES
OPTIM_TENSOR_BYTES = 2 * ADAPTER_BYTES  # exp_avg + exp_avg_sq of the trainable parameters only


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Save directories built once: full, adapter-only (iterations 1..3), legacy torch."""
    root = tmp_path_factory.mktemp("saves")
    ckpt, _ = _checkpointer()
    ckpt.save(root / "full", 7, {"iteration": 7})
    for it in (1, 2, 3):
        ckpt.save(root / "adapter", it, {"iteration": it}, SaveOptions(trainable_only=True))
    ckpt.save(root / "legacy", 5, {"iteration": 5}, SaveOptions(ckpt_format="torch"))
    return {"full": root / "full", "adapter": root / "adapter", "legacy": root / "legacy"}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _validate(report: InspectReport) -> dict[str, Any]:
    doc = json.loads(report.to_json())
    jsonschema.validate(doc, SCHEMA)
    return doc


def _disk_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------- committed


def test_full_checkpoint(saves: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = saves["full"] / "iter_0000007"
    report = inspect_path(ckpt_dir)
    assert (report.kind, report.state, report.exit_code, report.reasons) == ("checkpoint", COMMITTED, 0, [])
    ckpt = report.checkpoint
    assert ckpt is not None
    assert (ckpt.format, ckpt.iteration, ckpt.layout, ckpt.trainable_only) == ("torch_dist", 7, LAYOUT, False)
    assert ckpt.checksums_verified and ckpt.refused == [] and ckpt.base_fingerprint is None
    assert ckpt.sections == ["model", "optimizer", "rng_state", "iteration"]
    assert ckpt.adapter_config == {"rank": 4} and ckpt.model_config == {"width": W}
    w = ckpt.keys["model.base.weight"]
    assert (w.section, w.kind, w.shape, w.dtype, w.nbytes, w.trainable, w.saved) == (
        "model", "tensor", [W, W], "float32", W * W * F32, False, True)
    a = ckpt.keys["model.lora_A"]
    assert (a.shape, a.nbytes, a.trainable, a.saved) == ([4, W], 4 * W * F32, True, True)
    assert a.stored_bytes is not None and a.stored_bytes > a.nbytes  # torch.save framing
    assert ckpt.keys["optimizer.state.lora_B.exp_avg_sq"].shape == [W, 4]
    assert ckpt.keys["optimizer.state.lora_B.exp_avg_sq"].trainable is None
    assert ckpt.keys["iteration"].kind == "object" and ckpt.keys["iteration"].nbytes is None
    assert "optimizer.state.base.weight.exp_avg" not in ckpt.keys  # frozen: never given to the optimizer
    s = ckpt.sizes
    assert (s.model_bytes, s.saved_model_bytes, s.trainable_bytes, s.frozen_bytes) == (
        FULL_BYTES, FULL_BYTES, ADAPTER_BYTES, BASE_BYTES)
    groups = ckpt.keys["optimizer.param_groups.0"].stored_bytes
    assert groups is not None and s.optimizer_bytes == OPTIM_TENSOR_BYTES + groups
    assert s.disk_bytes == _disk_bytes(ckpt_dir) and s.num_files == 3
    assert s.manifest_bytes == s.disk_bytes - (ckpt_dir / "metadata.json").stat().st_size

    assert inspect_main([str(ckpt_dir), "--keys"]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint     {ckpt_dir}\n" in out
    assert "state          committed, checksums verified (all 3 files)\n" in out
    assert "iteration      7\nlayout         tp=1 pp=1 dp=1 vpp=1\ntrainable_only false\n" in out
    assert f"full model {FULL_BYTES / 1024:.1f} KiB, trainable {ADAPTER_BYTES / 1024:.1f} KiB ({100 * ADAPTER_BYTES / FULL_BYTES:.2f}%)" in out
    assert "keys           4 model, 5 optimizer, 3 other\n" in out
    assert f"  [model] 4 key(s), {FULL_BYTES / 1024:.1f} KiB saved\n" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("model.base.weight"))
    assert row.split() == ["model.base.weight", f"[{W},", f"{W}]", "float32", f"{W * W * F32:,}", "frozen"]


def test_adapter_only_checkpoint_and_save_dir_listing(saves: dict[str, Path], tmp_path: Path) -> None:
    save = _copy(saves["adapter"], tmp_path / "save")
    # a leftover staging directory (a save killed after DCP wrote its files) and an uncommitted iter_*
    staging = new_staging_dir(save, 4, "deadbeef")
    for f in (save / "iter_0000003").iterdir():
        if f.name != "metadata.json":
            shutil.copy(f, staging / f.name)
    (save / "iter_0000009").mkdir()
    report = inspect_path(save)
    assert (report.kind, report.state, report.exit_code) == ("save_dir", COMMITTED, 0)
    sd = report.save_dir
    assert sd is not None and sd.tracker == 3 and sd.selected == save / "iter_0000003" and sd.notes == []
    listing = [(e.name, e.kind, e.iteration, e.state, e.selected) for e in sd.entries]
    assert listing == [
        ("iter_0000001", "checkpoint", 1, COMMITTED, False),
        ("iter_0000002", "checkpoint", 2, COMMITTED, False),
        ("iter_0000003", "checkpoint", 3, COMMITTED, True),
        (".staging.iter_0000004.deadbeef", "staging", 4, UNCOMMITTED, False),
        ("iter_0000009", "checkpoint", 9, UNCOMMITTED, False),
    ]
    assert sd.entries[4].reason == "no metadata.json: a save stopped before its commit"

    ckpt = report.checkpoint
    assert ckpt is not None and ckpt.trainable_only is True and ckpt.iteration == 3
    assert ckpt.base_fingerprint is not None and ckpt.base_fingerprint.startswith("v4:sha256:")
    base = ckpt.keys["model.base.weight"]
    assert (base.shape, base.nbytes, base.trainable, base.saved, base.stored_bytes) == (
        [W, W], W * W * F32, False, False, None)
    assert ckpt.keys["model.lora_B"].saved and ckpt.keys["model.lora_B"].trainable
    s = ckpt.sizes
    assert (s.model_bytes, s.saved_model_bytes, s.trainable_bytes, s.frozen_bytes) == (
        FULL_BYTES, ADAPTER_BYTES, ADAPTER_BYTES, BASE_BYTES)
    assert s.trainable_fraction == pytest.approx(ADAPTER_BYTES / FULL_BYTES) and s.trainable_fraction < 0.1

    text = render_text(report, show_keys=True)
    assert f"save directory {save} (latest_checkpointed_iteration.txt: 3)\n" in text
    assert "  iter_0000003                    committed  <- selected\n" in text
    assert ("  .staging.iter_0000004.deadbeef  uncommitted  staging directory of a save that never committed "
            "(the next save removes it)\n") in text
    assert "keys           2 model (+2 frozen, not saved), 5 optimizer, 3 other\n" in text
    pct = 100 * ADAPTER_BYTES / FULL_BYTES
    assert (f"sizes          full model {FULL_BYTES / 1024:.1f} KiB, trainable {ADAPTER_BYTES / 1024:.1f} KiB "
            f"({pct:.2f}%), saved model {ADAPTER_BYTES / 1024:.1f} KiB, optimizer ") in text
    assert f"  [model] 4 key(s), 2 not saved, {ADAPTER_BYTES / 1024:.1f} KiB saved\n" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("model.base.weight"))
    assert row.split()[-3:] == ["frozen", "(not", "saved)"]

    doc = _validate(report)
    assert doc["save_dir"]["entries"][3]["state"] == "uncommitted"
    assert doc["checkpoint"]["keys"]["model.base.weight"] == {
        "section": "model", "kind": "tensor", "shape": [W, W], "dtype": "float32", "bytes": W * W * F32,
        "stored_bytes": None, "trainable": False, "saved": False}
    assert list(doc["checkpoint"]["keys"]) == sorted(doc["checkpoint"]["keys"])
    assert inspect_path(save).to_json() == report.to_json()  # deterministic


def test_tracker_fallback_is_noted(saves: dict[str, Path], tmp_path: Path) -> None:
    save = _copy(saves["adapter"], tmp_path / "save")
    write_tracker(save, 9)  # names an iteration that does not exist
    report = inspect_path(save)
    assert report.state == COMMITTED and report.save_dir is not None
    assert report.save_dir.selected == save / "iter_0000003"
    assert report.save_dir.notes == [
        f"{save}: latest_checkpointed_iteration.txt names iteration 9, which is not committed; using the newest "
        "committed checkpoint, iteration 3"]


# ------------------------------------------------------------------------------------ uncommitted


def test_uncommitted_staging_dir_reports_dcp_metadata(saves: dict[str, Path], tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    staging = tmp_path / ".staging.iter_0000008.abc"
    _copy(saves["full"] / "iter_0000007", staging)
    (staging / "metadata.json").unlink()
    report = inspect_path(staging)
    assert (report.state, report.exit_code) == (UNCOMMITTED, 1)
    ckpt = report.checkpoint
    assert ckpt is not None and not ckpt.loadable
    assert ckpt.reasons == [f"{staging} is the staging directory of a save that never committed: it is not "
                            "loadable, a load never picks it and the next save removes it"]
    assert (ckpt.format, ckpt.iteration, ckpt.trainable_only, ckpt.checksums_verified) == (
        "torch_dist", 8, None, False)
    w = ckpt.keys["model.base.weight"]
    assert (w.shape, w.nbytes, w.trainable) == ([W, W], W * W * F32, None)
    assert ckpt.sizes.model_bytes == FULL_BYTES and ckpt.sizes.trainable_bytes is None
    _validate(report)

    assert inspect_main([str(staging)]) == 1
    out = capsys.readouterr()
    assert "state          UNCOMMITTED (not loadable)\n" in out.out
    assert f"sizes          model {FULL_BYTES / 1024:.1f} KiB saved (no manifest: full size and trainable part " \
           "unknown), optimizer " in out.out
    assert out.err == f"peftckpt inspect: {staging}: uncommitted, not loadable\n"


def test_iter_dir_without_manifest_and_without_dcp_metadata(saves: dict[str, Path], tmp_path: Path) -> None:
    ckpt_dir = _copy(saves["full"] / "iter_0000007", tmp_path / "iter_0000007")
    (ckpt_dir / "metadata.json").unlink()
    (ckpt_dir / ".metadata").unlink()  # the save stopped while writing shards
    report = inspect_path(ckpt_dir)
    assert report.state == UNCOMMITTED and report.checkpoint is not None
    assert report.reasons == [
        f"{ckpt_dir} has no metadata.json: a save stopped before its commit, so it is not loadable; load the "
        f"save directory {tmp_path} for the last committed one",
        f"{ckpt_dir / '.metadata'}: DCP metadata was not written (the save stopped while writing shards), so no "
        "key can be listed",
    ]
    assert report.checkpoint.keys == {} and report.checkpoint.sizes.num_files == 1
    _validate(report)


def test_save_dir_without_committed_checkpoint(tmp_path: Path) -> None:
    new_staging_dir(tmp_path, 1, "tok")
    report = inspect_path(tmp_path)
    assert (report.kind, report.state, report.exit_code, report.checkpoint) == ("save_dir", UNCOMMITTED, 1, None)
    assert report.reasons == [f"no committed checkpoint in {tmp_path}"]
    assert "UNCOMMITTED    no committed checkpoint in" in render_text(report)
    _validate(report)


# -------------------------------------------------------------------------------------- corrupted


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x10
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


@pytest.mark.parametrize(("damage", "expected", "cheap_detects"), [
    (_flip, "{f}: xxh3_128 checksum mismatch: expected ", False),
    (_truncate, "{f}: size mismatch (truncated): expected {n} bytes, got {h}", True),
    (Path.unlink, "{f}: missing (expected {n} bytes)", True),
], ids=["bit-flipped", "truncated", "deleted"])
def test_damaged_shard_is_named(saves: dict[str, Path], tmp_path: Path, damage: Any, expected: str,
                                cheap_detects: bool) -> None:
    ckpt_dir = _copy(saves["adapter"] / "iter_0000002", tmp_path / "iter_0000002")
    shard = ckpt_dir / "__0_0.distcp"
    size = shard.stat().st_size
    damage(shard)
    message = expected.format(f=shard, n=size, h=size // 2)
    report = inspect_path(ckpt_dir)
    assert (report.state, report.exit_code) == (CORRUPTED, 1)
    assert len(report.reasons) == 1 and report.reasons[0].startswith(message)
    assert report.checkpoint is not None and report.checkpoint.checksums_verified
    assert report.checkpoint.keys["model.lora_A"].shape == [4, W]  # the metadata is still readable
    _validate(report)
    # --no-verify-checksums: presence and sizes only, so a same-size bit flip goes unnoticed
    cheap = inspect_path(ckpt_dir, verify_checksums=False)
    assert cheap.checkpoint is not None and not cheap.checkpoint.checksums_verified
    assert cheap.state == (CORRUPTED if cheap_detects else COMMITTED)
    if cheap_detects:
        assert cheap.reasons == [message]


def test_invalid_manifest_is_corrupted_but_keys_are_listed(saves: dict[str, Path], tmp_path: Path) -> None:
    ckpt_dir = _copy(saves["full"] / "iter_0000007", tmp_path / "iter_0000007")
    (ckpt_dir / "metadata.json").write_text("{not json")
    report = inspect_path(ckpt_dir)
    assert report.state == CORRUPTED and report.checkpoint is not None
    assert len(report.reasons) == 1
    assert report.reasons[0].startswith(f"manifest {ckpt_dir / 'metadata.json'} is not valid JSON")
    assert report.checkpoint.keys["model.lora_B"].shape == [W, 4]
    _validate(report)


# ----------------------------------------------------------------------------- crafted .metadata


class _Payload:
    """Unpickling this creates ``marker``: stands in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.touch, (self.marker,))


def _craft(ckpt_dir: Path, marker: Path, rerecord: bool) -> None:
    md = load_dcp_metadata(ckpt_dir / ".metadata")
    md.planner_data = {"x": _Payload(marker)}
    (ckpt_dir / ".metadata").write_bytes(pickle.dumps(md))
    if rerecord and (ckpt_dir / "metadata.json").exists():  # as an attacker would, so checksums pass
        manifest = json.loads((ckpt_dir / "metadata.json").read_text())
        manifest.pop("manifest_sha256")
        manifest["files"].update(checksum_files([ckpt_dir / ".metadata"], ckpt_dir))
        (ckpt_dir / "metadata.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["committed", "staging"])
def test_crafted_metadata_is_refused_and_runs_nothing(saves: dict[str, Path], tmp_path: Path, kind: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    name = "iter_0000007" if kind == "committed" else ".staging.iter_0000007.tok"
    ckpt_dir = _copy(saves["full"] / "iter_0000007", tmp_path / name)
    marker = tmp_path / "code-ran"
    _craft(ckpt_dir, marker, rerecord=True)
    md_file = ckpt_dir / ".metadata"
    refusal = (f"{md_file}: refused by the restricted unpickler, nothing in it was run: {md_file} refers to "
               "pathlib.Path.touch, which is not one of the classes")
    report = inspect_path(ckpt_dir)
    ckpt = report.checkpoint
    assert ckpt is not None
    assert report.state == (CORRUPTED if kind == "committed" else UNCOMMITTED) and report.exit_code == 1
    assert [r["file"] for r in ckpt.refused] == [str(md_file)]
    assert sum(r.startswith(refusal) for r in report.reasons) == 1
    if kind == "committed":
        assert len(report.reasons) == 1  # checksums were re-recorded: only the refusal remains
    # the refused metadata lists nothing; the model keys still come from the manifest (a staging directory
    # may hold one: the save stopped between writing it and the rename)
    assert (ckpt.keys["model.lora_A"].shape, ckpt.keys["model.lora_A"].stored_bytes) == ([4, W], None)
    assert not any(k.startswith("optimizer.") for k in ckpt.keys)
    _validate(report)

    assert inspect_main([str(ckpt_dir), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["checkpoint"]["refused"][0]["file"] == str(md_file)
    assert "refers to pathlib.Path.touch" in doc["checkpoint"]["refused"][0]["message"]
    assert not marker.exists()
    # Control: the payload is real, an unrestricted unpickle does run it.
    with open(md_file, "rb") as f:
        pickle.load(f)
    assert marker.exists()


# ----------------------------------------------------------------------------------------- legacy


def test_legacy_torch_checkpoint(saves: dict[str, Path]) -> None:
    report = inspect_path(saves["legacy"])
    assert report.state == COMMITTED and report.checkpoint is not None
    ckpt = report.checkpoint
    assert (ckpt.format, ckpt.iteration, ckpt.trainable_only, ckpt.checksums_verified) == ("torch", 5, False, True)
    assert {k for k in ckpt.keys if k.startswith("model.")} == {
        "model.base.weight", "model.base.bias", "model.lora_A", "model.lora_B"}
    w = ckpt.keys["model.base.weight"]
    assert (w.shape, w.dtype, w.nbytes, w.trainable) == ([W, W], "float32", W * W * F32, False)
    assert ckpt.keys["model.lora_A"].trainable is True  # from the manifest: the file itself lost requires_grad
    exp_avg = ckpt.keys["optimizer.state.lora_A.exp_avg"]
    assert (exp_avg.shape, exp_avg.nbytes) == ([4, W], 4 * W * F32)
    assert ckpt.keys["rng_state.0"].kind == "object" and ckpt.keys["iteration"].kind == "object"
    assert (ckpt.sizes.model_bytes, ckpt.sizes.trainable_bytes, ckpt.sizes.optimizer_bytes) == (
        FULL_BYTES, ADAPTER_BYTES, OPTIM_TENSOR_BYTES)
    assert ckpt.sizes.disk_bytes == _disk_bytes(saves["legacy"] / "iter_0000005")
    _validate(report)


def test_legacy_truncated_rank_file(saves: dict[str, Path], tmp_path: Path) -> None:
    ckpt_dir = _copy(saves["legacy"] / "iter_0000005", tmp_path / "iter_0000005")
    rank_file = ckpt_dir / "mp_rank_00" / "model_optim_rng.pt"
    _truncate(rank_file)
    report = inspect_path(ckpt_dir, verify_checksums=False)
    assert report.state == CORRUPTED
    assert report.reasons[0].startswith(f"{rank_file}: size mismatch (truncated)")
    assert report.reasons[1].startswith(f"{rank_file}: cannot be read: ")
    _validate(report)


def test_legacy_crafted_rank_file_is_refused(saves: dict[str, Path], tmp_path: Path) -> None:
    ckpt_dir = _copy(saves["legacy"] / "iter_0000005", tmp_path / "iter_0000005")
    rank_file = ckpt_dir / "mp_rank_00" / "model_optim_rng.pt"
    marker = tmp_path / "code-ran"
    torch.save({"iteration": 5, "evil": _Payload(marker)}, rank_file)
    report = inspect_path(ckpt_dir)
    assert report.state == CORRUPTED and report.checkpoint is not None
    assert [r["file"] for r in report.checkpoint.refused] == [str(rank_file)]
    assert report.reasons[0].startswith(f"{rank_file}: size mismatch")
    assert report.reasons[1] == (f"{rank_file}: refused by torch.load(weights_only=True), nothing in it was "
                                 "run: WeightsUnpickler error: Unsupported global: GLOBAL getattr")
    assert not marker.exists()


# -------------------------------------------------------------------------------------------- CLI


def test_cli_subprocess_json(saves: dict[str, Path]) -> None:
    proc = subprocess.run([sys.executable, "-m", "peftckpt", "inspect", str(saves["adapter"]), "--json"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert (doc["schema_version"], doc["kind"], doc["state"], doc["loadable"]) == (1, "save_dir", "committed", True)
    assert doc["checkpoint"]["iteration"] == 3
    assert doc["checkpoint"]["sizes"]["trainable_bytes"] == ADAPTER_BYTES
    assert proc.stdout == inspect_path(saves["adapter"]).to_json() + "\n"


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert inspect_main([str(missing)]) == 2
    assert capsys.readouterr().err == f"peftckpt inspect: error: DIR {missing} does not exist\n"
    (tmp_path / "f.txt").write_text("x")
    assert inspect_main([str(tmp_path / "f.txt")]) == 2
    assert capsys.readouterr().err == (f"peftckpt inspect: error: DIR {tmp_path / 'f.txt'} is a file, not a "
                                       "checkpoint directory or a save directory\n")
    assert inspect_main([str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"peftckpt inspect: error: DIR {tmp_path} is neither a peftckpt checkpoint (no metadata.json, no DCP or "
        "legacy rank files) nor a save directory (no latest_checkpointed_iteration.txt, no iter_* directories)\n")
    assert inspect_main([]) == 2
    assert "usage: peftckpt inspect [-h] [--keys] [--json] [--no-verify-checksums] DIR" in capsys.readouterr().err


def test_help_documents_options_and_cost(capsys: pytest.CaptureFixture[str]) -> None:
    assert inspect_main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--keys also print the per-key table, grouped by section" in out
    assert "--json print the JSON report (versioned by its schema_version field; every key included)" in out
    assert "--no-verify-checksums skip re-reading and hashing every file" in out
    assert "minutes for a 100 GB full checkpoint" in out
    assert "exit codes: 0 committed and intact, 1 uncommitted / corrupted / refused, 2 usage error" in out
