"""The library for anyone's training loop (single process): top-level names, no hand-built layout, states
restored in place, buffers kept by trainable-only saves, the async save's handle, ``close`` / ``with``."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import peftckpt
from peftckpt import (
    Checkpointer,
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    LoadOptions,
    SaveOptions,
)
from peftckpt.checkpoint import api
from peftckpt.checkpoint.location.directory import read_tracker
from peftckpt.checkpoint.location.names import LOCK_FILENAME
from peftckpt.checkpoint.state import builder
from peftckpt.checkpoint.storage import formats
from peftckpt.sharding.entries import GlobalTensor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Adapted(nn.Module):
    """A frozen base linear, a trainable low-rank adapter, and a BatchNorm whose running statistics (buffers)
    change in training while its affine weights stay frozen."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.base = nn.Linear(6, 6).requires_grad_(False)
        self.norm = nn.BatchNorm1d(6)
        self.norm.weight.requires_grad_(False)
        self.norm.bias.requires_grad_(False)
        self.lora_a = nn.Linear(6, 2, bias=False)
        self.lora_b = nn.Linear(2, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.base(x) + self.lora_b(self.lora_a(x)))


def _same_base(model: Adapted, like: Adapted) -> Adapted:
    with torch.no_grad():
        for p, q in zip(model.parameters(), like.parameters()):
            if not p.requires_grad:
                p.copy_(q)
    return model


def _setup(seed: int, like: Adapted | None = None) -> tuple[Adapted, torch.optim.Optimizer, Any]:
    model = Adapted(seed) if like is None else _same_base(Adapted(seed), like)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: Adapted, opt: torch.optim.Optimizer, sched: Any, steps: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(5, 6, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def test_import_peftckpt_is_light_and_exports_the_library() -> None:
    code = "import sys, peftckpt; assert 'torch' not in sys.modules, 'import peftckpt imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert {"Checkpointer", "SaveOptions", "LoadOptions", "PendingSave", "CheckpointError",
            "declare_fused"} <= set(peftckpt.__all__)
    assert peftckpt.Checkpointer is api.Checkpointer
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        peftckpt.Nope  # noqa: B018


