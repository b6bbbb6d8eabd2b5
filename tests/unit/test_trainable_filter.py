"""``--save-trainable-params-only``: the section filter, then real trainable-only saves and
loads through :class:`~peftckpt.checkpoint.api.Checkpointer` (single process)."""

from __future__ import annotations

import io
import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from peftckpt.checkpoint.api import Checkpointer, LoadOptions, LoadResult, SaveOptions
from peftckpt.checkpoint.checks.strictness import KeyReport, StrictHandling
from peftckpt.checkpoint.errors import CheckpointError, CheckpointMismatchError, StrictnessError
from peftckpt.checkpoint.state.fingerprint import base_fingerprint
from peftckpt.checkpoint.state.sections import model_entries
from peftckpt.checkpoint.state.trainable import filter_trainable
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata
from peftckpt.sharding.entries import GlobalTensor, Piece, global_tensor_of

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REFUSAL = ("SaveOptions(trainable_only=True) needs ckpt_format 'torch_dist', but this save would use {fmt!r} "
           "(legacy torch checkpoints lose requires_grad, so every tensor would be dropped); nothing was written")


def _fused(requires_grad: bool) -> GlobalTensor:
    """A fused ``[gate; up]`` parameter: one global [6, 4] tensor held as two pieces (frozen unless trainable)."""
    full = torch.arange(24.0).reshape(6, 4)
    return GlobalTensor([6, 4], torch.float32, [Piece((0, 0), full[:3]), Piece((3, 0), full[3:])],
                        requires_grad=requires_grad, frozen=not requires_grad)


def _frozen(*shape: int) -> GlobalTensor:
    return global_tensor_of(nn.Parameter(torch.ones(*shape), requires_grad=False))


# ------------------------------------------------------------------------------------------ filter_trainable

def test_keeps_trainable_and_buffers_and_returns_frozen_as_excluded() -> None:
    frozen = _frozen(2, 3)
    trainable = global_tensor_of(nn.Parameter(torch.zeros(3, 2)))
    buffer = global_tensor_of(torch.ones(2))  # e.g. BatchNorm running statistics: training changes it
    assert (frozen.frozen, trainable.frozen, buffer.frozen) == (True, False, False)
    kept, excluded = filter_trainable({"w": frozen, "lora_A": trainable, "running_mean": buffer})
    assert kept == {"lora_A": trainable, "running_mean": buffer}
    assert excluded == {"w": frozen}
    assert kept["lora_A"] is trainable  # the same entry: its pieces still view the live tensor


@pytest.mark.parametrize("requires_grad", [True, False])
def test_fused_entry_goes_as_a_whole(requires_grad: bool) -> None:
    fused = _fused(requires_grad)
    kept, excluded = filter_trainable({"mlp.linear_fc1.weight": fused})
    where, other = (kept, excluded) if requires_grad else (excluded, kept)
    assert other == {}
    assert list(where) == ["mlp.linear_fc1.weight"]
    entry = where["mlp.linear_fc1.weight"]
    assert entry is fused
    assert [p.offsets for p in entry.pieces] == [(0, 0), (3, 0)]
    assert entry.global_shape == torch.Size([6, 4])


@pytest.mark.parametrize("extra", [
    {"fp8_scale": 1.0},
    io.BytesIO(b"te-state"),
    None,
    global_tensor_of(nn.Parameter(torch.ones(2))),  # even a trainable-looking tensor named _extra_state
])
def test_extra_state_is_always_dropped(extra: Any) -> None:
    weight = global_tensor_of(nn.Parameter(torch.ones(4, 4)))
    frozen = _frozen(4)
    section = {"linear_qkv.weight": weight, "linear_qkv._extra_state": extra, "linear_qkv.bias": frozen}
    kept, excluded = filter_trainable(section)
    assert kept == {"linear_qkv.weight": weight}
    assert excluded == {"linear_qkv.bias": frozen}  # extra state is neither kept nor recorded as frozen


def test_non_tensor_values_are_dropped() -> None:
    weight = global_tensor_of(nn.Parameter(torch.ones(2)))
    section = {"a": 3, "b": "text", "c": [1, 2], "d": {"nested": weight}, "w": weight}
    kept, excluded = filter_trainable(section)
    assert kept == {"w": weight}
    assert excluded == {}


