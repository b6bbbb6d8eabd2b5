"""What a save's layout determined, kept for the next save laid out the same way.

A training run saves the same entries -- the same keys, global shapes, dtypes and pieces on every rank -- at
every checkpoint; only the values change. Everything DCP and the commit derive from the layout alone is then the
same as last time: the ranks' gathered pieces and their tiling check, DCP's local and global plans (deduplication
of replicated pieces included) and its metadata of the entries, and the commit's checks of those entries. At one
checkpoint per step, recomputing them cost more than writing an adapter's bytes (two thirds of a 2688-tensor
trainable-only save).

A :class:`PlanMemo` holds them. A save reuses the last one's only where every rank agrees its layout equals the
last save's (:func:`layout_of`, compared on each rank, then one ``all_true``) and the last save was committed;
otherwise it starts an empty one that the save fills in as it goes. What a save writes and checks of its *data* --
every byte, the files' checksums and digests, every storage item's range inside its file -- is never reused
(an item written where the last save wrote it keeps that save's record of its place, which is the same). The
commit compares the storage items' ranges, the files' sizes and the key records with those the last save was
found whole with: where all are equal, so is the verdict of the per-item checks, and only the files themselves
are examined again (each holds its recorded bytes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ...sharding.entries import GlobalTensor
from ..checks.integrity import StoredStructure
from .framed_layout import FramedLayout
from .metadata_pickle import MetadataPickler

__all__ = ["PlanMemo", "WholeRecord", "layout_of"]


def layout_of(flat: Mapping[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """This rank's layout of a save's entries, as two parts: ``{key: (global shape, [(offsets, sizes), ...])}``
    of its global tensors (what the ranks gather for the tiling check) and, per entry, what else DCP plans
    with: a global tensor's dtype, a plain tensor's shape and dtype, an object's type."""
    pieces: dict[str, Any] = {}
    rest: list[Any] = []
    for key, value in flat.items():
        if isinstance(value, GlobalTensor):
            pieces[key] = (list(value.global_shape), [(list(p.offsets), list(p.tensor.shape)) for p in value.pieces])
            rest.append((key, value.dtype))
        elif isinstance(value, torch.Tensor):
            rest.append((key, value.dtype, tuple(value.shape), type(value)))
        else:
            rest.append((key, type(value)))
    return pieces, rest


@dataclass(frozen=True)
class WholeRecord:
    """A committed save's storage items (``{MetadataIndex: _StorageInfo}``), data file sizes, manifest key records
    and the data files its items name: what the commit's check of its items found whole."""

    items: dict[Any, Any]
    sizes: dict[str, int]
    saved_keys: dict[str, dict[str, Any]]
    files: list[str]

    def matches(self, items: Mapping[Any, Any], sizes: Mapping[str, int], saved_keys: Mapping[str, Any]) -> bool:
        return self.sizes == sizes and self.saved_keys == saved_keys and self.items == items


@dataclass
class PlanMemo:
    """One save's layout and what was derived from it (see the module docstring)."""

    layout: tuple[dict[str, Any], list[Any]]
    """This rank's :func:`layout_of` the save's entries."""
    planned: list[dict[str, Any]] = field(default_factory=list)
    """Every rank's pieces, gathered and checked to tile each tensor exactly once."""
    plan: SavePlan | None = None
    """This rank's final DCP plan (after the coordinator's global planning)."""
    metadata: Metadata | None = None
    """The coordinator's DCP metadata as planned: the entries (``state_dict_metadata``) and planner data, before
    any write filled in where the items are stored."""
    structure: StoredStructure | None = None
    """The commit's checks of ``metadata``'s entries (coordinator)."""
    pickler: MetadataPickler | None = None
    """``metadata``'s entries pickled once, for the metadata file of every save that reuses this memo
    (coordinator)."""
    whole: WholeRecord | None = None
    """What the last save with this memo was found whole with (coordinator): a save whose storage items, file
    sizes and key records equal these has the same verdict, and only its files are examined again."""
    framed: FramedLayout | None = None
    """This rank's data file's tensor items as the first save with this memo wrote them: later ones write their
    tensors through it, with a few calls for all items (:mod:`~peftckpt.checkpoint.storage.framed_layout`)."""
    gathered: list[list[WriteResult]] = field(default_factory=list)
    """Every rank's write results of the last save with this memo (coordinator): a rank whose results are the
    very ones it wrote last time sends a token instead of them."""
    wrote: bool = False
    """A save with this memo wrote this rank's data file (its results are :attr:`written`, possibly none)."""
    written: list[WriteResult] = field(default_factory=list)
    """This rank's write results of the last save with this memo, in file order: a save that puts an item where
    that one did reuses its result, so the metadata's storage items are the objects :attr:`pickler` holds."""

    def fresh_metadata(self) -> Metadata:
        """A metadata for this save's write to fill in: the planned entries, no storage items yet."""
        assert self.metadata is not None
        return Metadata(state_dict_metadata=self.metadata.state_dict_metadata,
                        planner_data=self.metadata.planner_data)
