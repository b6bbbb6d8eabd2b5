"""Load-time checks of a checkpoint against the model: each returns the one error to raise (or ``None``), so the
caller can agree on it across ranks before anything is read."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...sharding.entries import GlobalTensor
from ..errors import CheckpointFormatError, CheckpointIntegrityError, CheckpointMismatchError, StrictnessError
from ..storage.manifest import Manifest
from .strictness import StrictHandling

__all__ = ["QUANTIZATION_KEY", "adapter_mismatch", "architecture_mismatch", "quantization_mismatch", "base_mismatch",
           "damaged", "is_damage", "EarlierCheckpoints", "damage_hint", "optimizer_state_missing", "shape_mismatch"]


def damaged(ckpt: Path, problems: list[str], after_read: bool = False) -> CheckpointIntegrityError | None:
    """Every rank's damaged-file ``problems`` as one error, or ``None``."""
    if not problems:
        return None
    return CheckpointIntegrityError(
        f"checkpoint {ckpt} is damaged:\n  " + "\n  ".join(problems)
        + ("\nits data files were checked while they were read, so the model and optimizer may hold "
           "values from them: load again from an intact checkpoint" if after_read else ""))


def is_damage(e: BaseException) -> bool:
    """Whether ``e`` says that the files of the checkpoint a load resolved are damaged: a checksum, a missing,
    truncated or unlisted file, unreadable bytes (:class:`CheckpointIntegrityError`), or a manifest that cannot
    be read or parsed (its messages start with ``manifest``; a manifest of a newer format version is not damage)."""
    if isinstance(e, CheckpointIntegrityError):
        return True
    return isinstance(e, CheckpointFormatError) and str(e).startswith("manifest ")


@dataclass
class EarlierCheckpoints:
    """What a search for the newest intact committed checkpoint before a damaged one found (newest first)."""

    location: str
    """The save location searched, as messages name it."""
    intact: str | None = None
    """The newest intact earlier checkpoint, as the library loads it (a path or a URL); ``None``: none found."""
    intact_iteration: int | None = None
    damaged: list[int] = field(default_factory=list)
    """Earlier iterations that were verified and found damaged, newest first."""
    unchecked: int = 0
    """Earlier committed iterations left unverified (the search stops after a few)."""


def damage_hint(earlier: EarlierCheckpoints | None, checksums_help: bool) -> str:
    """The lines a damage error of a load ends with: the newest intact earlier checkpoint and how to load it, or
    that there is none; skipping the checksums (``checksums_help``: they are what failed, and skipping them is
    possible) only as the last resort. ``earlier`` is ``None`` when the checkpoint is not in a save location."""
    lines = []
    if earlier is not None:
        also = ""
        if earlier.damaged:
            its = ", ".join(map(str, earlier.damaged))
            also = f" (iteration{'s' if len(earlier.damaged) > 1 else ''} {its} {'are' if len(earlier.damaged) > 1 else 'is'} damaged too)"
        if earlier.intact is not None:
            lines.append(f"the newest intact earlier checkpoint in {earlier.location} is iteration "
                         f"{earlier.intact_iteration}{also}: resume from it explicitly with "
                         f"Checkpointer.load({earlier.intact!r}) (a load never goes back to an earlier checkpoint "
                         "by itself)")
        elif earlier.unchecked:
            lines.append(f"no intact earlier checkpoint among the {len(earlier.damaged)} newest in {earlier.location}"
                         f"{also}; `peftckpt verify --all {earlier.location}` checks the {earlier.unchecked} older one(s)")
        elif earlier.damaged:
            lines.append(f"no intact earlier checkpoint in {earlier.location}{also}")
        else:
            lines.append(f"no intact earlier checkpoint in {earlier.location} (none is committed before it)")
    if checksums_help and (earlier is None or earlier.intact is None):
        lines.append(("as a last resort, " if earlier is not None else "")
                     + "LoadOptions(verify_checksums=False) loads it without its checksums, damaged bytes and all")
    return "".join(f"\n{line}" for line in lines)


QUANTIZATION_KEY = "base_quantization"
"""The ``model_config`` key that says how the frozen base is held (absent: in full precision), e.g. ``{"method":
"nf4", "block_size": 64, ...}``: an adapter trained on a base quantized one way is refused on a base held another."""


def architecture_mismatch(model_config: Mapping[str, Any], manifest: Manifest, ckpt: Path
                          ) -> CheckpointMismatchError | None:
    """The architecture keys both know whose values differ (how the base is held: :func:`quantization_mismatch`)."""
    diffs = [f"  {k}: checkpoint {manifest.model_config.get(k)!r}, model {v!r}"
             for k, v in model_config.items() if k in manifest.model_config and manifest.model_config[k] != v
             and k != QUANTIZATION_KEY]
    if not diffs:
        return None
    return CheckpointMismatchError(f"checkpoint {ckpt} was saved for a different architecture:\n"
                                   + "\n".join(diffs) + "\nfix the model configuration to match the checkpoint")


