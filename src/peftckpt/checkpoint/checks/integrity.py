"""Is a ``torch_dist`` checkpoint whole? DCP's ``.metadata`` cross-checked against the manifest.

The manifest's checksums prove that the files it lists are intact; they say nothing about whether those
files are the ones DCP will read, or whether they hold every tensor. :func:`storage_problems` closes that gap,
from the two small files alone (no data is read), so the commit, ``verify``, ``inspect``, every load and the
offline tools run the same check:

1. Every storage item names a safe relative path (no ``..``, not absolute) of a regular file inside the
   checkpoint (no symlink, FIFO or device) that the manifest lists, and its byte range lies inside the
   recorded size without overlapping another item's.
2. Every tensor's chunks lie inside its global shape and cover it exactly once (no hole, no overlap), each
   chunk has a storage item, and that item is long enough for the chunk's elements -- so reading a
   checkpoint never allocates more than its files' size, whatever ``.metadata`` declares.
3. Every model tensor the manifest records (``saved_keys``) is a tensor in ``.metadata`` with the recorded
   global shape and dtype: the manifest is trusted only where it agrees with what is stored.

A save that lost a rank's files (another run deleted them, a shard that was never written) is refused before
it commits, and an existing checkpoint with such damage is refused by name before anything is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from peftckpt.checkpoint.errors import CheckpointError, UnsafeCheckpointError
from peftckpt.checkpoint.storage.manifest import Manifest
from peftckpt.checkpoint.storage.paths import recorded_file_problem, relpath_problem
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata

__all__ = ["DCP_METADATA_FILENAME", "dcp_problems", "storage_problems", "StoredStructure", "stored_structure",
           "coverage_problem", "key_record_problems", "held_pieces", "unwritten_pieces", "plan_problems",
           "item_files", "files_problems"]

DCP_METADATA_FILENAME = ".metadata"
"""DCP's global metadata file inside a ``torch_dist`` checkpoint directory."""

_MAX_REPORTED = 20


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _dims(value: object) -> list[int] | None:
    """``value`` as a list of non-negative ints (a ``torch.Size`` or sequence), else ``None``."""
    if not isinstance(value, (torch.Size, list, tuple)) or not all(_is_count(d) for d in value):
        return None
    return [int(d) for d in value]


def coverage_problem(key: str, shape: Sequence[int], chunks: Sequence[tuple[Sequence[int], Sequence[int]]]) -> str | None:
    """Why ``chunks`` (``(offsets, sizes)`` pairs) do not tile ``shape`` exactly once, or ``None``.

    Each chunk must lie inside the shape; no two may overlap; together they must cover every element (with
    no overlap, covering is equivalent to the chunk volumes summing to the tensor's)."""
    total = math.prod(shape)
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            return f"{key!r}: a chunk of rank {len(sizes)} in a tensor of shape {list(shape)}"
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape)):
            return f"{key!r}: chunk at offsets {list(offsets)} of size {list(sizes)} exceeds the global shape {list(shape)}"
    boxes = [(list(o), list(s)) for o, s in chunks if math.prod(s) > 0]
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1:]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)):
                return (f"{key!r}: chunks at offsets {oa} and {ob} overlap (two ranks wrote the same elements; "
                        "a wrong fused-layout declaration or replication does this)")
    covered = sum(math.prod(s) for _, s in boxes)
    if covered != total:
        return (f"{key!r}: its chunks cover {covered} of {total} elements of shape {list(shape)}: a shard "
                "never reached the checkpoint")
    return None