def test_every_model_section_is_filtered_on_its_own() -> None:
    sections = {
        "model0": {"layers.0.w": _frozen(2),
                   "layers.0.lora": global_tensor_of(nn.Parameter(torch.ones(2)))},
        "model1": {"layers.1.w": _frozen(3),
                   "layers.1.lora": global_tensor_of(nn.Parameter(torch.ones(3))),
                   "layers.1._extra_state": b"x"},
    }
    result = {name: filter_trainable(sec) for name, sec in sections.items()}
    assert {n: (sorted(k), sorted(x)) for n, (k, x) in result.items()} == {
        "model0": (["layers.0.lora"], ["layers.0.w"]),
        "model1": (["layers.1.lora"], ["layers.1.w"]),
    }


def test_empty_section() -> None:
    assert filter_trainable({}) == ({}, {})


# ----------------------------------------------------------------------------------- real modules and saves

KW = dict(layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, coords={"tp": 0, "pp": 0, "dp": 0},
          model_config={"hidden_size": 4})


class FakeTELinear(nn.Module):
    """A Transformer-Engine-like linear: its FP8 metadata travels as ``_extra_state``."""

    def __init__(self, as_bytes: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))
        self.as_bytes = as_bytes
        self.restored: list[Any] = []

    def get_extra_state(self) -> Any:
        state = {"amax_history": [1.0, 2.0], "scale": 0.5}
        if not self.as_bytes:
            return state
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        return buf

    def set_extra_state(self, state: Any) -> None:
        self.restored.append(state)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class Block(nn.Module):
    def __init__(self, as_bytes: bool = False) -> None:
        super().__init__()
        self.linear_qkv = FakeTELinear(as_bytes)
        self.linear_proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.adapter = nn.Linear(4, 4, bias=False)  # the one trainable parameter ...
        self.linear_qkv.weight.requires_grad_(True)  # ... beside a trainable TE-like weight with extra state
        for p in [*self.linear_proj.parameters(), *self.norm.parameters()]:
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear_qkv(x)
        return self.norm(self.linear_proj(h) + self.adapter(h))


TRAINABLE = ["model.adapter.weight", "model.linear_qkv.weight"]
FROZEN = ["model.linear_proj.bias", "model.linear_proj.weight", "model.norm.bias", "model.norm.weight"]
EXTRA = "model.linear_qkv._extra_state"


