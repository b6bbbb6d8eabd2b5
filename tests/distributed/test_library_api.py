"""The library on real ranks (one spawn of 2): the layout from a named DeviceMesh, an explicit process group
that leaves other ranks out, per-rank states (each rank restores its own; a job with more ranks than the
save restores rank 0's, said once), a rank's shard that never reaches disk refused at the commit,
naming the rank, and the saves after it reusing the plans of the last committed save (its layout on every
rank)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from peftckpt import Checkpointer, CheckpointError, FusedChunks, SaveOptions, declare_fused
from peftckpt.checkpoint import rank_parts as api
from tests.integration.cli import read_dcp_tensors

from .harness import run_distributed

pytestmark = pytest.mark.slow


class Counter:
    """A user's stateful object (e.g. a data loader's position): different on every rank."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4).requires_grad_(False), nn.Linear(4, 4))
    return model


def _worker(rank: int, world: int, root: str, single: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _model()
    # 1. layouts from meshes
    for dims, sizes in ((("dp",), (2,)), (("dp", "tp"), (1, 2)), (("pp", "dp_shard"), (2, 1))):
        mesh = init_device_mesh("cpu", sizes, mesh_dim_names=dims)
        ckpt = Checkpointer(model, mesh=mesh)
        out["/".join(dims)] = (ckpt.layout, ckpt.coords)
    for bad, match in ((init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)), "'cp'"),
                       (init_device_mesh("cpu", (2,)), "named dimensions")):
        try:
            Checkpointer(model, mesh=bad)
            out.setdefault("errors", []).append(None)
        except ValueError as e:
            out.setdefault("errors", []).append(match in str(e))
    # 2. a checkpointer on a group of rank 0 alone: rank 1 takes no part, and nothing waits for it
    alone = dist.new_group([0])
    if rank == 0:
        with Checkpointer(model, process_group=alone, states={"counter": Counter(41)}) as ckpt:
            ckpt.save(Path(root) / "alone", 1, options=SaveOptions(trainable_only=True))
        out["alone_layout"] = json.loads((Path(root) / "alone" / "iter_0000001" / "metadata.json").read_text())["layout"]
    dist.barrier()
    # 3. per-rank states: each rank saves and restores its own
    counter = Counter(100 + rank)
    with Checkpointer(model, states={"counter": counter}) as ckpt:
        handle = ckpt.async_save(Path(root) / "states", 1, options=SaveOptions(trainable_only=True))
        counter.value = -1
        out["committed"] = str(handle.result())
        ckpt.load(Path(root) / "states")
    out["own"] = counter.value
    # 4. a checkpoint saved by one process: both ranks restore its (rank 0's) state, with one warning
    counter = Counter(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Checkpointer(model, states={"counter": counter}).load(single)
    out["borrowed"] = counter.value
    out["warnings"] = [str(w.message) for w in caught if "fewer ranks" in str(w.message)]
    # 5. the peers' lost-shard bug: a wrapper hides rank 1's piece of a sharded adapter from the state dict.
    # The save refuses before writing, naming the key, the region no rank holds and who holds the rest.
    tp = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    sharded = parallelize_module(nn.Sequential(nn.Linear(4, 8)), tp, {"0": ColwiseParallel()})
    with Checkpointer(sharded, mesh=tp) as ckpt:
        ckpt.save(Path(root) / "lost", 1, options=SaveOptions(trainable_only=True))
        original = api.model_entries

        def hiding(chunk: nn.Module) -> dict[str, Any]:
            entries = original(chunk)
            if rank == 1:
                entries["0.weight"].pieces = []
            return entries

        api.model_entries = hiding  # type: ignore[assignment]
        try:
            ckpt.save(Path(root) / "lost", 2, options=SaveOptions(trainable_only=True))
            out["lost"] = None
        except CheckpointError as e:
            out["lost"] = str(e)
        try:  # the same refused by a deferred async save: found in its own thread, raised by its handle
            handle = ckpt.async_save(Path(root) / "lost", 2, options=SaveOptions(trainable_only=True,
                                                                              defer_snapshot=True))
            handle.result()
            out["lost_async"] = None
        except CheckpointError as e:
            out["lost_async"] = str(e)
        finally:
            api.model_entries = original  # type: ignore[assignment]
        # ... and the next saves, laid out as the last committed one on every rank, reuse its plans
        ckpt.save(Path(root) / "lost", 3, options=SaveOptions(trainable_only=True))
        memo = ckpt._saves.last.plans if ckpt._saves.last is not None else None
        ckpt.save(Path(root) / "lost", 4, options=SaveOptions(trainable_only=True))
        out["reused"] = ckpt._saves.last is not None and ckpt._saves.last.plans is memo
    # 5b. a wrong fused-layout declaration (only rank 0 declares its weight fused): pieces that overlap
    torch.manual_seed(0)
    fused = parallelize_module(nn.Sequential(nn.Linear(4, 12)), tp, {"0": ColwiseParallel()})
    if rank == 0:
        declare_fused(fused[0], "weight", FusedChunks(dim=0, num_chunks=2))
    try:
        with Checkpointer(fused, mesh=tp) as ckpt:
            ckpt.save(Path(root) / "fused", 1)
        out["fused"] = None
    except CheckpointError as e:
        out["fused"] = str(e)
    out["lost_tracker"] = (Path(root) / "lost" / "latest_checkpointed_iteration.txt").read_text().strip()
    # 6. a state the checkpoint lacks: one agreed error on every rank
    try:
        Checkpointer(model, states={"counter": counter, "loader": Counter(0)}).load(Path(root) / "states")
        out["missing"] = None
    except CheckpointError as e:
        out["missing"] = str(e)
    return out


def test_mesh_layouts_process_groups_and_per_rank_states(tmp_path: Path) -> None:
    single = tmp_path / "single"
    Checkpointer(_model(), states={"counter": Counter(7)}).save(single, 1, options=SaveOptions(trainable_only=True))
    results = run_distributed(_worker, 2, str(tmp_path), str(single))
    for rank, r in enumerate(results):
        assert r["dp"] == ({"tp": 1, "pp": 1, "dp": 2, "vpp": 1}, {"tp": 0, "pp": 0, "dp": rank})
        assert r["dp/tp"] == ({"tp": 2, "pp": 1, "dp": 1, "vpp": 1}, {"tp": rank, "pp": 0, "dp": 0})
        assert r["pp/dp_shard"] == ({"tp": 1, "pp": 2, "dp": 1, "vpp": 1}, {"tp": 0, "pp": rank, "dp": 0})
        assert r["errors"] == [True, True]
        assert r["committed"] == str(tmp_path / "states" / "iter_0000001")
        assert r["own"] == 100 + rank
        assert r["borrowed"] == 7
        assert r["missing"] is not None and "holds no state for 'loader'" in r["missing"]
        assert r["lost"] is not None and "would not make a whole checkpoint, so nothing was written" in r["lost"]
        assert "'model.0.weight' (shape [8, 4]): no rank holds offsets [4, 0] size [4, 4] (held: rank(s) 0: " \
               "offsets [0, 0] size [4, 4]); a wrapper that hides a rank's shard" in r["lost"], r["lost"]
        assert r["lost_async"] is not None and "saving iteration 2 to " in r["lost_async"], r["lost_async"]
        assert "no rank holds offsets [4, 0] size [4, 4]" in r["lost_async"], r["lost_async"]
        assert r["fused"] is not None and "'model.0.weight': rank(s) 0 hold offsets [6, 0] size [3, 4] and rank(s) 1 " \
            "offsets [6, 0] size [6, 4]: they overlap without being the same piece" in r["fused"], r["fused"]
        assert not (tmp_path / "fused" / "latest_checkpointed_iteration.txt").exists()
        assert r["lost_tracker"] == "4" and not list((tmp_path / "lost").glob(".staging*"))
        assert r["reused"] is True
    torch.manual_seed(0)
    whole = nn.Linear(4, 8)
    stored = read_dcp_tensors(tmp_path / "lost" / "iter_0000004")
    torch.testing.assert_close(stored["model.0.weight"], whole.weight.detach(), rtol=0, atol=0)
    assert results[0]["alone_layout"] == {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
    assert len(results[0]["warnings"]) == 1 and results[1]["warnings"] == []
