"""A tiny trained model + optimizer behind a single-process Checkpointer, shared by the checkpoint unit tests."""

from __future__ import annotations

import torch
from torch import nn

from peftckpt.checkpoint.api import Checkpointer

LAYOUT = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
COORDS = {"tp": 0, "pp": 0, "dp": 0}


def small_checkpointer(seed: int = 0) -> tuple[Checkpointer, nn.Module]:
    """Linear-LayerNorm-Linear after one AdamW step (so every optimizer state exists), seeded by ``seed``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return Checkpointer([model], opt, layout=LAYOUT, coords=COORDS, model_config={"width": 64}), model
