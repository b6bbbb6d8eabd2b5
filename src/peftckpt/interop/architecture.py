"""The architecture a checkpoint's manifest claims, held to the tensors the checkpoint stores, before any model is
built from it.

``train`` (its architecture and LoRA flags, when not given) and the interop tools size our GPT by a manifest's
``model_config`` and ``adapter_config``. A manifest is JSON anyone can rewrite and re-digest (its SHA-256 guards
against damage, not tampering): one claiming a far bigger model than its files hold would have the model built --
and allocated, on a GPU at once -- before a load compared a single shape. Here every such value is checked against
what the files hold: DCP ``.metadata``'s model keys and global shapes (which the whole-checkpoint check first holds
to the data files' sizes, so they are as large as the data and no larger); and, for a trainable-only checkpoint,
the manifest's record of the tensors it left out. The layer count is held to the layers named there before anything
is enumerated per layer; then the model the config describes is built on the meta device (names and shapes, no
storage) and compared tensor by tensor. A disagreement is one message naming the manifest, the value and the tensor
(``... says hidden_size 65536 but model.embedding.word_embeddings.weight is [96, 64] in .../.metadata``).

An HF directory's ``config.json`` gets the same treatment against its safetensors headers in
:class:`~peftckpt.interop.hf_dir.HFModelDir`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from ..checkpoint.checks.integrity import DCP_METADATA_FILENAME, storage_problems
from ..checkpoint.errors import CheckpointFormatError, CheckpointIntegrityError, CheckpointMismatchError
from ..checkpoint.location import protocol
from ..checkpoint.location.base import Location
from ..checkpoint.location.locate import locate
from ..checkpoint.location.names import MANIFEST_FILENAME
from ..checkpoint.state.sections import MODEL
from ..checkpoint.storage.manifest import TORCH_DIST, Manifest
from ..checkpoint.storage.safe_pickle import METADATA_MAX_BYTES, load_dcp_metadata
from ..model.config import GPTConfig, LoRAConfig
from .nf4_base import is_nf4

__all__ = ["ArchitectureMismatchError", "architecture_problem", "checked_manifest", "stored_model_shapes"]

Shapes = dict[str, tuple[int, ...]]
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
#: Which config value each dimension of a tensor is (``None``: a product of several).
_DIMS: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    ("embedding.word_embeddings.weight", ("vocab_size", "hidden_size")),
    ("output_layer.weight", ("vocab_size", "hidden_size")),
    ("embedding.position_embeddings.weight", ("max_position_embeddings", "hidden_size")),
    ("layernorm.weight", ("hidden_size",)),
    ("layernorm.bias", ("hidden_size",)),
    ("linear_qkv.weight", ("num_attention_heads/num_query_groups", "hidden_size")),
    ("linear_proj.weight", ("hidden_size", "hidden_size")),
    ("linear_fc1.weight", ("ffn_hidden_size", "hidden_size")),
    ("linear_fc2.weight", ("hidden_size", "ffn_hidden_size")),
)


class ArchitectureMismatchError(CheckpointMismatchError):
    """A manifest whose architecture disagrees with the tensors its checkpoint holds (the message names both)."""


def stored_model_shapes(metadata: Metadata) -> Shapes:
    """``{model name: global shape}`` of the model tensors DCP ``metadata`` describes."""
    prefix = MODEL + "."
    return {k[len(prefix):]: tuple(int(d) for d in md.size) for k, md in metadata.state_dict_metadata.items()
            if isinstance(k, str) and k.startswith(prefix) and isinstance(md, TensorStorageMetadata)}


def _typed(config: Mapping[str, Any], where: str) -> str | None:
    """Why a ``model_config`` value has a type its :class:`GPTConfig` field cannot take, or ``None``."""
    for f in dataclasses.fields(GPTConfig):
        if f.name not in config:
            continue
        value, kind = config[f.name], str(f.type)
        ok = (isinstance(value, bool) if kind == "bool" else
              isinstance(value, str) if kind == "str" else
              isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
              if kind == "float" else
              (value is None or isinstance(value, int)) and not isinstance(value, bool)
              if kind.startswith("int | None") else
              isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            return f"{where} says {f.name} {value!r}, which is not {_KINDS[kind.replace(' | None', '')]}"
    return None


_KINDS = {"int": "an integer", "float": "a finite number", "bool": "a boolean", "str": "a string"}


def _expected(cfg: GPTConfig, lora: LoRAConfig | None, quantized: bool = False) -> Shapes:
    """Names and global shapes of the model ``cfg`` (with ``lora``'s adapters; ``quantized``: its linear weights
    held in NF4) describes: built on the meta device."""
    from ..model import nf4
    from ..model.gpt import GPTModel
    from ..model.linear import ParallelLinear
    from ..model.lora import apply_lora

    model = GPTModel(cfg, device="meta")
    if lora is not None:
        apply_lora([model], lora, seed=0)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    if quantized:
        for name, module in model.named_modules():
            if isinstance(module, ParallelLinear):
                held = nf4.stored_shapes(shapes.pop(f"{name}.weight"))
                shapes.update({f"{name}.{suffix}": shape for suffix, shape in held.items()})
    return shapes


def _field_of(name: str, dim: int) -> str | None:
    for suffix, fields in _DIMS:
        if name.endswith(suffix):
            return fields[dim] if dim < len(fields) else None
    return None


def _shape_problem(name: str, shape: tuple[int, ...], expected: tuple[int, ...], config: Mapping[str, Any],
                   adapter: Mapping[str, Any] | None, where: str, held: str) -> str:
    """One line naming the config value that ``name``'s ``shape`` (in ``held``) contradicts."""
    leaf = name.rsplit(".", 1)[-1]
    for dim, (got, want) in enumerate(zip(shape, expected)):
        if got == want:
            continue
        if adapter is not None and leaf.startswith(("lora_A", "lora_B")) and dim == (0 if leaf.startswith("lora_A")
                                                                                   else 1):
            return (f"{where} says adapter_config rank {adapter.get('rank')} but {MODEL}.{name} is {list(shape)} "
                    f"in {held}")
        field = _field_of(name, dim)
        if field is not None and all(f in config for f in field.split("/")):
            says = " and ".join(f"{f} {config[f]}" for f in field.split("/"))
            return f"{where} says {says} but {MODEL}.{name} is {list(shape)} in {held}"
        break
    return (f"{where}: its model_config implies {MODEL}.{name} of shape {list(expected)}, but it is {list(shape)} in "
            f"{held}")