def test_a_few_lines_save_and_resume_exactly_with_buffers_and_states(tmp_path: Path) -> None:
    """No layout, no model_config: a trainable-only checkpoint holds the adapters, Adam moments, the
    scheduler (a state, restored in place) and the BatchNorm running statistics -- and resumes exactly."""
    model, opt, sched = _setup(0)
    _train(model, opt, sched, 3, seed=1)
    ckpt = Checkpointer(model, opt, states={"lr_scheduler": sched})
    ckpt.save(tmp_path, 3, options=SaveOptions(trainable_only=True))
    expected = _train(model, opt, sched, 3, seed=2)

    manifest = json.loads((tmp_path / "iter_0000003" / "metadata.json").read_text())
    assert manifest["layout"] == {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
    assert set(manifest["saved_keys"]) == {"model.lora_a.weight", "model.lora_b.weight", "model.norm.running_mean",
                                          "model.norm.running_var", "model.norm.num_batches_tracked"}
    assert set(manifest["excluded_keys"]) == {"model.base.weight", "model.base.bias", "model.norm.weight",
                                             "model.norm.bias"}
    assert "states.lr_scheduler" in manifest["sections"]

    resumed, ropt, rsched = _setup(7, like=model)  # other adapters, fresh optimizer and schedule
    assert rsched.last_epoch == 0
    result = Checkpointer(resumed, ropt, states={"lr_scheduler": rsched}).load(tmp_path)
    assert result.iteration == 3 and "lr_scheduler" not in str(result.objects)
    assert rsched.last_epoch == 3 and rsched.get_last_lr() == pytest.approx([0.05 * 0.5])
    assert resumed.norm.num_batches_tracked.item() == 3
    assert _train(resumed, ropt, rsched, 3, seed=2) == expected


def test_the_fingerprint_covers_frozen_parameters_not_buffers(tmp_path: Path) -> None:
    model, opt, sched = _setup(0)
    ckpt = Checkpointer(model, opt)
    before = ckpt.fingerprint()
    _train(model, opt, sched, 2, seed=1)  # running statistics change, the frozen parameters do not
    assert Checkpointer(model, opt).fingerprint() == before
    with torch.no_grad():
        model.norm.weight.add_(1)
    assert Checkpointer(model, opt).fingerprint() != before


def test_a_trainable_only_checkpoint_without_buffers_still_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """Trainable-only saves of earlier releases left buffers out and listed them as excluded: such a
    checkpoint loads, and the buffers keep their values."""
    def old_filter(section: dict[str, Any]) -> tuple[dict[str, Any], dict[str, GlobalTensor]]:
        kept = {k: v for k, v in section.items() if isinstance(v, GlobalTensor) and v.requires_grad}
        return kept, {k: v for k, v in section.items() if isinstance(v, GlobalTensor) and not v.requires_grad}

    model, opt, sched = _setup(0)
    _train(model, opt, sched, 2, seed=1)
    with monkeypatch.context() as m:
        m.setattr(builder, "filter_trainable", old_filter)
        m.setattr(api.Checkpointer, "fingerprint", lambda self, keys=None, version=4: "v4:sha256:" + "0" * 64)
        Checkpointer(model, opt).save(tmp_path, 2, options=SaveOptions(trainable_only=True))
    excluded = json.loads((tmp_path / "iter_0000002" / "metadata.json").read_text())["excluded_keys"]
    assert "model.norm.running_mean" in excluded
    resumed, ropt, _ = _setup(5, like=model)
    Checkpointer(resumed, ropt).load(tmp_path, LoadOptions(verify_base=False))
    assert torch.equal(resumed.lora_a.weight, model.lora_a.weight)
    assert resumed.norm.num_batches_tracked.item() == 0


def test_states_are_checked(tmp_path: Path) -> None:
    model, opt, sched = _setup(0)
    with pytest.raises(TypeError, match=r"states\['step'\] \(int\) has no state_dict"):
        Checkpointer(model, opt, states={"step": 3})
    Checkpointer(model, opt).save(tmp_path / "plain", 1)
    with pytest.raises(CheckpointMismatchError, match="holds no state for 'lr_scheduler'"):
        Checkpointer(model, opt, states={"lr_scheduler": sched}).load(tmp_path / "plain")
    with pytest.raises(CheckpointFormatError, match="states .* need ckpt_format 'torch_dist'"):
        Checkpointer(model, opt, states={"lr_scheduler": sched}).save(tmp_path / "legacy", 1,
                                                                      options=SaveOptions(ckpt_format="torch"))
    with pytest.raises(ValueError, match=r"LoadOptions.strictness: unknown mode 'strict' \(known: assume_ok_unexpected, "):
        LoadOptions(strictness="strict")
    with pytest.raises(ValueError, match="layout and coords go together"):
        Checkpointer(model, opt, layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1})
    with pytest.raises(CheckpointFormatError, match=r"SaveOptions.ckpt_format: unknown checkpoint format 'zarr' "
                       r"\(known: torch_dist, torch\)"):
        Checkpointer(model, opt).save(tmp_path / "zarr", 1, options=SaveOptions(ckpt_format="zarr"))
    assert not (tmp_path / "zarr").exists()  # refused before anything was written


def test_the_legacy_format_loads_through_the_same_steps(tmp_path: Path) -> None:
    """A legacy ``torch`` checkpoint goes through the load's one path (the format opens it): weights, Adam
    moments and groups come back, the strictness modes that look at missing keys work on its per-rank keys,
    and a key the file lacks is named like a DCP checkpoint's."""
    model, opt, sched = _setup(0)
    _train(model, opt, sched, 2, seed=1)
    Checkpointer(model, opt).save(tmp_path, 2, {"sched": sched.state_dict()}, SaveOptions(ckpt_format="torch"))
    lr = opt.param_groups[0]["lr"]
    expected = _train(model, opt, sched, 2, seed=2)
    for strictness in ("raise_all", "log_all", "assume_ok_unexpected"):
        resumed, ropt, rsched = _setup(5)
        result = Checkpointer(resumed, ropt).load(tmp_path, LoadOptions(strictness=strictness, objects=["sched"]))
        assert result.report.unexpected == [] and ropt.param_groups[0]["lr"] == lr
        assert ropt.state[ropt.param_groups[0]["params"][0]]["step"].item() == 2
        rsched.load_state_dict(result.objects["sched"])
        assert _train(resumed, ropt, rsched, 2, seed=2) == expected

    class Wider(Adapted):
        def __init__(self, seed: int) -> None:
            super().__init__(seed)
            self.extra = nn.Linear(2, 2)

    wider = Wider(0)
    with pytest.raises(CheckpointError, match=r"2 key\(s\) requested but absent from checkpoint .*\n  model.extra.bias\n  model.extra.weight\n"):
        Checkpointer(wider, torch.optim.AdamW(wider.parameters())).load(tmp_path, LoadOptions(load_optim=False))