def _trained(seed: int = 0, as_bytes: bool = False, steps: int = 2) -> tuple[Block, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    block = Block(as_bytes)
    opt = torch.optim.AdamW([p for p in block.parameters() if p.requires_grad], lr=0.1)
    for _ in range(steps):
        block(torch.randn(3, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return block, opt


def _save(root: Path, block: nn.Module, opt: torch.optim.Optimizer | None, trainable_only: bool,
          iteration: int = 3) -> Path:
    return Checkpointer([block], opt, **KW).save(root, iteration, {"iteration": iteration},
                                                 SaveOptions(trainable_only=trainable_only))


def test_model_entries_carry_the_extra_state() -> None:
    entries = model_entries(Block())
    assert "linear_qkv._extra_state" in entries
    assert entries["linear_qkv._extra_state"] == {"amax_history": [1.0, 2.0], "scale": 0.5}
    assert {k for k, v in entries.items() if isinstance(v, GlobalTensor) and v.requires_grad} == {
        "adapter.weight", "linear_qkv.weight"}


@pytest.mark.parametrize("as_bytes", [False, True], ids=["dict", "bytesio"])
def test_trainable_only_save_writes_only_trainable_keys(tmp_path: Path, as_bytes: bool) -> None:
    block, opt = _trained(as_bytes=as_bytes)
    ckpt = _save(tmp_path / "adapter", block, opt, trainable_only=True)
    stored = load_dcp_metadata(ckpt / ".metadata").state_dict_metadata
    assert sorted(k for k in stored if k.startswith("model.")) == TRAINABLE
    assert EXTRA not in stored
    assert not [k for k in stored if k.endswith("_extra_state")]
    assert not [k for k in stored if any(f.removeprefix("model.") in k for f in FROZEN)]
    for key in TRAINABLE:  # the optimizer section is not filtered
        name = key.removeprefix("model.")
        assert f"optimizer.state.{name}.exp_avg" in stored
        assert f"optimizer.state.{name}.exp_avg_sq" in stored

    manifest = json.loads((ckpt / "metadata.json").read_text())
    assert manifest["trainable_only"] is True
    assert sorted(manifest["saved_keys"]) == TRAINABLE
    assert manifest["saved_keys"]["model.adapter.weight"] == {"shape": [4, 4], "dtype": "float32",
                                                               "requires_grad": True}
    assert sorted(manifest["excluded_keys"]) == FROZEN
    assert manifest["excluded_keys"]["model.norm.weight"] == {"shape": [4], "dtype": "float32",
                                                               "requires_grad": False}
    frozen = {f"model.{k}": v for k, v in model_entries(block).items()
              if isinstance(v, GlobalTensor) and not v.requires_grad}
    assert sorted(frozen) == FROZEN
    assert re.fullmatch(r"v4:sha256:[0-9a-f]{64}", manifest["base_fingerprint"])
    assert manifest["base_fingerprint"] == base_fingerprint(frozen, distributed=False)

    full = _save(tmp_path / "full", block, opt, trainable_only=False)
    stored_full = load_dcp_metadata(full / ".metadata").state_dict_metadata
    assert EXTRA in stored_full
    assert sorted(k for k in stored_full if k.startswith("model.")) == sorted([*TRAINABLE, *FROZEN, EXTRA])
    manifest_full = json.loads((full / "metadata.json").read_text())
    assert manifest_full["trainable_only"] is False
    assert manifest_full["excluded_keys"] == {}
    assert manifest_full["base_fingerprint"] is None
    size = sum(f["size"] for f in manifest["files"].values())
    assert size < sum(f["size"] for f in manifest_full["files"].values())


def test_torch_format_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    block, opt = _trained()
    with pytest.raises(CheckpointError) as info:
        Checkpointer([block], opt, **KW).save(tmp_path / "s", 1, None,
                                              SaveOptions(ckpt_format="torch", trainable_only=True))
    assert str(info.value) == REFUSAL.format(fmt="torch")
    assert not (tmp_path / "s").exists() or list((tmp_path / "s").iterdir()) == []


@pytest.mark.parametrize("fmt", ["safetensors", "Torch_Dist", ""])
def test_an_unknown_format_is_refused_before_anything_is_written(tmp_path: Path, fmt: str) -> None:
    block, opt = _trained()
    with pytest.raises(CheckpointError) as info:
        Checkpointer([block], opt, **KW).save(tmp_path / "s", 1, None, SaveOptions(ckpt_format=fmt, trainable_only=True))
    assert str(info.value) == f"SaveOptions.ckpt_format: unknown checkpoint format {fmt!r} (known: torch_dist, torch)"
    assert not (tmp_path / "s").exists()


def test_two_model_chunks_are_both_filtered(tmp_path: Path) -> None:
    chunks = [nn.ModuleDict({"layers": nn.ModuleDict({str(i): nn.Linear(2, 2)})}) for i in range(2)]
    for c in chunks:
        next(iter(c["layers"].values())).bias.requires_grad_(False)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    ckpt = Checkpointer(chunks, torch.optim.AdamW(params), **{**KW, "layout": {**KW["layout"], "vpp": 2}}).save(
        tmp_path, 1, None, SaveOptions(trainable_only=True))
    manifest = json.loads((ckpt / "metadata.json").read_text())
    assert manifest["sections"][:2] == ["model0", "model1"]
    assert sorted(manifest["saved_keys"]) == ["model.layers.0.weight", "model.layers.1.weight"]
    assert sorted(manifest["excluded_keys"]) == ["model.layers.0.bias", "model.layers.1.bias"]


def _fresh(seed: int, same_base_as: Block | None = None) -> tuple[Block, torch.optim.Optimizer]:
    """An untrained block (own random trainable params); its frozen base copied from ``same_base_as``."""
    torch.manual_seed(seed)
    block = Block()
    if same_base_as is not None:
        with torch.no_grad():
            for p, q in zip(block.parameters(), same_base_as.parameters()):
                if not p.requires_grad:
                    p.copy_(q)
    return block, torch.optim.AdamW([p for p in block.parameters() if p.requires_grad], lr=0.5)


def _snapshot(block: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    params = {n: p.detach().clone() for n, p in block.named_parameters()}
    state = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in block.named_parameters()
             if p in opt.state}
    return params, state


def _assert_adapter_restored(target: Block, opt: torch.optim.Optimizer, saved: tuple[dict, dict]) -> None:
    params, state = saved
    for n, p in target.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, params[n]), n
            for stat in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][stat], state[n][stat]), (n, stat)
            assert float(opt.state[p]["step"]) == float(state[n]["step"]) == 2.0
    assert opt.param_groups[0]["lr"] == 0.1


