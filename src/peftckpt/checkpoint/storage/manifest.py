"""The JSON manifest of a checkpoint (never pickle).

The manifest is ``<ckpt>/metadata.json``; the commit protocol (:mod:`peftckpt.checkpoint.location.protocol`) writes it last, so
its presence means "committed". It records what was saved and how plus the size and
checksum of every other file of the checkpoint (:mod:`peftckpt.checkpoint.storage.checksums` computes and checks
them), and a SHA-256 of itself.
"""

from __future__ import annotations

import collections
import datetime
import hashlib
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import peftckpt
from peftckpt.checkpoint.errors import CheckpointFormatError, CheckpointIntegrityError
from peftckpt.checkpoint.location.names import MANIFEST_FILENAME
from peftckpt.checkpoint.storage.paths import read_regular_file, relpath_problem

from ...json_text import parse_json

__all__ = [
    "CHECKSUM_ALGORITHM",
    "CHECKSUM_ALGORITHMS",
    "FORMAT_VERSION",
    "KNOWN_FORMATS",
    "TORCH",
    "TORCH_DIST",
    "Manifest",
    "read_manifest",
]

FORMAT_VERSION = 1
"""Newest manifest format version this library writes and reads."""

CHECKSUM_ALGORITHM = "xxh3_128"
"""Checksum recorded in new manifests (see :mod:`~peftckpt.checkpoint.storage.checksums` for why)."""

CHECKSUM_ALGORITHMS: tuple[str, ...] = ("xxh3_128", "xxh3_64", *sorted(
    hashlib.algorithms_guaranteed - {"shake_128", "shake_256"}))
"""The ``checksum_algorithm`` values a manifest may record: XXH3 (xxhash) and every fixed-length hash that
hashlib has everywhere (older checkpoints record ``sha256``). SHAKE is left out: its digest length is not part of
its name."""

MANIFEST_MAX_BYTES = 256 << 20
"""Largest manifest read (one of a 70B model with every key recorded is a few MB)."""

TORCH_DIST = "torch_dist"
TORCH = "torch"
KNOWN_FORMATS = (TORCH_DIST, TORCH)
"""Checkpoint formats: ``torch_dist`` (DCP directory) and ``torch`` (legacy per-rank ``.pt`` files)."""


