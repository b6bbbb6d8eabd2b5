"""Read a ``torch_dist`` checkpoint's model tensors in one process, without a process group.

Used by the offline tools (export to Hugging Face, inspection of values): every requested tensor is
materialised at its *global* shape, whatever TP/PP/DP layout wrote it. Integrity and safety are the same as
for a training load: the manifest's checksums are verified first (unless told not to), ``.metadata`` goes
through the restricted unpickler and tensors load with ``weights_only``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...sharding.entries import GlobalTensor, LazyGlobalTensor
from ..errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    as_read_error,
    unwrap_dcp_error,
)
from ..location import protocol
from ..location.locate import locate
from ..location.store import renamed_error
from ..state.fingerprint import FINGERPRINT_VERSION, base_fingerprint
from ..state.sections import MODEL
from ..storage.checkpoint_files import CheckpointFiles
from ..storage.checksums import verify_files
from ..storage.dcp_reader import RangedFileSystemReader
from ..storage.formats import StorageFormat, storage_format
from ..storage.manifest import Manifest, read_manifest

__all__ = ["OfflineCheckpoint", "TensorSource", "open_checkpoint", "lazy_entries", "lazy_fingerprint"]


@dataclass
class OfflineCheckpoint:
    """A resolved, verified checkpoint directory and its manifest."""

    path: Path
    iteration: int
    manifest: Manifest
    source: str = ""
    """Where it was read from when that is not ``path``: the URL of a checkpoint fetched from an object store."""
    files: CheckpointFiles | None = None
    """Where its data files are read when they are not under ``path``: a store's objects, read by ranges and
    verified by their block index as they are (:meth:`model_tensors` raises on damage, naming the object)."""
    _hashed: set[str] = field(default_factory=set)
    """Data files without a block index, hashed whole once (a store's, read in place)."""

    @property
    def where(self) -> str:
        """The checkpoint as the user named it (its URL, or its absolute directory)."""
        return self.source or str(self.path.absolute())

    def model_tensors(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """``{model name: global tensor}`` of the model section (all of it, or ``names``)."""
        # A directory was verified when it was opened; a store's objects are verified as they are read.
        reader = RangedFileSystemReader(self.path, verify=self.files is not None,
                                        sources=None if self.files is None else self.files.sources)
        metadata = reader.read_metadata()
        prefix = MODEL + "."
        available = {k[len(prefix):]: md for k, md in metadata.state_dict_metadata.items()
                     if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}
        wanted = sorted(available) if names is None else names
        absent = [n for n in wanted if n not in available]
        if absent:
            raise CheckpointFormatError(f"checkpoint {self.path} lacks model tensor(s) {absent[:10]}")
        request = {}
        for n in wanted:
            md = available[n]
            request[prefix + n] = torch.empty(md.size, dtype=md.properties.dtype)
        if request:
            try:
                dcp.load(request, storage_reader=reader, no_dist=True)
            except BaseException as e:  # DCP wraps failures in CheckpointException (a BaseException)
                inner = as_read_error(unwrap_dcp_error(e), self.path)
                if inner is e:
                    raise
                raise inner from None
            unhashed = sorted(set(reader.unindexed) - self._hashed)
            problems = reader.problems + (self.files.checksum_problems(self.manifest, unhashed)
                                          if self.files is not None and unhashed else [])
            self._hashed.update(unhashed)
            if problems:
                raise CheckpointIntegrityError(f"checkpoint {self.where} is damaged:\n  " + "\n  ".join(problems))
        return {k[len(prefix):]: v for k, v in request.items()}


    def model_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{model name: (global shape, dtype)}`` of every model tensor it holds (from the manifest, which the
        whole-checkpoint check matched against the stored tensors)."""
        prefix = MODEL + "."
        return {k[len(prefix):]: (torch.Size(r["shape"]), getattr(torch, r["dtype"]))
                for k, r in self.manifest.saved_keys.items() if k.startswith(prefix)}

    def fingerprint(self, names: list[str], version: int = FINGERPRINT_VERSION) -> str:
        """The base fingerprint of model tensors ``names``, read and summed one tensor at a time."""
        return lazy_fingerprint(self, names, version)


class TensorSource(Protocol):
    """What the offline tools read a base or an adapter from: a checkpoint, or an HF directory."""

    @property
    def path(self) -> Path | str: ...

    def model_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]: ...

    def model_tensors(self, names: list[str] | None = None) -> dict[str, torch.Tensor]: ...


def lazy_entries(source: TensorSource, names: list[str]) -> dict[str, GlobalTensor]:
    """``{model.<name>: entry}`` of ``source``'s tensors ``names``, each read only when it is used."""
    shapes = source.model_shapes()
    absent = [n for n in names if n not in shapes]
    if absent:
        raise CheckpointFormatError(f"{source.path} lacks model tensor(s) {absent[:10]}")
    return {f"{MODEL}.{n}": LazyGlobalTensor(shapes[n][0], shapes[n][1],
                                             functools.partial(_one_tensor, source, n)) for n in names}


def lazy_fingerprint(source: TensorSource, names: list[str], version: int = FINGERPRINT_VERSION) -> str:
    """The base fingerprint of ``source``'s tensors ``names``, read and summed one tensor at a time."""
    return base_fingerprint(lazy_entries(source, names), distributed=False, version=version)


def _one_tensor(source: TensorSource, name: str) -> torch.Tensor:
    return source.model_tensors([name])[name]


def open_checkpoint(path: str | os.PathLike[str], verify_checksums: bool = True,
                    what: str = "checkpoint") -> OfflineCheckpoint:
    """Resolve ``path`` (a save directory via its tracker, or a checkpoint directory), read the manifest and
    verify every file's checksum. ``what`` names the argument in error messages. A URL's checkpoint is fetched
    into a local copy first (every object verified as it downloads; deleted at exit)."""
    copy = protocol.committed_copy(locate(path, what), in_place=True)
    if copy.problems:
        raise CheckpointIntegrityError(f"{what} {copy.url} is damaged:\n  " + "\n  ".join(copy.problems))
    if copy.files is not None:  # a store's small files, fetched and verified; its data objects read in place
        assert copy.manifest is not None
        _check_reshards(copy.manifest, what, copy.url)
        problems = storage_format(copy.manifest.format, f"{what} {copy.url}").structure_problems(
            copy.local, copy.manifest, copy.files.listed)
        if problems:
            raise CheckpointIntegrityError(copy.rename(f"{what} {copy.url} is damaged:\n  " + "\n  ".join(problems)))
        return OfflineCheckpoint(copy.local, copy.iteration, copy.manifest, source=copy.url, files=copy.files)
    if copy.verified:  # a copy fetched from a store, every object hashed as it arrived: not hashed again
        try:
            opened = open_checkpoint(copy.local, verify_checksums=False, what=what)
        except CheckpointError as e:
            raise renamed_error(e, copy.local, copy.url) from None
        opened.source = copy.url
        return opened
    ckpt, iteration = copy.local, copy.iteration
    manifest = read_manifest(ckpt)
    fmt = _check_reshards(manifest, what, ckpt)
    problems = verify_files(ckpt, manifest, hash_if=None if verify_checksums else (lambda _rel: False))
    problems = list(dict.fromkeys(problems + fmt.structure_problems(ckpt, manifest)))  # always: nothing read from outside
    if problems:
        raise CheckpointIntegrityError(f"{what} {ckpt} is damaged:\n  " + "\n  ".join(problems))
    return OfflineCheckpoint(ckpt, iteration, manifest)


def _check_reshards(manifest: Manifest, what: str, where: object) -> StorageFormat:
    """The checkpoint's format, if the offline tools read it (a legacy file holds one rank's local shards)."""
    fmt = storage_format(manifest.format, f"{what} {where}")
    if not fmt.reshards:
        raise CheckpointFormatError(
            f"{what} {where} is in the {manifest.format!r} format; the offline tools read torch_dist only: "
            "convert it with `peftckpt train --load ... --ckpt-convert-format torch_dist --ckpt-convert-save DIR`")
    return fmt