def test_load_onto_the_same_base_needs_no_strictness_loosening(tmp_path: Path) -> None:
    block, opt = _trained()
    saved = _snapshot(block, opt)
    _save(tmp_path, block, opt, trainable_only=True)
    target, topt = _fresh(seed=5, same_base_as=block)
    assert not torch.equal(target.adapter.weight, block.adapter.weight)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no strictness warning either
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        result = Checkpointer([target], topt, **KW).load(tmp_path, LoadOptions(objects=["iteration"]))
    assert result.report == KeyReport(unexpected=[], missing=[])
    assert result.iteration == 3 and result.objects == {"iteration": 3}
    assert result.manifest.trainable_only is True
    _assert_adapter_restored(target, topt, saved)


@pytest.mark.parametrize("mode", [StrictHandling.RAISE_ALL, StrictHandling.LOG_UNEXPECTED],
                         ids=lambda m: m.value)
def test_frozen_keys_are_not_missing_nor_unexpected(tmp_path: Path, mode: StrictHandling) -> None:
    """Even the strictest mode accepts a trainable-only checkpoint; the Megatron-style flag is accepted too."""
    block, opt = _trained()
    _save(tmp_path, block, opt, trainable_only=True)
    target, topt = _fresh(seed=5, same_base_as=block)
    result = Checkpointer([target], topt, **KW).load(tmp_path, LoadOptions(strictness=mode))
    assert result.report == KeyReport(unexpected=[], missing=[])
    assert torch.equal(target.adapter.weight, block.adapter.weight)


def test_load_onto_a_different_base(tmp_path: Path) -> None:
    block, opt = _trained()
    saved = _snapshot(block, opt)
    _save(tmp_path, block, opt, trainable_only=True)
    target, topt = _fresh(seed=9)  # a different frozen base
    frozen_before = {n: p.detach().clone() for n, p in target.named_parameters() if not p.requires_grad}
    assert not torch.equal(frozen_before["linear_proj.weight"], block.linear_proj.weight)
    checkpointer = Checkpointer([target], topt, **KW)
    recorded = json.loads(next(tmp_path.glob("iter_*/metadata.json")).read_text())["base_fingerprint"]
    mine = checkpointer.fingerprint()
    assert mine != recorded

    with pytest.raises(CheckpointMismatchError) as info:
        checkpointer.load(tmp_path, LoadOptions(verify_base=True))
    text = str(info.value)
    assert "was trained on a different base model" in text
    assert f"base fingerprint in the checkpoint: {recorded}\n" in text
    assert f"base fingerprint of this model:     {mine}\n" in text
    assert text.endswith("load the base it was trained on (load_pretrained), or pass LoadOptions(verify_base=False) "
                         "to override")
    assert not torch.equal(target.adapter.weight, block.adapter.weight)  # nothing loaded

    result = checkpointer.load(tmp_path, LoadOptions(verify_base=False))
    assert result.report == KeyReport(unexpected=[], missing=[])
    _assert_adapter_restored(target, topt, saved)
    for n, p in target.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen_before[n]), n  # the frozen base is untouched


def test_iteration_zero_checkpoint_loads(tmp_path: Path) -> None:
    """Saved before the first optimizer step: zero moments and step 0 are written and read back."""
    block, opt = _trained(steps=0)
    _save(tmp_path, block, opt, trainable_only=True, iteration=0)
    target, topt = _fresh(seed=5, same_base_as=block)
    result = Checkpointer([target], topt, **KW).load(tmp_path)
    assert result.iteration == 0
    assert torch.equal(target.adapter.weight, block.adapter.weight)
    assert torch.equal(topt.state[target.adapter.weight]["exp_avg"], torch.zeros(4, 4))
    assert float(topt.state[target.adapter.weight]["step"]) == 0.0


