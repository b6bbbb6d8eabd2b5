"""Issue 2 / must show 1: every layout computes the single-process loss and gradients (fp32, rtol 1e-5)."""

from __future__ import annotations

import pytest
import torch

from peftckpt.train.args import parse_train_args
from peftckpt.train.trainer import Trainer

from .common import TINY, global_tensor, randomize_lora_b
from .harness import run_distributed


def _step_and_grads(rank: int, world: int, argv: list[str], lora_b: bool) -> dict | None:
    torch.use_deterministic_algorithms(True)
    args = parse_train_args(argv, world)
    t = Trainer(args, world, rank)
    if lora_b:
        randomize_lora_b(t)
    loss0 = t.forward_backward(t.sampler.next_global_batch())
    grads = {}
    for chunk in t.chunks:
        for name, p in chunk.named_parameters():
            if p.requires_grad:
                assert p.grad is not None, name
                grads[name] = global_tensor(p.grad, name, chunk, t.dims.tp)
    t.optimizer.zero_grad(set_to_none=True)
    losses = [loss0] + [t.train_step()[0] for _ in range(2)]
    if t.meshes.tp_rank != 0 or t.meshes.dp_rank != 0:
        return None
    return {"losses": losses, "grads": grads}


def _merge(results: list[dict | None]) -> dict:
    merged: dict = {"losses": None, "grads": {}}
    for r in results:
        if r is None:
            continue
        merged["losses"] = merged["losses"] or r["losses"]
        assert r["losses"] == merged["losses"], "ranks disagree on the loss"
        merged["grads"].update(r["grads"])
    return merged


_REFERENCE: dict[tuple[str, ...], dict] = {}


def _reference(argv: list[str], lora_b: bool) -> dict:
    key = tuple(argv) + (str(lora_b),)
    if key not in _REFERENCE:
        _REFERENCE[key] = _step_and_grads(0, 1, argv, lora_b)  # type: ignore[assignment]
    return _REFERENCE[key]


CASES = [
    # (id, world, layout flags, model flags, lora)
    ("tp2-swiglu", 2, ["--tensor-model-parallel-size", "2"], [], False),
    ("tp2-gelu", 2, ["--tensor-model-parallel-size", "2"], ["--no-swiglu"], False),
    ("pp2-swiglu", 2, ["--pipeline-model-parallel-size", "2"], [], False),
    ("pp2-gelu", 2, ["--pipeline-model-parallel-size", "2"], ["--no-swiglu"], False),
    ("tp2pp2-swiglu", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], [], False),
    ("tp2pp2-gelu", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     ["--no-swiglu"], False),
    ("pp2-vpp2", 2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     [], False),
    ("dp2-distopt", 2, ["--use-distributed-optimizer"], [], False),
    # FSDP2 over DP on top of the TP mesh (2-D): frozen base, fused q/k/v and gate/up under both splits
    ("tp2dp2-distopt-lora", 4, ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
     ["--lora-rank", "4"], True),
    ("dp2-replicated-lora", 2, [], ["--lora-rank", "4"], True),
    ("tp2pp2-lora-swiglu", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     ["--lora-rank", "4"], True),
    # tied embeddings across stages: the first and the last stage sum their gradients; trained whole (no LoRA)
    ("tp2pp2-tied", 4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
     ["--no-untie-embeddings-and-output-weights"], False),
    ("pp2dp2-tied-distopt", 4, ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"],
     ["--no-untie-embeddings-and-output-weights"], False),
    # dropout masks: the row-parallel adapters' inputs are sharded, and each TP rank masks its slice of the
    # one mask a single process draws, so even with dropout on TP=2 computes what one process does
    ("tp2-lora-dropout", 2, ["--tensor-model-parallel-size", "2"],
     ["--lora-rank", "4", "--lora-dropout", "0.3", "--lora-target-modules", "linear_qkv", "linear_proj",
      "linear_fc1", "linear_fc2"], True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_layout_matches_single_process(case) -> None:  # type: ignore[no-untyped-def]
    _, world, layout, model, lora_b = case
    argv = TINY + model
    ref = _reference(argv, lora_b)
    got = _merge(run_distributed(_step_and_grads, world, argv + layout, lora_b))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    assert set(got["grads"]) == set(ref["grads"])
    assert ref["grads"], "no trainable parameter"
    for name, g in ref["grads"].items():
        assert g.abs().sum() > 0, f"reference gradient of {name} is zero: the check would be vacuous"
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def _dropout_masks(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    from peftckpt.model.linear import sharded_dropout
    from peftckpt.parallel.tensor_parallel import TensorParallel

    tp = TensorParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    torch.manual_seed(5)  # the trainer seeds every TP rank alike
    sharded = sharded_dropout(torch.ones(6, 16), 0.5, tp, training=True) != 0  # this rank's 16 of 32 features
    replicated = torch.nn.Dropout(0.5)(torch.ones(6, 32)) != 0
    return {"sharded": sharded, "replicated": replicated}


def test_dropout_masks_differ_across_tp_ranks_only_where_the_activation_is_sharded() -> None:
    from peftckpt.model.linear import sharded_dropout
    from peftckpt.parallel.tensor_parallel import TensorParallel

    first, second = run_distributed(_dropout_masks, 2)
    assert not torch.equal(first["sharded"], second["sharded"]), "TP ranks drew the same mask for other features"
    assert torch.equal(first["replicated"], second["replicated"]), "a replicated activation got different masks"
    torch.manual_seed(5)
    one_process = sharded_dropout(torch.ones(6, 32), 0.5, TensorParallel(), training=True) != 0
    assert torch.equal(torch.cat([first["sharded"], second["sharded"]], dim=-1), one_process)
    assert 0.3 < one_process.float().mean() < 0.7