def _first(names: set[str]) -> list[str]:
    """The names in message order: embedding, final norm and output layer first, then the layers."""
    head = ("embedding.", "decoder.final_layernorm.", "output_layer.")
    return sorted(names, key=lambda n: (not n.startswith(head), n))


def architecture_problem(manifest: Manifest, stored: Shapes, where: str, held: str) -> str | None:
    """Why the manifest's ``model_config`` (and ``adapter_config``) cannot describe the model whose tensors are
    ``stored`` (data-backed: ``{model name: global shape}``) plus, for a trainable-only checkpoint, those its
    ``excluded_keys`` record; ``None`` when it fits. ``where`` names the manifest, ``held`` where ``stored`` was
    read. A config that is not our GPT's (no field of :class:`GPTConfig`) is not checked."""
    config = manifest.model_config
    if not any(f.name in config for f in dataclasses.fields(GPTConfig)):
        return None
    typed = _typed(config, where)
    if typed is not None:
        return typed
    try:
        cfg = GPTConfig.from_dict(config)
    except (TypeError, ValueError):
        return None  # not buildable at all: the flags' own checks say which value, naming the manifest
    prefix = MODEL + "."
    left_out = {k[len(prefix):]: tuple(r["shape"]) for k, r in manifest.excluded_keys.items() if k.startswith(prefix)}
    recorded = set(stored) | set(left_out)
    widths = {"embedding.word_embeddings.weight": (cfg.vocab_size, cfg.hidden_size),
              "output_layer.weight": (cfg.vocab_size, cfg.hidden_size),
              "decoder.final_layernorm.weight": (cfg.hidden_size,)}
    for name, want in widths.items():  # the values that size everything, named before the layers are counted
        if name in stored and tuple(stored[name]) != want:
            return _shape_problem(name, stored[name], want, config, None, where, held)
    layers = {int(m.group(1)) for n in recorded if (m := _LAYER.match(n))}
    if layers != set(range(cfg.num_layers)):
        top = max(layers, default=None)
        holds = ("no layer" if top is None else f"layers 0-{top}" if len(layers) == top + 1
                 else f"{len(layers)} layers numbered up to {top}")
        kind = " (stored or recorded as left out)" if left_out else ""
        return (f"{where} says num_layers {config.get('num_layers', cfg.num_layers)} but the checkpoint holds {holds}"
                f"{kind} ({prefix}decoder.layers.N.* in {held})")
    adapter = manifest.adapter_config
    lora = None
    if adapter:
        try:
            lora = LoRAConfig.from_dict(adapter)
        except (TypeError, ValueError):
            return None  # the LoRA flags' own checks say which value
    try:
        expected = _expected(cfg, lora, is_nf4(config))
    except (TypeError, ValueError):
        return None
    for name in _first(set(stored)):
        if name not in expected:
            return (f"{where}: its model_config and adapter_config describe no tensor {prefix}{name}, which the "
                    f"checkpoint stores ({held})")
        if tuple(stored[name]) != expected[name]:
            return _shape_problem(name, stored[name], expected[name], config, adapter, where, held)
    for name in _first(set(left_out) - set(stored)):
        if expected.get(name) != left_out[name]:
            return (f"{where}: its excluded_keys record {prefix}{name} as {list(left_out[name])}, which its "
                    "model_config does not describe" + (f" (it implies {list(expected[name])})" if name in expected
                                                        else ""))
    missing = _first(set(expected) - recorded)
    if missing:
        return (f"{where}: its model_config implies {prefix}{missing[0]} {list(expected[missing[0]])}"
                + (f" and {len(missing) - 1} more tensor(s)" if len(missing) > 1 else "")
                + f", which the checkpoint neither stores ({held}) nor records as left out")
    return None