def test_async_save_returns_a_handle_whose_result_is_the_committed_path(tmp_path: Path) -> None:
    model, opt, sched = _setup(0)
    _train(model, opt, sched, 1, seed=1)
    ckpt = Checkpointer(model, opt, states={"lr_scheduler": sched})
    handle = ckpt.async_save(tmp_path, 1, options=SaveOptions(trainable_only=True))
    assert handle.path == tmp_path.absolute() / "iter_0000001"
    _train(model, opt, sched, 1, seed=2)  # training goes on while it is written
    assert handle.result() == handle.path and handle.done()
    assert read_tracker(tmp_path) == 1 and (handle.path / "metadata.json").is_file()
    assert handle.result() == handle.path  # answered at once the second time
    # committed by the next save too; its handle is then done without a collective
    second = ckpt.async_save(tmp_path, 2)
    third = ckpt.async_save(tmp_path, 3)
    assert second.done()
    assert second.result() == tmp_path.absolute() / "iter_0000002" and third.result().name == "iter_0000003"
    ckpt.close()


def test_a_failed_async_save_handle_raises_why_every_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def held(point: str, rank: int, iteration: int) -> None:  # the writer waits at its first item
        if point == "data" and threading.current_thread() is not threading.main_thread():
            assert release.wait(30)

    monkeypatch.setattr(formats, "fault_hook", lambda point, rank, iteration: lambda: held(point, rank, iteration))
    model, opt, _ = _setup(0)
    ckpt = Checkpointer(model, opt)
    ckpt.save(tmp_path, 1)
    failing = ckpt.async_save(tmp_path, 2)
    with torch.no_grad():
        model.base.weight.add_(1)  # a frozen parameter modified while the save writes it from live memory
    release.set()
    for _ in range(2):
        with pytest.raises(CheckpointError, match="modified in place .* the save is discarded"):
            failing.result()
    assert failing.done() and read_tracker(tmp_path) == 1
    ckpt.close()


def _lock_is_free(save: Path) -> bool:
    lock = save / LOCK_FILENAME
    if not lock.exists():
        return True
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_with_block_commits_and_releases(tmp_path: Path) -> None:
    model, opt, _ = _setup(0)
    with Checkpointer(model, opt) as ckpt:
        pending = ckpt.async_save(tmp_path, 1)
        assert not _lock_is_free(tmp_path)
    assert pending.done() and read_tracker(tmp_path) == 1
    assert _lock_is_free(tmp_path)


