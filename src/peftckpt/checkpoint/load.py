"""Loads: a committed checkpoint read back into the rank parts (model chunks, optimizer, states, RNG).

:class:`Loads` runs :meth:`Loads.load` as its numbered steps (bases: :mod:`~peftckpt.checkpoint.load_base`): the location
gives a local directory to read (:meth:`~peftckpt.checkpoint.location.base.Location.reading`), the checkpoint is
resolved and verified, checked against this model, and read in its format; the objects it holds besides tensors
are put back by :mod:`~peftckpt.checkpoint.load_objects`.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .checks.load_checks import (
    adapter_mismatch,
    architecture_mismatch,
    base_mismatch,
    damaged,
    quantization_mismatch,
    shape_mismatch,
)
from .checks.strictness import KeyReport, check_keys
from .errors import (
    CheckpointError,
    CheckpointFormatError,
    UnsafeCheckpointError,
    as_read_error,
    unwrap_dcp_error,
)
from .load_damage import explain_damage
from .load_objects import apply_objects, objects_to_read
from .location import protocol
from .location.locate import locate
from .options import LoadOptions, LoadResult
from .rank_parts import RankParts
from .state.fingerprint import Fingerprinting, fingerprint_version
from .state.sections import MODEL, OPTIMIZER
from .storage.checkpoint_files import CheckpointFiles
from .storage.checksums import files_share, is_data_file
from .storage.formats import StorageFormat, StoredCheckpoint, storage_format
from .storage.manifest import Manifest, read_manifest

__all__ = ["Loads"]


@dataclass
class ReadVerification:
    """The checksums of this rank's share of a checkpoint's data files, hashed while a load reads them."""

    ckpt: Path
    manifest: Manifest
    files: CheckpointFiles
    """Where the data files are read from (the directory ``ckpt`` itself, or a store's objects)."""
    future: Future[list[str]] | None = None


class Loads:
    """The loads of one checkpointer (see the module docstring)."""

    def __init__(self, parts: RankParts):
        self.parts = parts
        self.comm = parts.comm
        self.base_fingerprint_wait_s: float | None = None
        """How long the last base load waited for its fingerprint after reading its last piece."""

    def _resolve(self, path: str | os.PathLike[str], options: LoadOptions, files: CheckpointFiles | None = None
                 ) -> tuple[Path, int, Manifest, ReadVerification]:
        """Directory, iteration and manifest of a committed checkpoint, its files verified (collective):
        presence, sizes and the small files now; with ``verify_while_reading`` the checksums of the data
        files in a background thread, finished by :meth:`_read`. ``files``: where the location keeps the data
        files, when not in the directory ``path`` (:meth:`_located`)."""
        found: CheckpointError | None = None
        try:
            local = locate(path, "checkpoint")  # local: a store's checkpoint is read from a copy (_located)
            rel, iteration = protocol.resolve(local)
            ckpt = Path(local.ref(rel))
            manifest = read_manifest(ckpt)
        except CheckpointError as e:  # alike on every rank as a rule (one location): agreed, so said once
            found = e
        self.comm.agree(found)
        files = files or CheckpointFiles(ckpt)
        pending = ReadVerification(ckpt, manifest, files)
        shard = (self.parts.rank, self.parts.world)
        fmt = storage_format(manifest.format, f"checkpoint {ckpt}")
        later = options.verify_while_reading and fmt.hashes_while_reading
        # Presence, type and size of every file always (cheap); the hashing as the options say.
        hash_if = (lambda rel: not is_data_file(rel)) if later else None
        problems = files.file_problems(manifest, shard, hash_if if options.verify_checksums else lambda _: False)
        error: UnsafeCheckpointError | None = None
        if self.parts.rank == 0:
            # Always, checksums or not: no storage item may lead outside the checkpoint or past a file's end.
            try:
                problems += fmt.structure_problems(ckpt, manifest, files.listed)
            except UnsafeCheckpointError as e:
                error = e
        self.comm.agree(error)
        self._raise_if_damaged(pending, problems)
        if options.verify_checksums and later:
            # A data file with a block index is verified by the read itself, block by block, as it is read (on a
            # store the read finds out, without a request of its own: one without is hashed after it, see _read).
            rels = [rel for rel in files_share(manifest, shard)
                    if is_data_file(rel) and not files.verified_while_read and not files.has_block_index(rel)]
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peftckpt-verify")
            pending.future = executor.submit(files.checksum_problems, manifest, rels)
            executor.shutdown(wait=False)
        return ckpt, iteration, manifest, pending

    def _raise_if_damaged(self, v: ReadVerification, problems: list[str], after_read: bool = False) -> None:
        """Raise :class:`CheckpointIntegrityError` on every rank if any rank found a damaged file."""
        error = damaged(v.ckpt, list(dict.fromkeys(p for ps in self.comm.gather(problems) for p in ps)), after_read)
        if error is not None:
            error.every_rank = True  # every rank raises this same error: said once
            raise error

    def load(self, path: str | os.PathLike[str], options: LoadOptions | None = None,
             model_only: bool = False) -> LoadResult:
        """:meth:`~peftckpt.checkpoint.api.Checkpointer.load`. Steps:
            1. Resolve the directory (tracker), read the manifest, verify the files (split over ranks; the
               data files' checksums in a thread, while step 4 reads them).
            2. Check that the checkpoint fits this model: architecture, adapter configuration and, for a
               trainable-only checkpoint, the base fingerprint.
            3. Build the request -- filtered like the save for a trainable-only checkpoint.
            4. Open it in its format (DCP reshards; a legacy file loads only at the layout it was saved at),
               check the stored shapes and the strictness mode against the request, read it, finish the
               checksums; apply extra state, optimizer groups, the checkpointer's states (in place) and the
               RNG state.
        A checkpoint found damaged at any step is an error that also names the newest intact earlier checkpoint
        of its save location (:mod:`~peftckpt.checkpoint.load_damage`); the load never falls back to it by itself.
        """
        return self._load_located(path, options or LoadOptions(),
                                  lambda local, o, files: self._load(local, o, model_only, files), search_earlier=True)

    def _load_located(self, path: str | os.PathLike[str], options: LoadOptions,
                      load: Callable[[str | os.PathLike[str], LoadOptions, CheckpointFiles | None], LoadResult],
                      search_earlier: bool, cache: bool = False) -> LoadResult:
        """``load`` of the local directory :meth:`_located` gives for ``path``, with the files the location gives
        (the result names ``path``'s URL when it is on a store, and the bytes fetched); a failure is explained
        with :func:`explain_damage` (``search_earlier``: naming the newest intact earlier checkpoint), then
        raised. ``cache``: a base, kept in the host's base cache (:attr:`LoadOptions.base_cache`)."""
        try:
            with self._located(path, options, cache) as (local, located_options, files):
                result = load(local, located_options, files)
                if files is not None:
                    result = replace(result, path=files.url or result.path, bytes_fetched=files.bytes_fetched,
                                     cache_hit=None if files.cached is None else not files.hashed)
        except Exception as e:
            explain_damage(self.comm, e, path, search_earlier=search_earlier)
            raise
        return result

    @contextlib.contextmanager
    def _located(self, path: str | os.PathLike[str], options: LoadOptions, cache: bool = False
                 ) -> Iterator[tuple[str | os.PathLike[str], LoadOptions, CheckpointFiles | None]]:
        """``path`` to load from, with the options to load it with, and the files the location reads it through
        (collective; ``None``: a directory, read in place). A checkpoint on a store keeps its data objects where
        they lie, verified as they are read by ranges, or is a verified copy whose checksums are not taken again
        (see :func:`~.location.protocol.reading`)."""
        try:
            location = locate(path, "checkpoint")
        except CheckpointError as e:
            e.every_rank = True
            raise
        verify_first = options.verify_checksums and not options.verify_while_reading
        with protocol.reading(location, self.comm, cache, verify_first) as files:
            if files is None:
                yield path, options, None
                return
            if files.hashed:
                options = replace(options, verify_checksums=False)
            elif files.verified_while_read:
                options = replace(options, verify_while_reading=True)
            yield files.root, options, files

    def _load(self, path: str | os.PathLike[str], options: LoadOptions, model_only: bool,
              files: CheckpointFiles | None = None) -> LoadResult:
        """:meth:`load` of a checkpoint directory (``files``: as :meth:`_resolve`)."""
        # 1.
        ckpt, iteration, manifest, verification = self._resolve(path, options, files)
        fmt = storage_format(manifest.format, f"checkpoint {ckpt}")
        if self.parts.states and not model_only and not fmt.holds_states:
            raise CheckpointFormatError(f"checkpoint {ckpt} is in the {fmt.name!r} format, which holds no "
                                        f"states ({', '.join(self.parts.states)})")
        # 2.
        self._check_fits(ckpt, manifest, options, model_only)
        # 3.
        request, with_optim = self._load_request(ckpt, manifest, options, model_only)
        same_layout = {k: manifest.layout.get(k) for k in ("tp", "pp", "dp", "vpp")} == {
            k: self.parts.layout.get(k) for k in ("tp", "pp", "dp", "vpp")}
        object_keys = [] if model_only else list(options.objects)
        if not manifest.trainable_only:
            self.parts.base_changed()  # a full checkpoint replaces the base too
        # 4.
        stored = self._open(fmt, verification, manifest, options)
        self.comm.agree(shape_mismatch(request, stored.tensor_shapes, ckpt))
        report = self._check_keys(ckpt, manifest, stored, request, options, with_optim)
        wanted = objects_to_read(self.parts, manifest, stored.object_keys, object_keys, options, model_only,
                                 with_optim, same_layout, ckpt)
        request.update(dict.fromkeys(wanted.keys))
        self._read(request, stored, verification)
        objects = {k: request[k] for k in wanted.keys}
        apply_objects(self.parts, ckpt, objects, wanted, options, with_optim)
        if options.load_rng and not model_only and not same_layout and self.parts.rank == 0:
            warnings.warn(f"checkpoint layout {manifest.layout} differs from this run's {self.parts.layout}: "
                          "RNG state is re-seeded instead of restored", stacklevel=2)
        return LoadResult(ckpt, iteration, manifest, objects, report, rng_restored=wanted.rng is not None)

    def _check_fits(self, ckpt: Path, manifest: Manifest, options: LoadOptions, model_only: bool) -> None:
        """Load step 2 (collective): refuse a checkpoint made for another architecture, adapter or base."""
        self.comm.agree(quantization_mismatch(self.parts.model_config, manifest, ckpt))
        self.comm.agree(architecture_mismatch(self.parts.model_config, manifest, ckpt))
        self.comm.agree(adapter_mismatch(self.parts.adapter_config, manifest, ckpt))
        if manifest.trainable_only and options.verify_base and not model_only:
            # Fingerprint what the checkpoint calls its base (its excluded keys), not what is frozen now: a
            # parameter unfrozen since is reported as an unexpected key, with its own hint.
            mine = self.parts.fingerprint(sorted(manifest.excluded_keys),
                                    fingerprint_version(manifest.base_fingerprint or ""))
            self.comm.agree(base_mismatch(manifest, mine, ckpt))

    def _load_request(self, ckpt: Path, manifest: Manifest, options: LoadOptions, model_only: bool
                      ) -> tuple[dict[str, Any], bool]:
        """Load step 3: this rank's ``{storage key: entry}`` to read, and whether it includes the optimizer."""
        with_optim = options.load_optim and not model_only
        if with_optim and self.parts.optimizer is not None and OPTIMIZER not in manifest.sections:
            # Recorded, not guessed: the manifest says the save left the optimizer out (--no-save-optim,
            # import-peft). Its keys are not "missing"; the optimizer starts fresh, and we say so.
            with_optim = False
            if self.parts.rank == 0:
                warnings.warn(f"checkpoint {ckpt} was saved without optimizer state (SaveOptions(save_optim=False) or an "
                              "import): the optimizer starts fresh", stacklevel=3)
        request = self.parts.build(manifest.trainable_only, with_optim).tensors()
        if manifest.trainable_only:  # buffers, which trainable-only saves of earlier releases left out
            for k in set(manifest.excluded_keys) & set(request):
                if not request[k].requires_grad:
                    request.pop(k)
        return request, with_optim

    def _open(self, fmt: StorageFormat, verification: ReadVerification, manifest: Manifest, options: LoadOptions
              ) -> StoredCheckpoint:
        """Open the checkpoint in its format for this rank (collective: a refusal is every rank's); what it reads
        is verified as it is read unless :meth:`_resolve` hashed every file first (or nothing is verified)."""
        stored: StoredCheckpoint | None = None
        error: BaseException | None = None
        try:
            verify = options.verify_checksums and options.verify_while_reading
            stored = fmt.open(verification.ckpt, manifest, self.parts.layout, self.parts.coords, self.comm.group,
                              verify, verification.files.sources)
        except BaseException as e:  # noqa: BLE001 - refused, or a file unreadable since it was verified
            error = as_read_error(e, verification.ckpt)
        self.comm.agree(error)
        assert stored is not None
        return stored

    def _check_keys(self, ckpt: Path, manifest: Manifest, stored: StoredCheckpoint, request: dict[str, Any],
                    options: LoadOptions, with_optim: bool) -> KeyReport:
        """The strictness mode against the stored keys (collective); unexpected keys leave the request."""
        saved = set(stored.tensor_shapes)
        hints = {k: ("trainable now but frozen when the checkpoint was saved, so it is not in it: its value must "
                     "come from the base (load_pretrained); LoadOptions.strictness = log_unexpected keeps that value")
                 for k in manifest.excluded_keys}
        all_requested = None
        if options.strictness.needs_missing:
            all_requested = set(request) if stored.per_rank else {
                k for keys in self.comm.gather(sorted(request)) for k in keys}
            saved = {k for k in saved if k.startswith((MODEL + ".", OPTIMIZER + ".")) and
                     (with_optim or not k.startswith(OPTIMIZER + "."))}
        error: BaseException | None = None
        report = KeyReport()
        try:
            report = check_keys(options.strictness, request, saved, self.parts.rank, all_requested, hints,
                                source=f"checkpoint {ckpt}")
        except CheckpointError as e:
            error = e
        self.comm.agree(error)
        for k in report.unexpected:
            request.pop(k, None)
        return report

    def _read(self, request: dict[str, Any], stored: StoredCheckpoint, verification: ReadVerification,
              fingerprinting: Fingerprinting | None = None) -> None:
        """Read the request in place, then finish the checksums started by :meth:`_resolve`; a
        failure on any rank is raised on every rank (a damaged file first: it explains a failed read).
        ``fingerprinting`` is handed each piece as soon as it is read."""
        error: BaseException | None = None
        problems: list[str] = []
        try:
            problems = stored.read(request, None if fingerprinting is None else fingerprinting.add)
            if stored.unindexed:  # objects without a block index (older writers): hashed whole by their readers
                problems += verification.files.checksum_problems(verification.manifest, stored.unindexed)
        except BaseException as e:  # noqa: BLE001 - reported collectively
            error = as_read_error(unwrap_dcp_error(e), verification.ckpt)
        self._finish_read(verification, problems, error)

    def _finish_read(self, verification: ReadVerification, problems: list[str], error: BaseException | None) -> None:
        """After a read: the damage it found and the checksums of :meth:`_resolve`, reported on every rank
        (first: damage explains a failed read), then the read's own ``error`` (agreed)."""
        if verification.future is not None:
            try:
                problems += verification.future.result()
            except OSError as e:  # a file gone or unreadable since it was checked: still a collective report
                problems.append(f"{getattr(e, 'filename', None) or verification.ckpt}: cannot be read to verify: {e}")
        self._raise_if_damaged(verification, problems, after_read=True)
        self.comm.agree(error)
