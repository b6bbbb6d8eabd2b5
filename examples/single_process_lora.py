"""The library in a plain single-process training loop (no torchrun, no process group): a frozen base with LoRA
adapters, AdamW, an LR schedule and a data loader, checkpointed trainable-only by peftckpt and resumed exactly.

    python examples/single_process_lora.py --workdir /tmp/lora-one --steps 12 --stop-at 7
    python examples/single_process_lora.py --workdir /tmp/lora-one --steps 12

The first command stops after step 7, as a preempted job would (its last checkpoint is step 6); the second
resumes from step 6 and finishes. The losses it prints for steps 7-12 are those of a run never interrupted, bit
for bit: adapters, Adam moments, the schedule, the data position and the RNG all come back. Each checkpoint
holds the adapters and their optimizer state only (the frozen base is recorded by its fingerprint, and a load
onto another base is refused).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from peftckpt import Checkpointer, CheckpointNotFoundError, SaveOptions

VOCAB, DIM, RANK, LAYERS, SEQ, BATCH = 512, 256, 8, 2, 32, 8


class LoRALinear(nn.Module):
    """A frozen linear plus a trainable low-rank update ``B(A(dropout(x)))``, scaled by ``alpha / rank``."""

    def __init__(self, features: int, rank: int = RANK, alpha: float = 16.0) -> None:
        super().__init__()
        self.base = nn.Linear(features, features).requires_grad_(False)
        self.lora_a = nn.Linear(features, rank, bias=False)
        self.lora_b = nn.Linear(rank, features, bias=False)
        nn.init.zeros_(self.lora_b.weight)  # starts as the base model, as LoRA does
        self.dropout = nn.Dropout(0.1)  # random: an exact resume needs the RNG back too
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * self.lora_b(self.lora_a(self.dropout(x)))


class TinyLM(nn.Module):
    """A frozen embedding, residual blocks of LoRA linears, a frozen output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM).requires_grad_(False)
        self.blocks = nn.ModuleList(LoRALinear(DIM) for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False).requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(x)


class Batches:
    """A deterministic stream of token batches whose position is checkpointed (``state_dict``/``load_state_dict``:
    any object with both can go in ``states``). Each sequence counts up in steps of 3 from a random start, with
    one token in eight replaced at random: something to learn, never learned exactly."""

    def __init__(self, seed: int = 1234) -> None:
        self.seed, self.position = seed, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + self.position)
        self.position += 1
        tokens = (torch.randint(0, VOCAB, (BATCH, 1), generator=g) + 3 * torch.arange(SEQ + 1)) % VOCAB
        noise = torch.rand(BATCH, SEQ + 1, generator=g) < 0.125
        return torch.where(noise, torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g), tokens)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed, self.position = int(state["seed"]), int(state["position"])


def build() -> TinyLM:
    """The base is the same on every call (seed 0): a real run loads its pretrained weights here."""
    torch.manual_seed(0)
    return TinyLM()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, data: Batches) -> float:
    tokens = data.next()
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    scheduler.step()
    return loss.item()


def train(workdir: str, steps: int, save_every: int = 2, stop_at: int | None = None) -> dict[int, float]:
    """Train to ``steps`` (resuming from the newest checkpoint in ``workdir`` if there is one), saving every
    ``save_every`` steps; stop after ``stop_at`` if given. Returns the loss of each step this call ran."""
    model = build()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    data = Batches()
    losses: dict[int, float] = {}

    with Checkpointer(model, optimizer, states={"lr_scheduler": scheduler, "data": data}) as ckpt:
        try:  # resume: adapters, Adam moments, schedule, data position, RNG
            start = ckpt.load(workdir).iteration
        except CheckpointNotFoundError:
            start = 0
        for step in range(start + 1, steps + 1):
            losses[step] = train_step(model, optimizer, scheduler, data)
            if step % save_every == 0:
                ckpt.save(workdir, iteration=step, options=SaveOptions(trainable_only=True))
            if step == stop_at:
                break
    return losses


def checkpoint_bytes(workdir: str) -> dict[str, int]:
    """Bytes on disk of each committed checkpoint ``iter_*`` in ``workdir``."""
    return {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            for d in sorted(Path(workdir).glob("iter_*")) if d.is_dir()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="where the checkpoints go (a directory or s3://...)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--stop-at", type=int, default=None, help="stop after this step (a preemption)")
    args = parser.parse_args()
    losses = train(args.workdir, args.steps, args.save_every, args.stop_at)
    for step, loss in losses.items():
        print(f"step {step:3d}  loss {loss:.6f}")
    if losses and "://" not in args.workdir:
        sizes = checkpoint_bytes(args.workdir)
        base = sum(p.numel() * p.element_size() for p in build().parameters())
        print(f"{len(sizes)} checkpoint(s) in {args.workdir}, newest {max(sizes.values()) / 1024:.0f} KiB "
              f"(the model's weights alone are {base / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