def key_record_problems(metadata: Metadata, records: Mapping[str, Mapping[str, Any]], source: Path) -> list[str]:
    """Model tensors the manifest records that ``.metadata`` lacks, or stores with another shape or dtype."""
    problems = []
    entries = metadata.state_dict_metadata
    for key, rec in sorted(records.items()):
        entry = entries.get(key)
        if entry is None:
            problems.append(f"{source}: saved key {key!r} listed in the manifest is absent from DCP metadata")
        elif not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{source}: saved key {key!r} is a {type(entry).__name__} in DCP metadata, not a tensor")
        else:
            if list(entry.size) != list(rec["shape"]):
                problems.append(f"{source}: saved key {key!r} has global shape {list(entry.size)} in DCP "
                                f"metadata, manifest says {list(rec['shape'])}")
            dtype = str(entry.properties.dtype).removeprefix("torch.")
            if dtype != str(rec["dtype"]).removeprefix("torch."):
                problems.append(f"{source}: saved key {key!r} has dtype {dtype} in DCP metadata, "
                                f"manifest says {rec['dtype']}")
    return problems


def _item_problems(root: Path, metadata: Metadata, files: Mapping[str, Mapping[str, Any]],
                   stored: Mapping[str, int] | None = None) -> tuple[list[str], dict[MetadataIndex, int]]:
    """Step 1 of the module docstring; also returns each valid item's byte length."""
    problems: list[str] = []
    lengths: dict[MetadataIndex, int] = {}
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        return [f"{root}/.metadata: has no storage item table (not written by a file-system DCP writer)"], lengths
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    sizes: dict[str, int | str] = {}
    """Per file named by an item (a few, for thousands of items): its recorded size, or why it may not be read."""
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            problems.append(f"{root}/.metadata: a storage item of unexpected type {type(info).__name__}")
            continue
        rel, offset, length = info.relative_path, info.offset, info.length
        if info.transform_descriptors:
            problems.append(f"{root}/.metadata: storage item of {index.fqn!r} is stored through transforms "
                            f"{info.transform_descriptors!r} (compression?), which peftckpt never writes")
            continue
        size = sizes.get(rel) if isinstance(rel, str) else None
        if size is None:
            why = relpath_problem(rel)
            size = (f"names file {rel!r}, which {why}; refusing to read outside the checkpoint" if why is not None
                    else f"is in {root / rel}, a file the manifest does not list" if rel not in files
                    else files[rel]["size"])
            if isinstance(rel, str):
                sizes[rel] = size
        if isinstance(size, str):
            problems.append(f"{root}/.metadata: storage item of {index.fqn!r} {size}")
            continue
        if not (_is_count(offset) and _is_count(length)) or offset + length > size:
            problems.append(f"{root}/.metadata: storage item of {index.fqn!r}: bytes [{offset}, {offset}+{length}) "
                            f"lie outside {root / rel} ({size} bytes)")
            continue
        lengths[index] = length
        ranges.setdefault(rel, []).append((offset, length, index.fqn))
    for rel, spans in sorted(ranges.items()):
        problem = _file_problem(root, rel, files, stored)
        if problem is not None:
            problems.append(problem)
            continue
        spans.sort()
        for (a, n, k1), (b, _m, k2) in zip(spans, spans[1:]):
            if b < a + n:
                problems.append(f"{root / rel}: the bytes of {k1!r} and {k2!r} overlap")
    return problems, lengths


def _file_problem(root: Path, rel: str, files: Mapping[str, Mapping[str, Any]],
                  stored: Mapping[str, int] | None) -> str | None:
    """Why the data file ``rel`` does not hold the bytes the manifest records (``stored``: the sizes an object
    store lists, else the file under ``root`` is examined)."""
    if stored is None:
        return recorded_file_problem(root, rel, files[rel]["size"])
    if stored.get(rel) != files[rel]["size"]:
        return (f"{rel}: not stored with the {files[rel]['size']} bytes written "
                f"({'missing' if rel not in stored else f'{stored[rel]} bytes'})")
    return None


def item_files(metadata: Metadata) -> list[str]:
    """The files ``metadata``'s storage items name."""
    return sorted({info.relative_path for info in metadata.storage_data.values()})


def files_problems(root: Path, names: Sequence[str], files: Mapping[str, Mapping[str, Any]],
                   stored: Mapping[str, int] | None = None) -> list[str]:
    """Step 1 for the data files alone: each of ``names`` holds the bytes the manifest records (for storage items
    already checked against these very files' sizes)."""
    return [p for p in (_file_problem(root, rel, files, stored) for rel in names) if p is not None]


