"""DCP planners that resolve :class:`~peftckpt.sharding.entries.GlobalTensor` pieces.

DCP's default planners only look up sharded pieces inside ``torch.Tensor`` subclasses; these two also
look inside our entries. Everything else (planning, dedup of replicated pieces, resharding) is DCP's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from ...sharding.entries import GlobalTensor, LazyGlobalTensor

__all__ = ["EntrySavePlanner", "EntryLoadPlanner"]


class EntrySavePlanner(DefaultSavePlanner):
    def __init__(self, on_item: Callable[[], None] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._on_item = on_item
        """Called as each item is fetched for writing (fault injection)."""
        self._streamed: torch.Tensor | None = None
        """The tensor a lazy entry produced for the item being written (see :meth:`_release_streamed`)."""

    def resolve_data(self, write_item: WriteItem) -> Any:
        # The pieces of an entry as they are (DCP's default looks them up and "transforms" every item).
        obj = self.state_dict.get(write_item.index.fqn)
        if type(obj) is GlobalTensor:
            if self._on_item is not None:
                self._on_item()
            self._release_streamed()
            return obj.__get_tensor_shard__(write_item.index)
        return super().resolve_data(write_item)

    def streams(self) -> bool:
        """Some entry produces its tensor only when written (a :class:`LazyGlobalTensor`): its items must be
        resolved one at a time, each written before the next is asked for."""
        return any(type(v) is LazyGlobalTensor for v in self.state_dict.values())

    def lookup_object(self, index: MetadataIndex) -> Any:
        if self._on_item is not None:
            self._on_item()
        self._release_streamed()
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, LazyGlobalTensor):
            self._streamed = obj.__get_tensor_shard__(index)
            return self._streamed
        if isinstance(obj, GlobalTensor):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)

    def _release_streamed(self) -> None:
        """Free the tensor the previous lazy entry produced: DCP's serial loader asks for the next item only
        once the previous one is written, but its writer keeps every tensor of a file referenced until the file
        is closed (``tensor_dict``, used only for its safetensors format), which would hold a whole streamed
        model. The reference it keeps then points at empty storage that nothing reads again."""
        if self._streamed is not None:
            storage = self._streamed.untyped_storage()
            if storage.resizable():  # (a tensor over a file's mapped memory is not: dropping it releases it)
                storage.resize_(0)
            self._streamed = None


class EntryLoadPlanner(DefaultLoadPlanner):
    def __init__(self, on_piece: Callable[[str, tuple[int, ...], torch.Tensor], None] | None = None) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._on_piece = on_piece
        """Called with ``(key, offsets, tensor)`` as each piece of an entry has received all its values."""
        self._unread: dict[tuple[str, tuple[int, ...]], int] = {}
        """Elements each piece still waits for (a piece may be read from several stored chunks)."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        # The default first runs `_init_state_dict`, which rebuilds every value it does not recognise as
        # None (it materialises meta tensors). Our request is flat, on real storage: use it as is.
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def set_object(self, read_item: ReadItem, obj: Any) -> None:
        """An object item, already loaded (safely, by the reader): what ``load_bytes`` would set, without
        serialising it again to hand it over."""
        self.state_dict[read_item.dest_index.fqn] = obj

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, GlobalTensor):
            return obj.__get_tensor_shard__(index)
        return super().lookup_tensor(index)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        index = read_item.dest_index
        if self._on_piece is None or not isinstance(self.state_dict.get(index.fqn), GlobalTensor):
            return
        key = (index.fqn, tuple(index.offset or ()))
        piece = self.lookup_tensor(index)
        left = self._unread.get(key, piece.numel()) - math.prod(read_item.lengths)
        self._unread[key] = left
        if left == 0:
            self._on_piece(index.fqn, key[1], piece)
