"""Issue 3 / must show 2: save at each (tp, pp, dp[, vpp]) layout, load at every other.

After a load, model and optimizer state equal the saved global tensors exactly, and one more training
step gives the loss the saving run computed for that step (fp tolerance: the layouts sum differently).
Grouped so that all saves and loads of one world size share one spawn.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peftckpt.checkpoint.storage.manifest import read_manifest
from peftckpt.train.args import parse_train_args
from peftckpt.train.trainer import Trainer

from .common import TINY, canonical_state, merge_states, reports_state
from .harness import run_distributed

LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tp1pp1dp1": (1, []),
    "tp2pp1dp1": (2, ["--tensor-model-parallel-size", "2"]),
    "tp1pp2dp1": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2pp2dp1": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    "tp1pp1dp2": (2, ["--use-distributed-optimizer"]),
    "tp1pp2vpp2": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
}
ARGV = TINY + ["--train-iters", "3"]
LORA = ["--lora-rank", "4", "--save-trainable-params-only"]
# Adapter-only checkpoints between FSDP2 over DP on top of TP (2-D) and one process, both ways (the base comes
# from the same deterministic initialisation).
LORA_LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "lora-tp1pp1dp1": (1, LORA),
    "lora-tp2dp2-distopt": (4, [*LORA, "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]),
}
TIED = ["--no-untie-embeddings-and-output-weights"]
TIED_LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tied-pp2": (2, [*TIED, "--pipeline-model-parallel-size", "2"]),
    "tied-dp2": (2, TIED),
}


def _flags(name: str) -> list[str]:
    return {**LAYOUTS, **LORA_LAYOUTS, **TIED_LAYOUTS}[name][1]


def _save(name: str, root: Path, rank: int, world: int) -> dict:
    """Train 2 steps, save, train a 3rd: return the saved global state and the 3rd loss."""
    argv = ARGV + _flags(name) + ["--save", str(root / name), "--save-interval", "2"]
    t = Trainer(parse_train_args(argv, world), world, rank)
    from peftckpt.train.checkpointing import TrainerCheckpointing

    ckpt = TrainerCheckpointing(t)
    t.train_step()
    t.train_step()
    ckpt.save()
    state = canonical_state(t)
    next_loss = t.train_step()[0]
    return {"state": state if reports_state(t) else None, "next_loss": next_loss}


def _load(name: str, source: str, root: Path, rank: int, world: int) -> dict:
    argv = ARGV + _flags(name) + ["--load", str(root / source)]
    t = Trainer(parse_train_args(argv, world), world, rank)
    from peftckpt.train.checkpointing import TrainerCheckpointing

    TrainerCheckpointing(t).restore()
    state = canonical_state(t)
    return {"state": state if reports_state(t) else None, "iteration": t.iteration,
            "next_loss": t.train_step()[0]}


def _worker(rank: int, world: int, root: str, saves: list[str], loads: list[tuple[str, str]]) -> dict:
    out: dict = {"saved": {}, "loaded": {}}
    for name in saves:
        out["saved"][name] = _save(name, Path(root), rank, world)
    for name, source in loads:
        out["loaded"][(name, source)] = _load(name, source, Path(root), rank, world)
    return out


def _collect(results: list[dict], saved: dict, loaded: dict) -> None:
    for kind, target in (("saved", saved), ("loaded", loaded)):
        for key in results[0][kind]:
            target[key] = {"state": merge_states([r[kind][key]["state"] for r in results]),
                           "next_loss": results[0][kind][key]["next_loss"],
                           "iteration": results[0][kind][key].get("iteration")}


def _run(world: int, root: Path, saves: list[str], loads: list[tuple[str, str]], saved: dict, loaded: dict) -> None:
    if world == 1:
        results = [_worker(0, 1, str(root), saves, loads)]
    else:
        results = run_distributed(_worker, world, str(root), saves, loads)
    _collect(results, saved, loaded)


def test_reshard_matrix(tmp_path: Path) -> None:
    by_world: dict[int, list[str]] = {}
    for name, (world, _) in LAYOUTS.items():
        by_world.setdefault(world, []).append(name)
    saved: dict = {}
    loaded: dict = {}
    pairs = [(dst, src) for dst in LAYOUTS for src in LAYOUTS if dst != src]
    lora_pairs = [(dst, src) for dst in LORA_LAYOUTS for src in LORA_LAYOUTS if dst != src]
    world_of = {name: world for name, (world, _) in {**LAYOUTS, **LORA_LAYOUTS}.items()}
    lora = {w: [n for n in LORA_LAYOUTS if world_of[n] == w] for w in (1, 4)}
    # Order the spawns so that every load finds its checkpoint: 1 (save), 4 (save), 2 (save + load all),
    # 1 (load all), 4 (load all).
    _run(1, tmp_path, by_world[1] + lora[1], [], saved, loaded)
    _run(4, tmp_path, by_world[4] + lora[4], [], saved, loaded)
    _run(2, tmp_path, by_world[2], [p for p in pairs if world_of[p[0]] == 2], saved, loaded)
    _run(1, tmp_path, [], [p for p in pairs + lora_pairs if world_of[p[0]] == 1], saved, loaded)
    _run(4, tmp_path, [], [p for p in pairs + lora_pairs if world_of[p[0]] == 4], saved, loaded)
    assert len(loaded) == len(pairs) + len(lora_pairs) == 32
    for family in (LAYOUTS, LORA_LAYOUTS):
        reference = saved[next(iter(family))]["state"]
        for name in family:
            assert set(saved[name]["state"]) == set(reference), name
    for (dst, src), got in loaded.items():
        want = saved[src]
        assert got["iteration"] == 2, (dst, src)
        assert set(got["state"]) == set(want["state"]), (dst, src)
        bad = [k for k, v in want["state"].items() if not torch.equal(got["state"][k], v)]
        assert not bad, f"load at {dst} of a checkpoint saved at {src}: {bad[:5]} differ"
        assert got["next_loss"] == pytest.approx(want["next_loss"], rel=1e-5), (dst, src)
    for name in LORA_LAYOUTS:
        manifest = read_manifest(tmp_path / name / "iter_0000002")
        assert manifest.trainable_only and manifest.excluded_keys, name


def test_tied_embeddings_across_stages_are_saved_once_and_reshard(tmp_path: Path) -> None:
    """The first and the last stage both hold the tied table: the checkpoint stores it once, and it loads at
    PP=1 (one holder) and back."""
    from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata

    saved: dict = {}
    loaded: dict = {}
    _run(2, tmp_path, list(TIED_LAYOUTS), [("tied-dp2", "tied-pp2"), ("tied-pp2", "tied-dp2")], saved, loaded)
    key = "model.embedding.word_embeddings.weight"
    for name in TIED_LAYOUTS:
        metadata = load_dcp_metadata(tmp_path / name / "iter_0000002" / ".metadata").state_dict_metadata
        assert len(metadata[key].chunks) == 1, (name, metadata[key].chunks)  # written by one rank, whole
        assert not any("output_layer" in k for k in metadata), name
    assert set(saved["tied-pp2"]["state"]) == set(saved["tied-dp2"]["state"])
    for (dst, src), got in loaded.items():
        want = saved[src]
        assert got["iteration"] == 2 and set(got["state"]) == set(want["state"]), (dst, src)
        bad = [k for k, v in want["state"].items() if not torch.equal(got["state"][k], v)]
        assert not bad, f"load at {dst} of a checkpoint saved at {src}: {bad[:5]} differ"
        assert got["next_loss"] == pytest.approx(want["next_loss"], rel=1e-5), (dst, src)