def test_trainable_now_frozen_then_is_unexpected_with_a_hint(tmp_path: Path) -> None:
    block, opt = _trained()
    _save(tmp_path, block, opt, trainable_only=True)
    target, _ = _fresh(seed=5, same_base_as=block)
    target.norm.weight.requires_grad_(True)
    topt = torch.optim.AdamW([p for p in target.parameters() if p.requires_grad])
    with pytest.raises(StrictnessError) as info:
        Checkpointer([target], topt, **KW).load(tmp_path, LoadOptions(verify_base=False))
    text = str(info.value)
    assert re.search(r"^rank 0: \d+ key\(s\) requested but absent from checkpoint ", text)
    assert ("\n  model.norm.weight  (trainable now but frozen when the checkpoint was saved, so it is not in it: "
            "its value must come from the base (load_pretrained); LoadOptions.strictness = log_unexpected keeps "
            "that value)\n") in text
    before = target.norm.weight.detach().clone()
    result = Checkpointer([target], topt, **KW).load(
        tmp_path, LoadOptions(verify_base=False, strictness=StrictHandling.RETURN_UNEXPECTED))
    assert "model.norm.weight" in result.report.unexpected
    assert torch.equal(target.norm.weight, before)
    assert torch.equal(target.adapter.weight, block.adapter.weight)


def test_unfrozen_param_on_the_same_base_gets_the_hint_by_default(tmp_path: Path) -> None:
    block, opt = _trained()
    _save(tmp_path, block, opt, trainable_only=True)
    target, _ = _fresh(seed=5, same_base_as=block)
    target.norm.weight.requires_grad_(True)
    topt = torch.optim.AdamW([p for p in target.parameters() if p.requires_grad])
    with pytest.raises(StrictnessError, match="trainable now but frozen when the checkpoint was saved"):
        Checkpointer([target], topt, **KW).load(tmp_path)


def test_full_load_restores_extra_state(tmp_path: Path) -> None:
    block, opt = _trained()
    _save(tmp_path, block, opt, trainable_only=False)
    target, topt = _fresh(seed=5)
    result: LoadResult = Checkpointer([target], topt, **KW).load(tmp_path)
    assert result.iteration == 3
    assert torch.equal(target.norm.weight, block.norm.weight)  # the tensors did load
    assert target.linear_qkv.restored == [{"amax_history": [1.0, 2.0], "scale": 0.5}]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_old_fingerprint_is_checked_with_its_own_formula(tmp_path: Path, version: int) -> None:
    """Checkpoints written before fingerprint version 4 recorded ``sha256:...`` (version 1), ``v2:sha256:...``
    or ``v3:sha256:...``: they still load onto their base, and still refuse another base."""
    from peftckpt.checkpoint.storage.checksums import checksum_files

    block, opt = _trained()
    _save(tmp_path, block, opt, trainable_only=True)
    manifest_path = next(tmp_path.glob("iter_*/metadata.json"))
    manifest = json.loads(manifest_path.read_text())
    v1 = Checkpointer([block], opt, **KW).fingerprint(version=version)
    assert v1.startswith({1: "sha256:", 2: "v2:sha256:", 3: "v3:sha256:"}[version])
    assert manifest["base_fingerprint"].startswith("v4:sha256:")
    manifest.pop("manifest_sha256")
    manifest["base_fingerprint"] = v1
    manifest["files"].update(checksum_files([], manifest_path.parent))
    manifest_path.write_text(json.dumps(manifest))
    target, topt = _fresh(seed=5, same_base_as=block)
    Checkpointer([target], topt, **KW).load(tmp_path)
    assert torch.equal(target.adapter.weight, block.adapter.weight)
    other, otopt = _fresh(seed=9)
    with pytest.raises(CheckpointMismatchError, match=f"base fingerprint in the checkpoint: {v1}"):
        Checkpointer([other], otopt, **KW).load(tmp_path)