def _metadata_of(loc: Location, rel: str, manifest: Manifest) -> Metadata:
    """DCP ``.metadata`` of checkpoint ``rel`` of ``loc``, once the whole-checkpoint check holds it to the files'
    sizes (so its shapes are as large as the stored data, no larger).

    Raises:
        CheckpointError: it cannot be read, or does not describe a whole checkpoint (naming why).
    """
    local = loc.local_dir(rel)
    if local is not None:
        metadata = load_dcp_metadata(local / DCP_METADATA_FILENAME)
        problems = storage_problems(local, metadata, manifest.files, manifest.saved_keys)
    else:
        # An object store: .metadata alone is fetched and held to the sizes the (self-checksummed) manifest
        # records. The objects themselves are not listed here: every rank runs this before the job starts, and a
        # LIST per rank would grow with the job; the load checks each object it reads against the manifest.
        problems = []
        with tempfile.TemporaryDirectory(prefix="peftckpt-metadata.") as tmp:
            name = f"{rel}/{DCP_METADATA_FILENAME}" if rel else DCP_METADATA_FILENAME
            try:
                data = loc.read_small(name, METADATA_MAX_BYTES)
            except (OSError, ValueError) as e:
                raise CheckpointFormatError(f"{loc.describe(name)} cannot be read: {e}") from None
            (Path(tmp) / DCP_METADATA_FILENAME).write_bytes(data)
            metadata = load_dcp_metadata(Path(tmp) / DCP_METADATA_FILENAME)
            sizes = {r: int(rec["size"]) for r, rec in manifest.files.items()}
            problems += storage_problems(Path(tmp), metadata, manifest.files, manifest.saved_keys, stored=sizes)
    if problems:
        raise CheckpointIntegrityError(f"checkpoint {loc.describe(rel)} is damaged:\n  " + "\n  ".join(problems))
    return metadata


def _held_by_files(loc: Location, rel: str, manifest: Manifest, where: str) -> str | None:
    """A checkpoint without DCP metadata (the legacy ``torch`` format): the model its manifest records must fit in
    the bytes its files hold (their sizes checked on disk)."""
    problems = loc.size_problems(rel, manifest)
    if problems:
        raise CheckpointIntegrityError(f"checkpoint {loc.describe(rel)} is damaged:\n  " + "\n  ".join(problems))
    on_disk = sum(int(rec["size"]) for rec in manifest.files.values())
    claimed = 0
    for rec in manifest.saved_keys.values():
        dtype = getattr(torch, str(rec["dtype"]), None)
        claimed += math.prod(rec["shape"]) * (dtype.itemsize if isinstance(dtype, torch.dtype) else 1)
    if claimed > on_disk:
        return (f"{where} records {claimed} bytes of saved tensors, but the checkpoint's files hold {on_disk} "
                "bytes: its records were altered")
    return None


def checked_manifest(path: str | os.PathLike[str] | Location, what: str = "checkpoint") -> Manifest:
    """The manifest of the committed checkpoint ``path`` designates (as a load resolves it), once its
    architecture is held to the tensors the checkpoint stores (see the module docstring).

    Raises:
        ArchitectureMismatchError: the manifest claims another model than its checkpoint holds, naming the value
            and the tensor.
        CheckpointError: no committed checkpoint there, its manifest is unreadable (as :func:`manifest_at`), or
            its ``.metadata`` does not describe a whole checkpoint: nothing it says can be trusted.
    """
    loc = locate(path, what)
    rel, _ = protocol.resolve(loc)
    manifest = loc.read_manifest(rel)
    where = f"manifest {loc.describe(f'{rel}/{MANIFEST_FILENAME}' if rel else MANIFEST_FILENAME)}"
    if manifest.format != TORCH_DIST:
        problem = _held_by_files(loc, rel, manifest, where)
        stored: Shapes = {k.removeprefix(MODEL + "."): tuple(r["shape"]) for k, r in manifest.saved_keys.items()
                          if k.startswith(MODEL + ".")}
        held = "its saved_keys"
    else:
        stored = stored_model_shapes(_metadata_of(loc, rel, manifest))
        held = loc.describe(f"{rel}/{DCP_METADATA_FILENAME}" if rel else DCP_METADATA_FILENAME)
        problem = None
    problem = problem or architecture_problem(manifest, stored, where, held)
    if problem is not None:
        raise ArchitectureMismatchError(problem + "; nothing was built from it")
    return manifest
