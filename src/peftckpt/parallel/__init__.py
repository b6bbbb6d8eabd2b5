"""Parallel layout -> DeviceMesh, tensor-parallel primitives, pipeline runner, data parallelism."""

from .data_parallel import allreduce_gradients, clip_grad_norm, shard_for_distributed_optimizer
from .dims import ParallelDims, ParallelMeshes, stage_layer_numbers
from .pipeline import PipelineRunner
from .tensor_parallel import TensorParallel, copy_to_tp, local_tensor, reduce_from_tp

__all__ = [
    "allreduce_gradients", "clip_grad_norm", "shard_for_distributed_optimizer", "ParallelDims", "ParallelMeshes",
    "stage_layer_numbers", "PipelineRunner", "TensorParallel", "copy_to_tp", "local_tensor", "reduce_from_tp",
]
