"""What a checkpointer checkpoints on this rank: model chunks, optimizer, states, the parallel layout, the group.

:class:`RankParts` is shared by the save (:mod:`~peftckpt.checkpoint.save`) and the load
(:mod:`~peftckpt.checkpoint.load`): the model's sections, this rank's state to write or request, and the base
fingerprint, cached until a load changes the base.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..sharding.entries import GlobalTensor
from .collectives import Collectives
from .parallel_layout import parallel_layout
from .state.builder import RankState, build_state
from .state.fingerprint import FINGERPRINT_VERSION, base_fingerprint
from .state.sections import dcp_key, model_entries, model_section_names

__all__ = ["RankParts"]


class RankParts:
    """This rank's model ``chunks``, ``optimizer`` and ``states``, its place in the parallel layout, and the
    group every checkpointer call is collective over (see :class:`~peftckpt.checkpoint.api.Checkpointer`)."""

    def __init__(self, model: nn.Module | Sequence[nn.Module], optimizer: torch.optim.Optimizer | None,
                 mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None,
                 states: Mapping[str, Any] | None, model_config: Mapping[str, Any] | None,
                 adapter_config: Mapping[str, Any] | None, layout: Mapping[str, int] | None,
                 coords: Mapping[str, int] | None):
        self.chunks = [model] if isinstance(model, nn.Module) else list(model)
        self.optimizer = optimizer
        self.comm = Collectives(process_group)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.layout, self.coords = parallel_layout(self.comm, len(self.chunks), mesh, layout, coords)
        self.states = dict(states or {})
        for name, obj in self.states.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"states[{name!r}] ({type(obj).__name__}) has no state_dict/load_state_dict")
        self.model_config = dict(model_config or {})
        self.adapter_config = None if adapter_config is None else dict(adapter_config)
        self.fingerprints: dict[int, str] = {}
        """The fingerprint of the frozen parameters, per version (the base changes only through a load)."""
        self.base_sums: dict[str, list[int]] = {}
        """The per-key sums of :data:`FINGERPRINT_VERSION` behind ``fingerprints``, where a base load took them (a
        full save records them, so that a load of it as a base need not sum its bytes again)."""

    def base_changed(self) -> None:
        """The frozen parameters changed (a load, a quantization): what was taken of them is dropped."""
        self.fingerprints.clear()
        self.base_sums = {}

    def model_sections(self) -> dict[str, dict[str, Any]]:
        return {name: model_entries(c) for name, c in zip(model_section_names(len(self.chunks)), self.chunks)}

    def fingerprint(self, keys: Sequence[str] | None = None, version: int = FINGERPRINT_VERSION) -> str:
        """Layout-independent fingerprint of the frozen model parameters (or of the model tensors named by
        ``keys``), as ``version`` computes it; the default set is computed once per version, then cached."""
        if keys is None and version in self.fingerprints:
            return self.fingerprints[version]
        tensors = {dcp_key(s, k): v for s, sec in self.model_sections().items() for k, v in sec.items()
                   if isinstance(v, GlobalTensor)}
        frozen_now = {k for k, v in tensors.items() if v.frozen}
        if keys is not None and set(keys) == frozen_now:
            keys = None  # the same set as the default: share the cached value (computed at most once per run)
            if version in self.fingerprints:
                return self.fingerprints[version]
        wanted = frozen_now if keys is None else set(keys)
        value = base_fingerprint({k: v for k, v in tensors.items() if k in wanted}, self.comm.distributed, version,
                                 self.comm.group)
        if keys is None:
            self.fingerprints[version] = value
        return value

    def build(self, trainable_only: bool, with_optim: bool, objects: Mapping[str, Any] | None = None,
              with_rng: bool = False, sections: dict[str, dict[str, Any]] | None = None,
              rng: dict[str, Any] | None = None) -> RankState:
        """This rank's state (:func:`~peftckpt.checkpoint.state.builder.build_state`): what a save writes, and
        (its tensors) what a load of the same kind requests (``sections``: the model sections, if at hand;
        ``rng``: the RNG state to save, if taken earlier by :func:`~peftckpt.checkpoint.state.sections.take_rng`)."""
        return build_state(self.model_sections() if sections is None else sections, self.optimizer, self.chunks,
                           self.rank, trainable_only=trainable_only, with_optim=with_optim, objects=objects,
                           with_rng=with_rng, rng=rng)
