"""A full checkpoint records its tensors' fingerprint sums (``base_sums``), and a load of it as a base that verifies
what it reads takes them instead of summing the bytes again -- with the fingerprint it would have computed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from peftckpt import Checkpointer, LoadOptions, SaveOptions
from peftckpt.checkpoint.errors import CheckpointFormatError
from peftckpt.checkpoint.location.directory import resolve_checkpoint_dir
from peftckpt.checkpoint.location.names import MANIFEST_FILENAME
from peftckpt.checkpoint.state import fingerprint as fingerprint_module
from peftckpt.checkpoint.state.fingerprint import (
    FINGERPRINT_VERSION,
    Fingerprinting,
    base_fingerprint,
    tensor_sums,
)
from peftckpt.checkpoint.storage.manifest import Manifest, read_manifest
from peftckpt.sharding.entries import GlobalTensor, Piece


class _Model(nn.Module):
    """A frozen base (two weights) and a trainable adapter."""

    def __init__(self, seed: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w1 = nn.Parameter(torch.randn(64, 96, generator=g).to(dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(40, 64, generator=g).to(dtype), requires_grad=False)
        self.adapter = nn.Parameter(torch.randn(8, 64, generator=g))


@pytest.fixture
def summed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of elements the fingerprint summed, counted as it sums them."""
    calls: list[int] = []
    real = fingerprint_module.segment_sums

    def counting(rows: torch.Tensor, starts: object, version: int) -> list[int]:
        calls.append(rows.numel())
        return real(rows, starts, version)  # type: ignore[arg-type]

    monkeypatch.setattr(fingerprint_module, "segment_sums", counting)
    return calls


def test_known_sums_are_taken_and_not_summed_again(summed: list[int]) -> None:
    a, b = torch.randn(32, 64), torch.randn(16, 64)
    entries = {k: GlobalTensor(t.shape, t.dtype, [Piece((0, 0), t)], frozen=True) for k, t in (("a", a), ("b", b))}
    reference = base_fingerprint(entries, distributed=False)
    summed.clear()
    job = Fingerprinting(entries, distributed=False, known={"a": tensor_sums(a)})
    summed.clear()
    for k, e in entries.items():
        job.add(k, (0, 0), e.pieces[0].tensor)
    assert job.result() == reference
    assert sum(summed) == b.numel()  # only "b" was summed
    assert job.key_sums == {"a": tensor_sums(a), "b": tensor_sums(b)}
    wrong = Fingerprinting(entries, distributed=False, known={"a": [1, 2]})  # the recorded sums are what counts
    for k, e in entries.items():
        wrong.add(k, (0, 0), e.pieces[0].tensor)
    assert wrong.result() != reference


def _fingerprint_of(model: nn.Module) -> str:
    return base_fingerprint({f"model.{k}": GlobalTensor(p.shape, p.dtype, [Piece((0,) * p.dim(), p)], frozen=True)
                             for k, p in model.named_parameters() if not p.requires_grad}, distributed=False)


def test_a_base_load_takes_the_sums_its_checkpoint_recorded(tmp_path: Path, summed: list[int]) -> None:
    base = _Model(0)
    Checkpointer(base).save(tmp_path / "first", 1)
    assert read_manifest(resolve_checkpoint_dir(tmp_path / "first")[0]).base_sums is None  # nothing was known

    # A load sums what it read (no recorded sums) and keeps the sums; a full save then records them.
    loaded = _Model(1)
    ckpt = Checkpointer(loaded)
    summed.clear()
    ckpt.load_pretrained(tmp_path / "first")
    assert sum(summed) == 64 * 96 + 40 * 64
    ckpt.save(tmp_path / "second", 2)
    recorded = read_manifest(resolve_checkpoint_dir(tmp_path / "second")[0]).base_sums
    assert recorded == {"model.w1": [FINGERPRINT_VERSION, *tensor_sums(base.w1)],
                        "model.w2": [FINGERPRINT_VERSION, *tensor_sums(base.w2)]}  # the frozen ones, no adapter
    ckpt.save(tmp_path / "adapter", 3, options=SaveOptions(trainable_only=True))
    assert read_manifest(resolve_checkpoint_dir(tmp_path / "adapter")[0]).base_sums is None

    # A verified load of "second" as a base sums nothing, and has the fingerprint it would have computed.
    expected = _fingerprint_of(base)
    for options, sums_again in ((LoadOptions(), 0), (LoadOptions(verify_while_reading=False), 0),
                                (LoadOptions(verify_checksums=False), 64 * 96 + 40 * 64)):
        fresh = Checkpointer(_Model(2))
        summed.clear()
        fresh.load_pretrained(tmp_path / "second", options)
        assert sum(summed) == sums_again, options
        assert fresh.parts.fingerprint() == expected, options
    # Records of another version or width are not taken: those tensors are summed.
    path = resolve_checkpoint_dir(tmp_path / "second")[0] / MANIFEST_FILENAME
    manifest = read_manifest(path.parent)
    manifest.base_sums = {"model.w1": [FINGERPRINT_VERSION, 5], "model.w2": [3, *recorded["model.w2"][1:]]}
    path.write_bytes(manifest.to_json())
    other = Checkpointer(_Model(2))
    summed.clear()
    other.load_pretrained(tmp_path / "second")
    assert sum(summed) == 64 * 96 + 40 * 64 and other.parts.fingerprint() == expected
    # Held in another dtype than stored (a conversion may change values): summed from what the model holds.
    narrow = Checkpointer(_Model(2, torch.bfloat16))
    summed.clear()
    narrow.load_pretrained(tmp_path / "second")
    assert sum(summed) == 64 * 96 + 40 * 64
    assert narrow.parts.fingerprint() == _fingerprint_of(_Model(0, torch.bfloat16))


def test_manifests_without_base_sums_still_read_and_bad_ones_are_named(tmp_path: Path) -> None:
    body = json.loads(Manifest(format="torch_dist", iteration=1).to_json())
    for key in ("manifest_sha256", "base_sums"):
        body.pop(key)
    (tmp_path / "old.json").write_text(json.dumps(body))
    assert Manifest.from_json((tmp_path / "old.json").read_bytes(), tmp_path / "old.json").base_sums is None
    body["base_sums"] = {"model.w": [4, -1]}
    with pytest.raises(CheckpointFormatError, match="field 'base_sums' must be null or an object of lists of ints"):
        Manifest.from_json(json.dumps(body).encode(), tmp_path / "bad.json")
