"""DCP planners that resolve :class:`~peftckpt.sharding.entries.GlobalTensor` pieces.

DCP's default planners only look up sharded pieces inside ``torch.Tensor`` subclasses; these two also
look inside our entries. Everything else (planning, dedup of replicated pieces, resharding) is DCP's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ..sharding.entries import GlobalTensor

__all__ = ["EntrySavePlanner", "EntryLoadPlanner"]


class EntrySavePlanner(DefaultSavePlanner):
    def __init__(self, on_item: Callable[[], None] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._on_item = on_item
        """Called as each item is fetched for writing (fault injection)."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        if self._on_item is not None:
            self._on_item()
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, GlobalTensor):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)


class EntryLoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # The default first runs `_init_state_dict`, which rebuilds every value it does not recognise as
        # None (it materialises meta tensors). Our request is flat, on real storage: use it as is.
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, GlobalTensor):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)
