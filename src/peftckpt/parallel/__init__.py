"""Parallel layout -> DeviceMesh, tensor-parallel primitives, pipeline runner, data parallelism.

Names are imported on first use (see :mod:`peftckpt._lazy`)."""

# ruff: noqa: F401 -- the TYPE_CHECKING imports re-export the lazy names to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .data_parallel import allreduce_gradients, clip_grad_norm, shard_for_distributed_optimizer
    from .dims import ParallelDims, ParallelMeshes, stage_layer_numbers
    from .pipeline import PipelineRunner
    from .tensor_parallel import TensorParallel, copy_to_tp, local_tensor, reduce_from_tp

_EXPORTS = {
    "allreduce_gradients": ".data_parallel", "clip_grad_norm": ".data_parallel",
    "shard_for_distributed_optimizer": ".data_parallel", "ParallelDims": ".dims", "ParallelMeshes": ".dims",
    "stage_layer_numbers": ".dims", "PipelineRunner": ".pipeline", "TensorParallel": ".tensor_parallel",
    "copy_to_tp": ".tensor_parallel", "local_tensor": ".tensor_parallel",
    "reduce_from_tp": ".tensor_parallel",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