class _Position:
    """A data loader's position, as the README's example checkpoints it."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_the_readme_library_example_runs_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("### As a library"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    monkeypatch.chdir(tmp_path)
    for steps in (200, 300):
        model, optimizer, scheduler = _setup(0)
        data = _Position()

        def train_step(model: Adapted, optimizer: Any, scheduler: Any, data: _Position) -> float:
            data.position += 1
            return _train(model, optimizer, scheduler, 1, seed=data.position)[0]

        scope: dict[str, Any] = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "steps": steps,
                                 "data": data, "train_step": train_step, "losses": {}, "workdir": "runs/x",
                                 "save_every": 100}
        exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own example
        assert scope["start"] == steps - 100 - (100 if steps == 200 else 0)
    assert read_tracker(tmp_path / "runs" / "x") == 300


def test_plan_and_commit_coverage_checks_name_regions_and_ranks(tmp_path: Path) -> None:
    from peftckpt.checkpoint.checks.integrity import plan_problems, unwritten_pieces
    from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata

    shape = [8, 4]
    replicas = [{"w": (shape, [([0, 0], [8, 4])])}, {"w": (shape, [([0, 0], [8, 4])])}]
    assert plan_problems(replicas) == []
    halves = [{"w": (shape, [([0, 0], [4, 4])])}, {"w": (shape, [([4, 0], [4, 4])])}]
    assert plan_problems(halves) == []
    (overlap,) = plan_problems([{"w": (shape, [([0, 0], [5, 4])])}, {"w": (shape, [([4, 0], [4, 4])])}])
    assert overlap.startswith("'w': rank(s) 0 hold offsets [0, 0] size [5, 4] and rank(s) 1 offsets [4, 0] size "
                              "[4, 4]: they overlap without being the same piece")
    (hole,) = plan_problems([{"w": (shape, [([0, 0], [4, 4])])}, {"w": (shape, [([0, 0], [4, 4])])}])
    assert hole.startswith("'w' (shape [8, 4]): no rank holds offsets [4, 0] size [4, 4] (held: rank(s) 0, 1: ")
    (cols,) = plan_problems([{"w": (shape, [([0, 0], [8, 1]), ([0, 3], [8, 1])])}])
    assert "no rank holds offsets [0, 1] size [8, 2]" in cols
    # at the commit: a piece a rank held that the stored metadata lacks names the rank
    model, opt, _ = _setup(0)
    Checkpointer(model, opt).save(tmp_path, 1)
    metadata = load_dcp_metadata(tmp_path / "iter_0000001" / ".metadata")
    assert unwritten_pieces(metadata, {"model.base.weight": [(0, [0, 0], [6, 6])]}) == []
    assert unwritten_pieces(metadata, {"model.extra.weight": [(0, [0, 0], [2, 2]), (1, [2, 0], [2, 2])]}) == [
        "'model.extra.weight': the piece at offsets [0, 0] of size [2, 2], held by rank(s) 0, never reached the "
        "checkpoint", "'model.extra.weight': the piece at offsets [2, 0] of size [2, 2], held by rank(s) 1, never "
        "reached the checkpoint"]


def test_trainable_only_with_nothing_trainable_says_so(tmp_path: Path) -> None:
    model, _, _ = _setup(0)
    model.requires_grad_(False)
    with pytest.warns(UserWarning, match="no model parameter is trainable, so this checkpoint holds no model "
                                         r"parameters \(buffers only"):
        Checkpointer(model).save(tmp_path, 1, options=SaveOptions(trainable_only=True))
    saved = json.loads((tmp_path / "iter_0000001" / "metadata.json").read_text())["saved_keys"]
    assert sorted(saved) == ["model.norm.num_batches_tracked", "model.norm.running_mean", "model.norm.running_var"]


def test_a_trainable_only_checkpoint_that_left_nothing_out_serves_as_a_base(tmp_path: Path) -> None:
    """Saved with trainable_only but with nothing frozen, a checkpoint holds every weight: it is a base like a
    full one (it was refused with "it holds no base weights"); one that left frozen weights out still is refused."""
    from peftckpt.checkpoint.errors import CheckpointFormatError

    model, _, _ = _setup(0)
    model.requires_grad_(True)  # nothing frozen
    Checkpointer(model).save(tmp_path / "all", 1, options=SaveOptions(trainable_only=True))
    fresh, _, _ = _setup(5)
    assert not torch.equal(next(fresh.parameters()), next(model.parameters()))
    Checkpointer(fresh).load_pretrained(tmp_path / "all")
    for (k, v), w in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(v, w), k
    Checkpointer(_setup(0)[0]).save(tmp_path / "adapter", 1, options=SaveOptions(trainable_only=True))  # base frozen
    with pytest.raises(CheckpointFormatError, match="is an adapter-only checkpoint .* holds no base weights"):
        Checkpointer(_setup(5)[0]).load_pretrained(tmp_path / "adapter")