@dataclass
class StoredStructure:
    """What ``.metadata``'s entries say, checked once (step 2 of the module docstring less the storage items):
    the entries' own problems and, per storage item they need, how many bytes it must hold. It depends on
    ``state_dict_metadata`` alone, so a save laid out like the last one reuses the last one's (see
    :class:`~peftckpt.checkpoint.storage.plan_memo.PlanMemo`)."""

    problems: list[str]
    needs: list[tuple[MetadataIndex, int, list[int] | None, torch.dtype | None]]
    """``(storage index, bytes it must hold, the chunk's sizes and dtype)``, the last two ``None`` for an
    object."""
    unwritten: list[str] | None = None
    """:func:`unwritten_pieces` of these entries and the save's pieces, once a commit asked (the pieces are the
    same wherever the structure is reused)."""


def stored_structure(metadata: Metadata, root: Path) -> StoredStructure:
    """The entry checks of ``metadata.state_dict_metadata`` (which must be a dict)."""
    where = f"{root}/.metadata"
    problems: list[str] = []
    needs: list[tuple[MetadataIndex, int, list[int] | None, torch.dtype | None]] = []
    for key, md in sorted(metadata.state_dict_metadata.items(), key=lambda kv: str(kv[0])):
        if not isinstance(key, str):
            problems.append(f"{where}: an entry named by a {type(key).__name__}, not a string")
        elif isinstance(md, BytesStorageMetadata):
            needs.append((MetadataIndex(key), 0, None, None))
        elif not isinstance(md, TensorStorageMetadata):
            problems.append(f"{where}: entry {key!r} is a {type(md).__name__}, not tensor or object metadata")
        else:
            problems.extend(_tensor_problems(key, md, needs, where))
    return StoredStructure(problems, needs)


def _tensor_problems(key: str, md: TensorStorageMetadata,
                     needs: list[tuple[MetadataIndex, int, list[int] | None, torch.dtype | None]], where: str) -> list[str]:
    """One tensor entry's problems; the storage items its chunks need are added to ``needs``."""
    shape = _dims(md.size)
    dtype = getattr(md.properties, "dtype", None)
    if shape is None or not isinstance(dtype, torch.dtype) or not isinstance(md.chunks, list):
        return [f"{where}: tensor {key!r} has a malformed shape, dtype or chunk list"]
    chunks: list[tuple[list[int], list[int]]] = []
    for chunk in md.chunks:
        offsets = _dims(getattr(chunk, "offsets", None)) if isinstance(chunk, ChunkStorageMetadata) else None
        sizes = _dims(getattr(chunk, "sizes", None)) if isinstance(chunk, ChunkStorageMetadata) else None
        if offsets is None or sizes is None:
            return [f"{where}: tensor {key!r} has a malformed chunk"]
        needs.append((MetadataIndex(key, torch.Size(offsets)), math.prod(sizes) * dtype.itemsize, sizes, dtype))
        chunks.append((offsets, sizes))
    why = coverage_problem(key, shape, chunks)
    return [f"{where}: {why}"] if why else []


def _need_problems(structure: StoredStructure, lengths: Mapping[MetadataIndex, int], root: Path) -> list[str]:
    """The storage items the entries need that are missing, or too short for the elements a chunk declares."""
    problems = []
    for index, nbytes, sizes, dtype in structure.needs:
        length = lengths.get(index)
        if length is not None and length >= nbytes:
            continue
        name = (f"object {index.fqn!r}" if sizes is None
                else f"chunk of {index.fqn!r} at offsets {list(index.offset or ())}")
        if length is None:
            problems.append(f"{root}/.metadata: {name} has no valid storage item")
        else:
            problems.append(f"{root}/.metadata: {name} declares {sizes} {dtype} elements, more than its {length} "
                            "stored bytes can hold")
    return problems