def _now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclass
class Manifest:
    """Everything a loader or ``peftckpt verify`` needs to know about a checkpoint, as JSON."""

    format: str
    """``"torch_dist"`` or ``"torch"``."""
    iteration: int
    """Training iteration of the checkpoint (0 = before the first optimizer step)."""
    sections: list[str] = field(default_factory=list)
    """State-dict sections saved (``model``, ``optimizer``, ``rng_state``, ...)."""
    layout: dict[str, int] = field(default_factory=dict)
    """Parallel layout at save time: ``tp``, ``pp``, ``dp``, ``vpp``."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """The model's configuration (JSON-serialisable)."""
    trainable_only: bool = False
    """Whether frozen model entries were left out (``--save-trainable-params-only``)."""
    saved_keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Saved model tensors: flattened DCP key -> ``{"shape": [...], "dtype": "float32", "requires_grad"}``.
    Shapes are global (layout independent)."""
    excluded_keys: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Frozen model tensors left out of a trainable-only save, same record shape as ``saved_keys``."""
    adapter_config: dict[str, Any] | None = None
    """The adapter (LoRA) configuration, or ``None`` for a model without adapters."""
    base_fingerprint: str | None = None
    """Layout-independent fingerprint of the frozen base weights, or ``None`` when not computed."""
    base_sums: dict[str, list[int]] | None = None
    """A full checkpoint's per-tensor fingerprint sums, where the save knew them (``import-hf`` takes them as it
    writes; a run's full save records those its base load took): key -> ``[version, sum, ...]``. A load of the
    checkpoint as a base that verifies what it reads takes them instead of summing those bytes again. Optional
    (checkpoints before it lack it)."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every other file of the checkpoint: POSIX relative path -> ``{"size": int, "checksum": str}``."""
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    """Algorithm behind ``files[...]["checksum"]``: ``xxh3_128`` or a hashlib name (older checkpoints: sha256)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Free-form run arguments (JSON-serialisable)."""
    format_version: int = FORMAT_VERSION
    """Manifest format version; a newer one than :data:`FORMAT_VERSION` is refused."""
    library_version: str = peftckpt.__version__
    """peftckpt version that wrote the checkpoint."""
    created_at: str = field(default_factory=_now_iso)
    """UTC ISO-8601 time of the save."""

    def to_json(self) -> bytes:
        """Stable UTF-8 JSON (sorted keys; one line per field, and per entry of a mapping field; trailing
        newline), with ``manifest_sha256``: the SHA-256 of the canonical JSON of the other fields, so a damaged
        manifest is detected too. Every value is encoded by ``json``'s C encoder (an indented dump runs its
        pure-Python one: ~40 ms for the key records of a model of a few thousand tensors)."""
        body: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}  # JSON values already
        texts = {key: _field_texts(key, value) for key, value in body.items()}
        checksum = hashlib.sha256(_canonical(texts).encode()).hexdigest()
        texts[SELF_CHECKSUM_KEY] = (_ENCODE(checksum), _ENCODE(checksum))
        return ("{\n" + ",\n".join(f"  {_ENCODE(k)}: {texts[k][1]}" for k in sorted(texts)) + "\n}\n").encode()

    @property
    def holds_every_weight(self) -> bool:
        """Every model tensor is stored: a full checkpoint, or a trainable-only one that left nothing out (a run
        with nothing frozen). Such a checkpoint serves as a base, whatever option saved it."""
        return not self.trainable_only or not self.excluded_keys

    @property
    def total_bytes(self) -> int:
        """Sum of the recorded file sizes."""
        return sum(int(rec["size"]) for rec in self.files.values())

    @classmethod
    def from_json(cls, data: bytes, source: Path) -> Manifest:
        """Parse and validate manifest bytes read from ``source`` (named in every error).

        Raises:
            CheckpointFormatError: malformed JSON, a missing or mistyped field, an unknown format, or a
                format version newer than this library reads.
        """
        try:
            raw = parse_json(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointFormatError(f"manifest {source} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointFormatError(
                f"manifest {source} must hold a JSON object, got {type(raw).__name__}"
            )

        # Version first: a newer writer may have changed anything else.
        version = raw.get("format_version", FORMAT_VERSION)
        if not _is_int(version):
            raise CheckpointFormatError(
                f"manifest {source}: field 'format_version' must be an int, got {version!r}"
            )
        if version > FORMAT_VERSION:
            raise CheckpointFormatError(
                f"checkpoint {source} has format version {version} but this peftckpt "
                f"({peftckpt.__version__}) reads up to {FORMAT_VERSION}; upgrade peftckpt"
            )

        recorded = raw.pop(SELF_CHECKSUM_KEY, None)
        if recorded is not None and recorded != _self_checksum(raw):
            raise CheckpointIntegrityError(
                f"manifest {source} is damaged: its content does not match its {SELF_CHECKSUM_KEY} "
                f"({recorded})"
            )
        problems = []
        names = {f.name for f in fields(cls)}
        missing = sorted(names - raw.keys() - _OPTIONAL_FIELDS)
        if missing:
            problems.append(f"missing field(s) {', '.join(missing)}")
        for name, check, expected in _FIELD_CHECKS:
            if name in raw and not check(raw[name]):
                problems.append(f"field {name!r} must be {expected}, got {_short(raw[name])}")
        algorithm = raw.get("checksum_algorithm")
        if isinstance(algorithm, str) and algorithm not in CHECKSUM_ALGORITHMS:
            problems.append(f"unknown checksum_algorithm {_short(algorithm)}, which this peftckpt cannot verify "
                            f"(supported: {', '.join(CHECKSUM_ALGORITHMS)})")
        if "format" in raw and isinstance(raw["format"], str) and raw["format"] not in KNOWN_FORMATS:
            problems.append(f"unknown format {raw['format']!r} (known: {', '.join(KNOWN_FORMATS)})")
        for name in ("saved_keys", "excluded_keys"):
            if isinstance(raw.get(name), dict):
                problems.extend(_check_key_records(name, raw[name]))
        if isinstance(raw.get("files"), dict):
            problems.extend(_check_file_records(raw["files"]))
        if problems:
            raise CheckpointFormatError(f"manifest {source} is malformed: " + "; ".join(problems))
        return cls(**{name: raw[name] for name in names if name in raw})


SELF_CHECKSUM_KEY = "manifest_sha256"
_OPTIONAL_FIELDS = {"base_sums"}
"""Fields added after format version 1 was fixed: a manifest without them reads as their default."""


_ENCODE = json.JSONEncoder(sort_keys=True, allow_nan=False).encode
"""One encoder for every value (``json.dumps`` builds one per call given options): its text of a value is the
canonical one (``json.dumps(value, sort_keys=True, allow_nan=False)``)."""
_MEMO_KEYS = frozenset({"saved_keys", "excluded_keys", "base_sums"})
"""The fields whose texts are kept: their values' types are fixed (ints, strings, bools), so equal values have one
text (``args``, free-form, could hold ``1`` where the last save held ``1.0``)."""
_MEMO_MIN_ENTRIES = 64
_MEMO_FIELDS = 8
_memo: collections.OrderedDict[tuple[str, int], tuple[dict[str, Any], str, str]] = collections.OrderedDict()
"""Large key-record fields' texts, by field name and entry count: ``(a private copy of the value, its canonical
JSON, its entry-per-line text)``. Every save of a run records the same key records (a few thousand entries, whose
encoding one by one was most of a small adapter save's manifest); a value equal to the copy has the same texts.
(``==`` equates ``True`` with ``1``: the key records' fields are typed by the code that builds them.)"""
_memo_lock = threading.Lock()


def _field_texts(key: str, value: Any) -> tuple[str, str]:
    """A manifest field's value as canonical JSON and as the manifest writes it (a mapping with string keys: an
    entry per line below the field)."""
    if not (isinstance(value, dict) and value):
        text = _ENCODE(value)
        return text, text
    kept = key in _MEMO_KEYS and len(value) >= _MEMO_MIN_ENTRIES
    memo_key = (key, len(value))
    with _memo_lock:
        held = _memo.get(memo_key) if kept else None
    if held is not None and held[0] == value:
        return held[1], held[2]
    canonical = _ENCODE(value)
    if not all(isinstance(k, str) for k in value):
        return canonical, canonical
    entries = ",\n".join(f"    {_ENCODE(k)}: {_ENCODE(value[k])}" for k in sorted(value))
    lines = f"{{\n{entries}\n  }}"
    if kept:
        with _memo_lock:  # (an async save commits on a thread of its own)
            _memo[memo_key] = (json.loads(canonical), canonical, lines)
            while len(_memo) > _MEMO_FIELDS:
                _memo.popitem(last=False)
    return canonical, lines


def _canonical(texts: Mapping[str, tuple[str, str]]) -> str:
    """The canonical JSON (``json.dumps(body, sort_keys=True)``) of a body whose values' texts are ``texts``, less
    the manifest's own checksum."""
    return "{" + ", ".join(f"{_ENCODE(k)}: {texts[k][0]}" for k in sorted(texts) if k != SELF_CHECKSUM_KEY) + "}"


def _self_checksum(body: Mapping[str, Any]) -> str:
    return hashlib.sha256(_canonical({k: _field_texts(k, v) for k, v in body.items()}).encode()).hexdigest()


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_str_dict(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


_FIELD_CHECKS: tuple[tuple[str, Any, str], ...] = (
    ("format", lambda v: isinstance(v, str), "a string"),
    ("library_version", lambda v: isinstance(v, str), "a string"),
    ("iteration", lambda v: _is_int(v) and v >= 0, "an int >= 0"),
    ("sections", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v), "a list of strings"),
    ("layout", lambda v: _is_str_dict(v) and all(_is_int(x) for x in v.values()), "an object of ints"),
    ("model_config", _is_str_dict, "an object"),
    ("trainable_only", lambda v: isinstance(v, bool), "a bool"),
    ("saved_keys", _is_str_dict, "an object"),
    ("excluded_keys", _is_str_dict, "an object"),
    ("adapter_config", lambda v: v is None or _is_str_dict(v), "an object or null"),
    ("base_fingerprint", lambda v: v is None or isinstance(v, str), "a string or null"),
    ("base_sums", lambda v: v is None or (_is_str_dict(v) and all(
        isinstance(r, list) and len(r) >= 2 and all(_is_int(x) and x >= 0 for x in r) for r in v.values())),
     "null or an object of lists of ints >= 0"),
    ("files", _is_str_dict, "an object"),
    ("checksum_algorithm", lambda v: isinstance(v, str), "a string"),
    ("args", _is_str_dict, "an object"),
    ("created_at", lambda v: isinstance(v, str), "a string"),
)


def _check_key_records(section: str, records: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, rec in records.items():
        ok = (
            isinstance(rec, dict)
            and isinstance(rec.get("shape"), list)
            and all(_is_int(d) and d >= 0 for d in rec["shape"])
            and isinstance(rec.get("dtype"), str)
            and isinstance(rec.get("requires_grad"), bool)
        )
        if not ok:
            problems.append(
                f"{section}[{key!r}] must be {{'shape': [int], 'dtype': str, 'requires_grad': bool}}, "
                f"got {_short(rec)}"
            )
    return problems


def _check_file_records(records: Mapping[str, Any]) -> list[str]:
    problems = []
    for rel, rec in records.items():
        ok = (
            isinstance(rec, dict)
            and _is_int(rec.get("size"))
            and rec["size"] >= 0
            and isinstance(rec.get("checksum"), str)
        )
        if not ok:
            problems.append(f"files[{rel!r}] must be {{'size': int, 'checksum': str}}, got {_short(rec)}")
        elif relpath_problem(rel) is not None or rel == MANIFEST_FILENAME:
            problems.append(f"files[{rel!r}] must name a file inside the checkpoint other than the manifest "
                            f"(it {relpath_problem(rel) or 'is the manifest'})")
    return problems


def read_manifest(ckpt_dir: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``<ckpt_dir>/metadata.json``.

    Raises:
        CheckpointFormatError: no manifest (the directory is not a committed peftckpt checkpoint) or an
            invalid one.
    """
    path = Path(ckpt_dir) / MANIFEST_FILENAME
    try:
        data = read_regular_file(path, MANIFEST_MAX_BYTES)
    except FileNotFoundError:
        raise CheckpointFormatError(
            f"{ckpt_dir} is not a committed peftckpt checkpoint: it has no {MANIFEST_FILENAME}"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"manifest {path} cannot be read: {exc}") from exc
    return Manifest.from_json(data, path)
