"""The vocabulary split over tensor parallelism: the word embeddings, the output layer and the loss.

The ``[vocab, hidden]`` table is sharded on its rows like any ``Shard(0)`` parameter (``torch.chunk``
semantics: the first ranks hold ``ceil(vocab / tp)`` rows, the last the rest), so no TP rank holds the whole
table and a checkpoint still stores the one global table, at any TP.

* Lookup (:func:`vocab_parallel_embedding`): each rank looks up the tokens of its rows, zeros for the others;
  an all-reduce over TP sums the ranks' parts (Megatron's ``VocabParallelEmbedding``).
* Output layer: a column-parallel GEMM; each rank computes the logits of its rows only.
* Loss (:func:`vocab_parallel_cross_entropy`): the softmax over the whole vocabulary from three all-reduces of
  per-token scalars (max, sum of exponentials, the target's logit): the ``[tokens, vocab]`` logits are never
  gathered.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..parallel.tensor_parallel import TensorParallel, reduce_from_tp

__all__ = ["vocab_range", "vocab_parallel_embedding", "vocab_parallel_cross_entropy"]


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary rows this TP rank holds (``torch.chunk`` semantics)."""
    per = -(-vocab_size // tp.size)
    start = min(tp.rank * per, vocab_size)
    return start, min(start + per, vocab_size)


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, tp: TensorParallel,
                             vocab_size: int) -> torch.Tensor:
    """Embeddings of ``tokens`` from this rank's rows ``weight`` of the ``vocab_size``-row table, summed
    over TP (every rank gets the whole result)."""
    if tp.size == 1:
        return F.embedding(tokens, weight)
    start, end = vocab_range(vocab_size, tp)
    elsewhere = (tokens < start) | (tokens >= end)
    out = F.embedding((tokens - start).masked_fill(elsewhere, 0), weight)
    return reduce_from_tp(out.masked_fill(elsewhere.unsqueeze(-1), 0.0), tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, start: int
                ) -> torch.Tensor:
        x = logits.float()
        top = x.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        x = x - top.unsqueeze(-1)
        n = x.shape[-1]
        local = targets - start
        mine = (local >= 0) & (local < n)
        index = local.clamp(0, max(n - 1, 0)).unsqueeze(-1)
        target_logit = torch.where(mine, x.gather(-1, index).squeeze(-1), 0.0)
        exp = x.exp()
        total = exp.sum(dim=-1)
        both = torch.stack([target_logit, total])  # one all-reduce for the two sums
        dist.all_reduce(both, group=group)
        target_logit, total = both[0], both[1]
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), mine, index)
        ctx.dtype = logits.dtype
        return total.log() - target_logit

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, mine, index = ctx.saved_tensors
        # d(loss)/d(logits) = softmax - one_hot(target) on this rank's columns (out of place: the saved softmax
        # stays valid for a second backward)
        grad = softmax.scatter_add(-1, index, -mine.to(softmax.dtype).unsqueeze(-1))
        return grad.mul_(grads[0].unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TensorParallel,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token cross entropy (fp32) of this rank's logit columns ``logits`` ``[..., rows]`` of the
    ``vocab_size``-way softmax, against global token ids ``targets`` ``[...]``; the same on every TP rank."""
    if tp.size == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none").view_as(targets)
    return _VocabParallelCrossEntropy.apply(  # type: ignore[no-any-return]
        logits, targets, tp.group, vocab_range(vocab_size, tp)[0])
