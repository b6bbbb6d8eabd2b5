"""Base loads: the frozen base put into the rank parts from a full checkpoint or from a foreign source.

:class:`BaseLoads` adds to :class:`~peftckpt.checkpoint.load.Loads` what a base needs: :meth:`BaseLoads.load_pretrained`
(a full ``torch_dist`` checkpoint, optionally a few tensors at a time with a callback after each, so a base can be
quantized as it is read), :meth:`BaseLoads.load_base_tensors` (a source that reads by key, e.g. HF safetensors), and
the base fingerprint taken while the pieces are read.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ..sharding.entries import GlobalTensor
from .checks.load_checks import architecture_mismatch, shape_mismatch
from .checks.strictness import KeyReport
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointMismatchError,
    as_read_error,
    unwrap_dcp_error,
)
from .load import Loads, ReadVerification
from .options import LoadOptions, LoadResult
from .state.fingerprint import FINGERPRINT_VERSION, Fingerprinting
from .state.fingerprint_sums import WIDTH
from .state.sections import MODEL
from .storage.checkpoint_files import CheckpointFiles
from .storage.formats import StoredCheckpoint, storage_format
from .storage.huge_pages import prefer_huge_pages
from .storage.manifest import Manifest

__all__ = ["BaseLoads"]


class BaseLoads(Loads):
    """The loads of one checkpointer, bases included (see the module docstring)."""

    def _read_then(self, request: dict[str, Any], stored: StoredCheckpoint, verification: ReadVerification,
                   then: Callable[[str], None]) -> None:
        """:meth:`_read` a few tensors at a time, calling ``then(key)`` (on every rank, in one order) once this
        rank's pieces of ``key`` are in place, before the next tensors are read: what ``then`` releases (a
        weight quantized, say) is never held whole. The base fingerprint is then taken from the model when needed."""
        problems: list[str] = []
        error: BaseException | None = None
        for batch in _read_batches({k: v for k, v in stored.tensor_shapes.items() if k.startswith(MODEL + ".")}):
            try:
                problems = stored.read({k: request[k] for k in batch if k in request})
            except BaseException as e:  # noqa: BLE001 - reported collectively
                error = as_read_error(unwrap_dcp_error(e), verification.ckpt)
            if not self.comm.all_true(error is None):
                break
            for key in batch:
                if key in request:
                    request[key].pieces = []  # this load's last reference to the tensor: it may go now
                then(key)
        self._finish_read(verification, problems, error)
        self.parts.base_changed()
        self.base_fingerprint_wait_s = None

    def load_base_tensors(self, source: str, shapes: Mapping[str, Sequence[int]],
                          read: Callable[[str, Sequence[int], Sequence[int]], torch.Tensor],
                          read_into: Callable[[str, Sequence[int], torch.Tensor], None] | None = None,
                          then: Callable[[str], None] | None = None) -> list[str]:
        """:meth:`~peftckpt.checkpoint.api.Checkpointer.load_base_tensors` (collective)."""
        request = self.parts.build(False, False).tensors()
        absent = sorted(k for k in request if k not in shapes)
        wrong = [f"  {k}: {source} {list(shapes[k])}, model {list(v.global_shape)}" for k, v in sorted(request.items())
                 if k in shapes and list(shapes[k]) != list(v.global_shape)]
        frozen_absent = [k for k in absent if not request[k].requires_grad]
        error: BaseException | None = None
        if frozen_absent or wrong:
            error = CheckpointMismatchError(
                (f"{source} lacks {len(frozen_absent)} frozen base tensor(s): "
                 + ", ".join(frozen_absent[:10]) + ("" if len(frozen_absent) <= 10 else ", ...") + "\n"
                 if frozen_absent else "")
                + (f"{source} holds tensors of other shapes than this model's:\n" + "\n".join(wrong[:10])
                   if wrong else ""))
        self.comm.agree(error)
        prefer_huge_pages(p.tensor for k, e in request.items() if k in shapes for p in e.pieces)  # before 1st touch
        with self._fingerprinting_base({} if then is not None else request) as fingerprinting:
            try:
                with torch.no_grad():
                    for key, entry in request.items():
                        if key in shapes:
                            for piece in entry.pieces:
                                if read_into is not None:  # straight into the model's memory
                                    read_into(key, piece.offsets, piece.tensor)
                                else:
                                    piece.tensor.copy_(read(key, piece.offsets, piece.tensor.shape))
                                fingerprinting.add(key, piece.offsets, piece.tensor)
                            if then is not None:
                                entry.pieces = []  # this load's last reference to the tensor: it may go now
                                then(key)
            except CheckpointError as e:
                error = e
            except (OSError, ValueError) as e:  # an unreadable or damaged source file: the source names it
                error = CheckpointIntegrityError(f"{source} cannot be read: {e}")
            self.comm.agree(error)
        if then is not None:  # the tensors changed after they were read: fingerprinted from the model when needed
            self.parts.base_changed()
            self.base_fingerprint_wait_s = None
        return absent

    @contextlib.contextmanager
    def _fingerprinting_base(self, request: Mapping[str, Any], known: Mapping[str, Sequence[int]] | None = None
                             ) -> Iterator[Fingerprinting]:
        """The fingerprint of the base a load is writing into the model, fed piece by piece as the load reads
        them (hashing overlaps the reading; ``known``: keys whose sums are not taken again, see
        :func:`recorded_sums`), and cached with its per-key sums once the load succeeded (collective)."""
        self.parts.base_changed()  # the base changes
        fingerprinting = Fingerprinting({k: v for k, v in request.items() if isinstance(v, GlobalTensor)
                                         and v.frozen}, self.comm.distributed, group=self.comm.group, known=known)
        try:
            yield fingerprinting
        except BaseException:
            fingerprinting.close()
            raise
        self.parts.fingerprints[FINGERPRINT_VERSION] = fingerprinting.result()
        self.parts.base_sums = fingerprinting.key_sums
        self.base_fingerprint_wait_s = fingerprinting.wait_s

    def load_pretrained(self, path: str | os.PathLike[str], options: LoadOptions | None = None,
                        then: Callable[[str], None] | None = None) -> LoadResult:
        """:meth:`~peftckpt.checkpoint.api.Checkpointer.load_pretrained`: the base from a full checkpoint (a
        frozen parameter it lacks is an error; trainable ones it lacks, the adapters, keep their values)."""
        # No earlier checkpoint is offered: an earlier base is another base (its fingerprint differs).
        return self._load_located(path, options or LoadOptions(),
                                  lambda local, o, files: self._load_pretrained(local, o, then, files),
                                  search_earlier=False, cache=(options or LoadOptions()).base_cache)

    def _load_pretrained(self, path: str | os.PathLike[str], options: LoadOptions,
                         then: Callable[[str], None] | None, files: CheckpointFiles | None = None) -> LoadResult:
        """:meth:`load_pretrained` of a checkpoint directory (``files``: as :meth:`Loads._resolve`)."""
        ckpt, _, manifest, verification = self._resolve(path, options, files)
        if not manifest.holds_every_weight:
            raise CheckpointFormatError(
                f"load_pretrained: {ckpt} is an adapter-only checkpoint (saved with "
                "SaveOptions(trainable_only=True)); it holds no base weights. Load it with Checkpointer.load instead")
        self.comm.agree(architecture_mismatch(self.parts.model_config, manifest, ckpt))
        fmt = storage_format(manifest.format, f"load_pretrained: {ckpt}")
        if not fmt.reshards:
            raise CheckpointFormatError(f"load_pretrained: {ckpt} must be torch_dist, got {manifest.format!r}")
        stored = self._open(fmt, verification, manifest, options)
        request = self.parts.build(False, False).tensors()
        self.comm.agree(shape_mismatch(request, stored.tensor_shapes, ckpt))
        absent = [k for k in request if k not in stored.tensor_shapes]
        frozen_absent = [k for k in absent if not request[k].requires_grad]
        error: BaseException | None = None
        if frozen_absent:
            error = CheckpointMismatchError(
                f"load_pretrained: {ckpt} lacks {len(frozen_absent)} frozen base tensor(s): "
                + ", ".join(sorted(frozen_absent)[:10]) + ("" if len(frozen_absent) <= 10 else ", ...")
            )
        self.comm.agree(error)
        for k in absent:
            request.pop(k)
        if then is None:
            with self._fingerprinting_base(request, recorded_sums(manifest, request, options)) as fingerprinting:
                self._read(request, stored, verification, fingerprinting)
        else:
            self._read_then(request, stored, verification, then)
        return LoadResult(ckpt, manifest.iteration, manifest, {}, KeyReport(unexpected=sorted(absent)))


def recorded_sums(manifest: Manifest, request: Mapping[str, Any], options: LoadOptions) -> dict[str, list[int]]:
    """The fingerprint sums a base checkpoint recorded (``base_sums``) that hold for the tensors a load puts into
    the model, so that the load need not sum their bytes again: only where the load verifies what it reads
    against the checksums (the bytes are then the ones the sums were taken of; ``verify_checksums=False`` sums
    them), only of this fingerprint version, and only for tensors held in the dtype they are stored in (a
    conversion may change the values)."""
    if not options.verify_checksums or not manifest.base_sums:
        return {}
    out = {}
    for key, record in manifest.base_sums.items():
        entry = request.get(key)
        stored = manifest.saved_keys.get(key, {}).get("dtype")
        if isinstance(entry, GlobalTensor) and record[0] == FINGERPRINT_VERSION and \
                len(record) == 1 + WIDTH[FINGERPRINT_VERSION] and stored == str(entry.dtype).removeprefix("torch."):
            out[key] = list(record[1:])
    return out


_BATCH_ELEMENTS = 1 << 24
"""Elements of the global tensors one read of :meth:`Loads._read_then` covers, 16 M (64 MB in fp32; a larger
tensor is read alone): what is held in full precision at once, against one read call per batch."""


def _read_batches(shapes: Mapping[str, Sequence[int] | None]) -> Iterator[list[str]]:
    """The stored tensors in key order, cut into consecutive batches of about :data:`_BATCH_ELEMENTS` (the same
    batches on every rank: they come from the checkpoint's metadata)."""
    batch: list[str] = []
    size = 0
    for key in sorted(k for k, shape in shapes.items() if shape is not None):
        n = math.prod(shapes[key] or ())
        if batch and size + n > _BATCH_ELEMENTS:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch
