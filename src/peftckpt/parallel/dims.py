"""The parallel layout (TP, PP, DP, virtual stages) and the DeviceMesh it builds -- no globals."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .tensor_parallel import TensorParallel

__all__ = ["ParallelDims", "ParallelMeshes", "stage_layer_numbers"]


@dataclass(frozen=True)
class ParallelDims:
    """``world = pp * dp * tp``; ``vpp`` pipeline chunks per PP rank (1 = no interleaving)."""

    tp: int = 1
    """Tensor-parallel size (``--tensor-model-parallel-size``)."""
    pp: int = 1
    """Pipeline-parallel size (``--pipeline-model-parallel-size``)."""
    dp: int = 1
    """Data-parallel size: ``world / (tp * pp)``."""
    vpp: int = 1
    """Virtual pipeline chunks per PP rank (``num_layers / (pp * --num-layers-per-virtual-pipeline-stage)``)."""

    @classmethod
    def from_world(cls, world_size: int, tp: int, pp: int, vpp: int = 1) -> ParallelDims:
        """Derive DP from the world size; ``ValueError`` naming the flags if it does not divide."""
        if tp < 1 or pp < 1:
            raise ValueError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
        if world_size % (tp * pp):
            raise ValueError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
                f"--pipeline-model-parallel-size ({pp}); launch a multiple of {tp * pp} processes"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp), vpp=vpp)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all (``pp * vpp``)."""
        return self.pp * self.vpp

    def to_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "vpp": self.vpp}

    def build(self, device_type: str = "cpu") -> ParallelMeshes:
        """Build the ``(pp, dp, tp)`` mesh (TP fastest, as Megatron orders ranks). Needs a process group
        when the world has more than one rank."""
        if self.world_size == 1 and not dist.is_initialized():
            return ParallelMeshes(self, None)
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"layout {self.to_dict()} needs {self.world_size} ranks, got {dist.get_world_size()}")
        mesh = init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))
        return ParallelMeshes(self, mesh)


@dataclass(frozen=True)
class ParallelMeshes:
    """This rank's view of the layout: its coordinates and the sub-meshes / groups of each axis."""

    dims: ParallelDims
    mesh: DeviceMesh | None

    def _sub(self, axis: str) -> DeviceMesh | None:
        if self.mesh is None or self.dims.to_dict()[axis] == 1:
            return None
        return self.mesh[axis]

    def _rank(self, axis: str) -> int:
        if self.mesh is None:
            return 0
        return self.mesh.get_local_rank(axis)

    @property
    def tp(self) -> TensorParallel:
        return TensorParallel(self._sub("tp"))

    @property
    def tp_rank(self) -> int:
        return self._rank("tp")

    @property
    def pp_rank(self) -> int:
        return self._rank("pp")

    @property
    def dp_rank(self) -> int:
        return self._rank("dp")

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        return self._sub("pp")

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return self._sub("dp")

    def group(self, axis: str) -> dist.ProcessGroup | None:
        sub = self._sub(axis)
        return None if sub is None else sub.get_group()

    def embedding_group(self) -> dist.ProcessGroup | None:
        """The group of the first and the last pipeline rank of this rank's (dp, tp) position, which both hold
        the word embeddings when they are tied to the output layer (``None`` without pipeline parallelism).
        Collective: every rank creates every such group."""
        if self.mesh is None or self.dims.pp == 1:
            return None
        if self.dims.pp == 2:
            return self.group("pp")
        ranks = self.mesh.mesh  # [pp, dp, tp] -> global rank
        mine = None
        for d in range(self.dims.dp):
            for t in range(self.dims.tp):
                pair = [int(ranks[0, d, t]), int(ranks[-1, d, t])]
                group = dist.new_group(pair)
                if dist.get_rank() in pair:
                    mine = group
        return mine

    def stage_ids(self) -> list[int]:
        """Global pipeline stages held by this rank, in the looped order interleaved schedules expect."""
        return [self.pp_rank + i * self.dims.pp for i in range(self.dims.vpp)]


def stage_layer_numbers(num_layers: int, num_stages: int, stage: int) -> range:
    """Global layer numbers of pipeline stage ``stage`` (equal split; the caller validated divisibility)."""
    per = num_layers // num_stages
    return range(stage * per, (stage + 1) * per)
