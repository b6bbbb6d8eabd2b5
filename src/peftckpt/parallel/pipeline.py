"""Pipeline parallelism on ``torch.distributed.pipelining``: stages and their schedule."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torch.distributed.pipelining.stage import _PipelineStageBase

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """Runs one global batch through this rank's pipeline chunks (1F1B, or interleaved 1F1B for vpp > 1).

    Gradients of the chunks' parameters are accumulated over the micro-batches and scaled by
    ``1 / num_microbatches`` (the schedule's ``scale_grads``), so with a mean loss they equal the
    gradient of the mean loss over the whole batch -- what a single process computes.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        stage_ids: Sequence[int],
        num_stages: int,
        pp_group: dist.ProcessGroup,
        num_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
    ):
        self.stage_ids = list(stage_ids)
        self.is_first = 0 in self.stage_ids
        self.is_last = (num_stages - 1) in self.stage_ids
        stages = [
            PipelineStage(chunk, sid, num_stages, device, group=pp_group) for chunk, sid in zip(chunks, stage_ids)
        ]
        self.schedule: _PipelineSchedule
        if len(stages) == 1:
            self.schedule = Schedule1F1B(stages[0], num_microbatches, loss_fn=loss_fn)
        else:
            self.schedule = ScheduleInterleaved1F1B(cast(list[_PipelineStageBase], stages), num_microbatches,
                                                    loss_fn=loss_fn)

    def _run(self, tokens: torch.Tensor, targets: torch.Tensor, train: bool) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.is_first else ()
        kwargs: dict[str, Any] = {"target": targets, "losses": losses} if self.is_last else {}
        if train:
            self.schedule.step(*args, **kwargs)
        else:
            self.schedule.eval(*args, **kwargs)
        if not self.is_last:
            return None
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def train_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward + backward of one batch; the mean micro-batch loss on the last stage, else ``None``."""
        return self._run(tokens, targets, train=True)

    @torch.no_grad()
    def eval_step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward only; the mean loss on the last stage, else ``None``."""
        return self._run(tokens, targets, train=False)