def storage_problems(root: Path, metadata: Metadata, files: Mapping[str, Mapping[str, Any]],
                     saved_keys: Mapping[str, Mapping[str, Any]], stored: Mapping[str, int] | None = None,
                     structure: StoredStructure | None = None) -> list[str]:
    """Everything that makes checkpoint ``root`` not whole (module docstring, steps 1-3); empty when whole.

    ``files`` and ``saved_keys`` are the manifest's records (or, at commit time, what is about to be
    recorded). ``stored``: the files' sizes as an object store lists them (else the files under ``root`` are
    examined). ``structure``: :func:`stored_structure` of this metadata, if already taken. At most a few dozen
    problems are listed, then a count."""
    problems, lengths = _item_problems(root, metadata, files, stored)
    if not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        return problems + [f"{root}/.metadata: has no state-dict metadata"]
    if structure is None:
        structure = stored_structure(metadata, root)
    problems += structure.problems + _need_problems(structure, lengths, root)
    problems.extend(key_record_problems(metadata, saved_keys, root / ".metadata"))
    if len(problems) > _MAX_REPORTED:
        problems = problems[:_MAX_REPORTED] + [f"... and {len(problems) - _MAX_REPORTED} more problem(s)"]
    return problems


def _overlap(oa: Sequence[int], sa: Sequence[int], ob: Sequence[int], sb: Sequence[int]) -> int:
    """Elements two boxes share."""
    return math.prod(max(0, min(a + n, b + m) - max(a, b)) for a, n, b, m in zip(oa, sa, ob, sb))


def unwritten_pieces(metadata: Metadata, held: Mapping[str, Sequence[tuple[int, Sequence[int], Sequence[int]]]]
                     ) -> list[str]:
    """At commit time: the pieces ranks held -- and so should have written -- that no stored chunk covers,
    each naming its key, its region and the rank(s) that held it (``held``: ``{key: [(rank, offsets,
    sizes), ...]}``). The stored chunks of a key never overlap (else :func:`coverage_problem` refuses it
    first), so summing overlaps measures coverage exactly."""
    entries = getattr(metadata, "state_dict_metadata", {})
    missing: dict[tuple[str, tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for key, pieces in sorted(held.items()):
        md = entries.get(key)
        stored = [(list(c.offsets), list(c.sizes)) for c in md.chunks] if isinstance(md, TensorStorageMetadata) else []
        exact = {(tuple(o), tuple(z)) for o, z in stored}
        for rank, offsets, sizes in pieces:
            if (tuple(offsets), tuple(sizes)) in exact:  # stored as the very chunk it held (the usual case)
                continue
            volume = math.prod(sizes)
            if volume and sum(_overlap(offsets, sizes, o, s) for o, s in stored) < volume:
                missing.setdefault((key, tuple(offsets), tuple(sizes)), []).append(rank)
    return [f"{key!r}: the piece at offsets {list(offsets)} of size {list(sizes)}, held by rank(s) "
            f"{', '.join(map(str, sorted(set(ranks))))}, never reached the checkpoint"
            for (key, offsets, sizes), ranks in missing.items()]


def held_pieces(planned: Sequence[Mapping[str, tuple[Any, Sequence[tuple[list[int], list[int]]]]]]
                ) -> dict[str, list[tuple[int, list[int], list[int]]]]:
    """``{key: [(rank, offsets, sizes), ...]}`` (as :func:`unwritten_pieces` takes them) of every rank's pieces
    as a save's step 1 gathered them (``planned[rank] = {key: (global shape, [(offsets, sizes), ...])}``)."""
    held: dict[str, list[tuple[int, list[int], list[int]]]] = {}
    for rank, keys in enumerate(planned):
        for key, (_, boxes) in keys.items():
            held.setdefault(key, []).extend((rank, offsets, sizes) for offsets, sizes in boxes)
    return held


def plan_problems(planned: Sequence[Mapping[str, tuple[Sequence[int], Sequence[tuple[Sequence[int], Sequence[int]]]]]]
                  ) -> list[str]:
    """Before a save writes anything: whether every rank's pieces (``planned[rank] = {key: (global shape,
    [(offsets, sizes), ...])}``) together tile each tensor exactly once. Identical pieces on several ranks
    are replicas; a region no rank holds, or pieces that overlap without being equal, is what a wrong
    ``declare_fused`` or a wrapper that hides or misplaces a rank's shard produces. Each problem names the
    key, the region and the ranks holding its neighbours."""
    shapes: dict[str, list[int]] = {}
    holders: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]]] = {}
    for rank, keys in enumerate(planned):
        for key, (shape, pieces) in keys.items():
            shapes[key] = list(shape)
            for offsets, sizes in pieces:
                if math.prod(sizes):
                    holders.setdefault(key, {}).setdefault((tuple(offsets), tuple(sizes)), []).append(rank)
    problems = []
    for key in sorted(shapes):
        held_by = holders.get(key, {})
        boxes = list(held_by)
        clash = next(((a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _overlap(*a, *b)), None)
        if clash is not None:
            (oa, sa), (ob, sb) = clash
            problems.append(f"{key!r}: rank(s) {_ranks(held_by[clash[0]])} hold offsets {list(oa)} size {list(sa)} and "
                            f"rank(s) {_ranks(held_by[clash[1]])} offsets {list(ob)} size {list(sb)}: they overlap "
                            "without being the same piece (a wrong declare_fused or replication does this)")
            continue
        holes = _uncovered(shapes[key], boxes)
        if holes:
            held = "; ".join(f"rank(s) {_ranks(r)}: offsets {list(o)} size {list(z)}"
                             for (o, z), r in sorted(held_by.items())[:4]) or "none"
            problems.append(f"{key!r} (shape {shapes[key]}): no rank holds " + ", ".join(
                f"offsets {list(o)} size {list(z)}" for o, z in holes[:3]) + (" ..." if len(holes) > 3 else "")
                + f" (held: {held}); a wrapper that hides a rank's shard from state_dict, or a wrong "
                "declare_fused, does this")
    return problems


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, sorted(set(ranks))))