def _held(record: Any) -> str:
    if not record:
        return "in full precision (not quantized)"
    if isinstance(record, Mapping):
        details = ", ".join(f"{k} {v}" for k, v in sorted(record.items()) if k != "method")
        return f"in {record.get('method', '?')}" + (f" ({details})" if details else "")
    return f"as {record!r}"


def quantization_mismatch(model_config: Mapping[str, Any], manifest: Manifest, ckpt: Path
                          ) -> CheckpointMismatchError | None:
    """A checkpoint trained on a base held otherwise than this model's (quantized another way, or not at all):
    its adapters learned to correct that base, so they are refused on another (as one error)."""
    saved, mine = manifest.model_config.get(QUANTIZATION_KEY), model_config.get(QUANTIZATION_KEY)
    if (saved or None) == (mine or None):
        return None
    return CheckpointMismatchError(
        f"checkpoint {ckpt} was trained on a base held {_held(saved)}; this model's base is held {_held(mine)}: "
        f"hold the base the way the checkpoint's was (model_config['{QUANTIZATION_KEY}'])")


_ADAPTER_KEYS = ("rank", "alpha", "target_modules", "layers", "train_params")
"""The adapter configuration that decides which tensors exist and what they compute (dropout may change)."""


def _canonical(key: str, value: Any) -> Any:
    return sorted(value) if key in ("target_modules", "layers", "train_params") and value is not None else value


def adapter_mismatch(adapter_config: Mapping[str, Any] | None, manifest: Manifest, ckpt: Path
                     ) -> CheckpointMismatchError | None:
    """The adapter settings (rank, alpha, targets, layers, unfrozen base parameters) that differ between the
    checkpoint and the model, as one error naming each key: a resume onto other adapters would
    otherwise fail on shapes, or silently drop the adapters this model no longer has."""
    saved = manifest.adapter_config
    if not adapter_config or not saved:
        return None
    diffs = [f"  adapter_config[{key!r}]: checkpoint {saved.get(key)!r}, model {adapter_config.get(key)!r}"
             for key in _ADAPTER_KEYS if key in saved and key in adapter_config
             and _canonical(key, saved[key]) != _canonical(key, adapter_config[key])]
    if not diffs:
        return None
    return CheckpointMismatchError(
        f"checkpoint {ckpt} was saved with a different adapter configuration:\n" + "\n".join(diffs)
        + "\nmake the adapter_config match the checkpoint's")


def base_mismatch(manifest: Manifest, mine: str, ckpt: Path) -> CheckpointMismatchError | None:
    """An adapter checkpoint whose recorded base fingerprint is not this model's (``mine``)."""
    if not manifest.base_fingerprint or manifest.base_fingerprint == mine:
        return None
    return CheckpointMismatchError(
        f"adapter checkpoint {ckpt} was trained on a different base model:\n"
        f"  base fingerprint in the checkpoint: {manifest.base_fingerprint}\n"
        f"  base fingerprint of this model:     {mine}\n"
        "load the base it was trained on (load_pretrained), or pass LoadOptions(verify_base=False) to override")


def shape_mismatch(request: Mapping[str, Any], stored: Mapping[str, Sequence[int] | None], ckpt: Path
                   ) -> CheckpointMismatchError | None:
    """The requested tensors that ``ckpt`` stores (``{key: global shape, or None where unknown}``) with another
    global shape, as one error (or ``None``)."""
    diffs = [f"  {k}: checkpoint {list(shape)}, model {list(v.global_shape)}"
             for k, v in sorted(request.items()) if isinstance(v, GlobalTensor)
             and (shape := stored.get(k)) is not None and list(shape) != list(v.global_shape)]
    if not diffs:
        return None
    return CheckpointMismatchError(
        f"checkpoint {ckpt} stores {len(diffs)} tensor(s) with another shape than this model's:\n"
        + "\n".join(diffs[:10]) + ("\n  ..." if len(diffs) > 10 else "")
        + "\nthe model (its configuration and adapters) must match the checkpoint's")


def optimizer_state_missing(absent: Sequence[str], strictness: StrictHandling, rank: int, ckpt: Path
                            ) -> StrictnessError | None:
    """The optimizer state entries (``absent``) this rank's parameters lack in ``ckpt``, as one error unless the
    strictness mode skips what is absent."""
    if not absent or strictness.removes_unexpected:
        return None
    return StrictnessError(f"rank {rank}: checkpoint {ckpt} lacks the optimizer state of {len(absent)} "
                           f"parameter(s): {', '.join(absent[:10])}; pass LoadOptions(load_optim=False) to start a fresh optimizer")
