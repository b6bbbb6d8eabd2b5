"""DCP's ``.metadata`` pickle for saves laid out alike: the entries pickled once, only the storage items each save.

DCP pickles the whole :class:`Metadata` at every save: the entries (``state_dict_metadata``: a few objects and
sizes per stored tensor) and where each item landed (``storage_data``). At a checkpoint per step of a model with
thousands of adapter tensors the entries cost ~10 us a tensor to pickle, every time, though a save that reuses
its plans (:mod:`~peftckpt.checkpoint.storage.plan_memo`) has the very same entry objects as the last one.

:class:`MetadataPickler` pickles the entries, the storage indices and the storage items (where each item lies in
its file: the same objects at every save that writes each item where the last one did), once (protocol 2,
explicit memo indices) and keeps the bytes and the pickler's memo. A save's metadata is then that prefix, a
``POP`` (the entries stay in the unpickler's memo), and the metadata pickled by a pickler that starts from the
kept memo: every entry and index, and every storage item in its old place, is a memo reference; only the
items that moved and the small fields are new (the ranks' write results reach the coordinator as copies: equal
ones are swapped for the objects pickled, :meth:`MetadataPickler.adopt`). The
result is one ordinary pickle (memo indices in order, one ``STOP``) that stock ``pickle.load`` -- stock DCP --
and the restricted reader load as DCP's own. It relies on the entries never being mutated once planned, as
the plan memo does, nor the storage items once written.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

__all__ = ["MetadataPickler"]

_PROTOCOL = 2  # explicit memo indices and no frames, so two pickler runs can share one stream
_PROTO = bytes([pickle.PROTO[0], _PROTOCOL])


class MetadataPickler:
    """Pickles :class:`Metadata` objects whose ``state_dict_metadata`` is ``entries`` (module docstring)."""

    def __init__(self, entries: dict[str, Any], storage: Mapping[MetadataIndex, Any]) -> None:
        buf = io.BytesIO()
        self._pickler = pickle.Pickler(buf, protocol=_PROTOCOL)
        self._pickler.dump((entries, list(storage), list(storage.values())))
        data = buf.getvalue()
        assert data.startswith(_PROTO) and data.endswith(pickle.STOP)
        self._prefix = data[:-1] + pickle.POP
        self.entries = entries
        self._storage = dict(storage)

    def adopt(self, storage: Mapping[MetadataIndex, Any]) -> dict[MetadataIndex, Any] | None:
        """``storage`` made of the very objects this pickler pickled, where it is equal to them entry for entry, in
        order (a save that put every item where the last one did: this rank's results are the same objects, the
        other ranks' reach the coordinator as equal copies); ``None`` where it differs (then a new pickler pickles
        its items once more, for the saves after it)."""
        held = self._storage
        if len(storage) != len(held):
            return None
        for (key, item), (held_key, held_item) in zip(storage.items(), held.items()):
            if (key is not held_key and key != held_key) or (item is not held_item and item != held_item):
                return None
        return dict(held)

    def dumps(self, metadata: Metadata) -> bytes:
        """The pickle of ``metadata`` (its ``state_dict_metadata`` must be :attr:`entries`)."""
        if metadata.state_dict_metadata is not self.entries:
            raise ValueError("metadata of other entries than the pickler's")
        buf = io.BytesIO()
        rest = pickle.Pickler(buf, protocol=_PROTOCOL)
        rest.memo = self._pickler.memo  # a copy: the kept memo is never extended
        rest.dump(metadata)
        tail = buf.getvalue()
        assert tail.startswith(_PROTO)
        return self._prefix + tail[len(_PROTO):]