def _uncovered(shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]]
               ) -> list[tuple[list[int], list[int]]]:
    """The cells of the grid the boxes' edges cut ``shape`` into that no (non-overlapping) box covers."""
    if sum(math.prod(s) for _, s in boxes) == math.prod(shape):
        return []
    cuts = [sorted({0, n} | {o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d, n in enumerate(shape)]
    cells = [[]]  # type: list[list[tuple[int, int]]]
    for edges in cuts:
        cells = [c + [(a, b)] for c in cells for a, b in zip(edges, edges[1:])]
    holes = []
    for cell in cells:
        offsets, sizes = [a for a, _ in cell], [b - a for a, b in cell]
        if not any(_overlap(offsets, sizes, o, s) for o, s in boxes):
            holes.append((offsets, sizes))
    return holes


def dcp_problems(ckpt_dir: Path, manifest: Manifest, stored: Mapping[str, int] | None = None) -> list[str]:
    """Raises :class:`UnsafeCheckpointError` for a ``.metadata`` the restricted unpickler refuses; otherwise
    returns the problems (empty when whole): whether a ``torch_dist`` checkpoint's DCP
    metadata is present, safe to read and describes a whole checkpoint made of the manifest's files (``stored``:
    their sizes as listed where they are not under ``ckpt_dir``, as in :func:`storage_problems`)."""
    md_path = ckpt_dir / DCP_METADATA_FILENAME
    if DCP_METADATA_FILENAME not in manifest.files:
        return [f"{md_path}: torch_dist checkpoint whose manifest does not list DCP metadata"]
    try:
        metadata = load_dcp_metadata(md_path, hand_on=True)  # a load's reader reads it next
    except UnsafeCheckpointError:
        raise
    except CheckpointError as exc:
        return [str(exc)]
    return storage_problems(ckpt_dir, metadata, manifest.files, manifest.saved_keys, stored)
