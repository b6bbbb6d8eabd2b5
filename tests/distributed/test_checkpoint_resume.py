"""Issue 3 / must show 1: 8 iterations straight == 4 + save + resume 4, bit for bit, at TP x PP in {1,2}^2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peftckpt.train.args import parse_train_args
from peftckpt.train.trainer import Trainer

from .common import TINY
from .harness import run_distributed


def _local_state(t: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for i, chunk in enumerate(t.chunks):
        for name, p in chunk.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            out[f"{i}.{name}"] = local.detach().clone()
            for stat, v in t.optimizer.state[p].items():
                out[f"{i}.{name}.{stat}"] = (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
    return out


def _resume_worker(rank: int, world: int, argv: list[str], root: str) -> dict:
    torch.use_deterministic_algorithms(True)
    save = str(Path(root) / "ckpt")
    straight = Trainer(parse_train_args(argv, world), world, rank)
    losses = straight.run()
    first = Trainer(parse_train_args(argv + ["--save", save, "--exit-interval", "4"], world), world, rank)
    first_losses = first.run()
    resumed = Trainer(parse_train_args(argv + ["--load", save], world), world, rank)
    resumed_losses = resumed.run()
    a, b = _local_state(straight), _local_state(resumed)
    return {
        "losses": losses, "first": first_losses, "resumed": resumed_losses, "start": resumed.iteration,
        "keys_equal": sorted(a) == sorted(b),
        "diff": [k for k in a if not torch.equal(a[k], b[k])],
        "num_tensors": len(a),
        "num_moments": sum(1 for k in a if k.endswith("exp_avg_sq")),
    }


# LoRA with dropout (masks on sharded and replicated activations, drawn from the restored RNG) and evaluations
# between the steps (which draw nothing) at TP=2; full training elsewhere.
DROPOUT = ["--lora-rank", "4", "--lora-dropout", "0.3", "--eval-interval", "3", "--eval-iters", "1"]
LAYOUTS = [(1, 1, []), (2, 1, DROPOUT), (1, 2, []), (2, 2, [])]


@pytest.mark.parametrize("tp,pp,extra", LAYOUTS, ids=[f"tp{t}pp{p}" + ("-lora-dropout" if e else "")
                                                      for t, p, e in LAYOUTS])
def test_resume_is_bit_exact(tp: int, pp: int, extra: list[str], tmp_path: Path) -> None:
    argv = TINY + extra + ["--train-iters", "8", "--tensor-model-parallel-size", str(tp),
                           "--pipeline-model-parallel-size", str(pp)]
    results = run_distributed(_resume_worker, tp * pp, argv, str(tmp_path))
    for r in results:
        assert len(r["losses"]) == 8 and len(r["first"]) == 4 and len(r["resumed"]) == 4
        assert r["first"] == r["losses"][:4]
        assert r["resumed"] == r["losses"][4:], "losses after resume differ from the uninterrupted run"
        assert r["keys_equal"] and r["num_moments"] > 0
        assert r["diff"] == [], f"weights / Adam moments differ after resume: {r['diff'][:5]}"
