"""Vocab-parallel embedding, output layer and loss at TP=2 against the replicated (one-process) model: the
gathered logits, the loss and the gradient the loss sends back (fp32, rtol 1e-6), for tied and untied
embeddings and a vocabulary TP does not divide; no rank holds the whole table."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from peftckpt.model.config import GPTConfig
from peftckpt.model.gpt import GPTModel, gpt_loss
from peftckpt.parallel.tensor_parallel import TensorParallel, local_tensor

from .harness import run_distributed

CONFIGS = {
    "untied": GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=64, vocab_size=128, max_position_embeddings=16),
}
CONFIGS["tied-odd-vocab"] = dataclasses.replace(CONFIGS["untied"], vocab_size=131,
                                                untie_embeddings_and_output_weights=False)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, vocab, (3, 13), generator=torch.Generator().manual_seed(0))
    return data[:, :-1], data[:, 1:]


def _run(model: GPTModel, tp: TensorParallel, vocab: int) -> dict[str, torch.Tensor]:
    tokens, targets = _batch(vocab)
    logits = model(tokens)
    logits.retain_grad()
    loss = gpt_loss(logits, targets, tp, vocab)
    loss.backward()
    return {"logits": logits.detach(), "loss": loss.detach(), "dlogits": logits.grad}


def _tp2(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    tp = TensorParallel(init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    out = {}
    for name, config in CONFIGS.items():
        model = GPTModel(config, tp, seed=3)
        table = local_tensor(model.embedding.word_embeddings.weight)  # type: ignore[union-attr]
        got = _run(model, tp, config.vocab_size)
        for key in ("logits", "dlogits"):  # this rank's vocabulary columns -> all of them
            parts: list[torch.Tensor] = [torch.empty(0)] * world
            dist.all_gather_object(parts, got[key])
            got[key] = torch.cat(parts, dim=-1)
        got["table_rows"] = torch.tensor(table.shape[0])
        out[name] = got
    return out


def test_vocab_parallel_logits_loss_and_gradient_equal_the_replicated_ones() -> None:
    results = run_distributed(_tp2, 2)
    for name, config in CONFIGS.items():
        want = _run(GPTModel(config, seed=3), TensorParallel(), config.vocab_size)
        rows = [r[name]["table_rows"].item() for r in results]
        assert rows == [-(-config.vocab_size // 2), config.vocab_size // 2], (name, rows)  # split, not replicated
        for r in results:
            got = r[name]
            for key in ("logits", "loss", "dlogits"):
                torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7,
                                           msg=lambda m, k=key, n=name: f"{n} {k}: {m}")
