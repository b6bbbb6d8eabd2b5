"""An HF Llama model directory read lazily, as our model's tensors: any region of any of our global tensors
is assembled from the HF files' bytes on demand.

Opening validates everything that can be known without reading a weight: ``config.json`` maps to our
architecture, the index names no missing shard, every safetensors header is intact and covers its bytes,
and exactly the tensors a Llama of that config has are present, with their shapes. Reading then fetches
only the bytes of the requested rows and columns: a TP rank reading its shard of ``linear_qkv`` reads its
query groups' rows of ``q_proj``, ``k_proj`` and ``v_proj``, and nothing else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.errors import CheckpointError
from ..checkpoint.location.base import Location
from ..checkpoint.location.locate import locate
from ..checkpoint.location.names import MANIFEST_FILENAME
from ..checkpoint.state.fingerprint import FINGERPRINT_VERSION
from ..checkpoint.tools.offline import lazy_fingerprint
from ..model.config import GPTConfig
from .hf_llama import (
    CONFIG_FILE,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    InteropError,
    config_from_hf,
    hf_module_of,
    hf_one_to_one,
    open_safetensors,
    our_linear_of,
    parse_json_object,
)
from .safetensors_io import SafetensorsFile

__all__ = ["HFModelDir", "is_hf_dir", "hf_file"]

# (HF tensor, first HF row, number of rows) pieces that make up a run of our rows, in order.
Segments = list[tuple[str, int, int]]
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_JSON_MAX_BYTES = 64 << 20
"""``config.json`` and the safetensors index are read whole up to this size (an index of a 405B model is ~100 KB)."""


def is_hf_dir(path: str | os.PathLike[str]) -> bool:
    """An HF model directory, on disk or on a store (``config.json`` and no peftckpt manifest)."""
    try:
        loc = locate(path, "HF model directory")
        return loc.is_file(CONFIG_FILE) and not loc.is_file(MANIFEST_FILENAME)
    except (CheckpointError, OSError):  # not a location peftckpt reads: the load says why
        return False


def hf_file(name: str) -> bool:
    """Whether a top-level file of an HF model directory is one it is read from (the JSON and safetensors files:
    what a copy of the directory needs)."""
    return name.endswith((".json", ".safetensors"))


class HFModelDir:
    """A validated HF Llama directory; :meth:`read` returns regions of our (fused, global) tensors. ``shown_as``:
    where messages say it is, when ``path`` is a copy of it (the host's cached copy of a directory on a store)."""

    def __init__(self, path: str | os.PathLike[str] | Location, shown_as: Location | None = None):
        try:
            self.location = locate(path, "HF model directory")
        except CheckpointError as e:
            raise InteropError(str(e)) from None
        self._shown_as = shown_as or self.location
        self.path: Path | str = self._shown_as.ref()
        """The directory, or its URL on a store."""
        if not self._has(CONFIG_FILE):
            raise InteropError(f"{self.path} is not an HF model directory: {CONFIG_FILE} is missing")
        self.hf_config = self._json(CONFIG_FILE)
        self.config: GPTConfig = config_from_hf(self.hf_config)
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        """HF tensor name -> the file holding it."""
        for name, tensors_listed in self._file_names().items():
            if not self._has(name):
                raise InteropError(f"{self._named(SAFETENSORS_INDEX)} lists shard {name} (e.g. for tensor "
                                   f"{tensors_listed[0]!r}), which is missing from {self.path}")
            st = self._open(name)
            self.files[name] = st
            for key in st.tensors:
                if key in self.where:
                    raise InteropError(f"{self.path}: tensor {key!r} is in both {self.where[key].path.name} and {name}")
                self.where[key] = st
            absent = [k for k in tensors_listed if k not in st.tensors]
            if absent:
                raise InteropError(f"{self._named(SAFETENSORS_INDEX)} maps {absent[0]!r} to {name}, which does not "
                                   "hold it")
        self._check_config_fits()  # before anything is sized by the config: it may claim far more than is here
        self._check_tensors()
        self.ours = self.our_shapes()
        """Our model tensors: name -> (global shape, dtype in the HF files)."""

    @property
    def bytes_fetched(self) -> int | None:
        """Bytes this process fetched from a store for the directory's tensors and headers (``None``: on disk)."""
        counts = [f.bytes_fetched for f in self.files.values()]
        return None if any(c is None for c in counts) else sum(c or 0 for c in counts)

    @property
    def shown(self) -> str:
        """The directory as the user named it, made absolute (or its URL)."""
        return self._shown_as.absolute().describe()

    # ------------------------------------------------------------------------------------- files
    def _named(self, rel: str) -> str:
        return self._shown_as.describe(rel)

    def _has(self, rel: str) -> bool:
        try:
            return self.location.is_file(rel)
        except CheckpointError as e:
            raise InteropError(str(e)) from None

    def _json(self, rel: str) -> dict[str, Any]:
        """The JSON object of the file ``rel`` (``config.json``, the index), one error naming it otherwise."""
        try:
            data = self.location.read_small(rel, _JSON_MAX_BYTES)
        except (OSError, ValueError, CheckpointError) as e:
            raise InteropError(f"{self._named(rel)} cannot be read: {e}") from None
        return parse_json_object(data, self._named(rel))

    def _open(self, rel: str) -> SafetensorsFile:
        """The safetensors file ``rel``, its header validated (read by ranges, on disk or on a store)."""
        try:
            return open_safetensors(self.location.byte_source(rel))
        except (OSError, CheckpointError) as e:
            raise InteropError(f"{self._named(rel)} cannot be read as safetensors: {e}") from None

    def _file_names(self) -> dict[str, list[str]]:
        """Shard file -> the tensors the index puts there (one unindexed file: all of them)."""
        index = self._named(SAFETENSORS_INDEX)
        if self._has(SAFETENSORS_INDEX):
            weight_map = self._json(SAFETENSORS_INDEX).get("weight_map")
            if not isinstance(weight_map, dict):
                raise InteropError(f"{index} is not a valid safetensors index: no \"weight_map\" object")
            try:
                files: dict[str, list[str]] = {}
                for key, name in weight_map.items():
                    if not isinstance(name, str) or "/" in name or name in ("", ".", ".."):
                        raise InteropError(f"{index}: tensor {key!r} maps to {name!r}, not a file of {self.path}")
                    files.setdefault(name, []).append(key)
                return files
            except (KeyError, AttributeError, TypeError) as e:
                raise InteropError(f"{index} is not a valid safetensors index: {e!r}") from None
        if self._has(SAFETENSORS_FILE):
            return {SAFETENSORS_FILE: []}
        raise InteropError(f"{self.path}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (only safetensors weights "
                           "are read: pickled .bin files could run code)")

    # ------------------------------------------------------------------------------------- layout
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a Llama of :attr:`config` has in HF naming, with its shape."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.groups * c.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
                                              "model.norm.weight": (c.hidden_size,)}
        if c.untie_embeddings_and_output_weights:
            shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
        for n in range(c.num_layers):
            shapes[f"model.layers.{n}.input_layernorm.weight"] = (c.hidden_size,)
            shapes[f"model.layers.{n}.post_attention_layernorm.weight"] = (c.hidden_size,)
            for proj, shape in (("q_proj", (q, c.hidden_size)), ("k_proj", (kv, c.hidden_size)),
                                ("v_proj", (kv, c.hidden_size)), ("o_proj", (c.hidden_size, q)),
                                ("gate_proj", (c.ffn, c.hidden_size)), ("up_proj", (c.ffn, c.hidden_size)),
                                ("down_proj", (c.hidden_size, c.ffn))):
                shapes[f"{hf_module_of(n, proj)}.weight"] = shape
        return shapes

    def _check_config_fits(self) -> None:
        """The values of ``config.json`` that size the model -- hidden_size, vocab_size, num_hidden_layers,
        intermediate_size, the attention heads -- held to the tensors the safetensors headers describe, before
        anything is enumerated or sized by them: a config claiming a larger model than the files hold is one
        message naming the value, the tensor and its file (a layer count of millions would otherwise be
        enumerated for minutes before the tensors were compared)."""
        c, hf = self.config, self.hf_config

        def shape(name: str) -> tuple[int, ...] | None:
            return self.where[name].tensors[name].shape if name in self.where else None

        def refuse(key: str, value: Any, name: str, what: str) -> None:
            info = self.where[name].tensors[name]
            raise InteropError(f"{self._named(CONFIG_FILE)} says {key} {value} but {name} is {list(info.shape)}"
                               f"{what} in {self.where[name].path.name}")

        embed = "model.embed_tokens.weight"
        dims = shape(embed)
        if dims is None:
            raise InteropError(f"{self.path}: tensor {embed!r} is missing from the safetensors files")
        if len(dims) != 2 or dims[1] != c.hidden_size:
            refuse("hidden_size", hf["hidden_size"], embed, "")
        if dims[0] != c.vocab_size:
            refuse("vocab_size", hf["vocab_size"], embed, "")
        layers = {int(m.group(1)) for name in self.where if (m := _LAYER.match(name))}
        if c.num_layers != len(layers) or (layers and max(layers) != c.num_layers - 1):
            top = max(layers, default=None)
            held = "no layer" if top is None else (f"layers {sorted(layers)[:3]}..." if len(layers) != top + 1
                                                    else f"layers 0-{top}")
            raise InteropError(f"{self._named(CONFIG_FILE)} says num_hidden_layers {hf['num_hidden_layers']} but "
                               f"the safetensors files in {self.path} hold {held} (model.layers.N.*)")
        down, k = f"{hf_module_of(0, 'down_proj')}.weight", f"{hf_module_of(0, 'k_proj')}.weight"
        dims = shape(down)
        if dims is not None and (len(dims) != 2 or dims[1] != c.ffn):
            refuse("intermediate_size", hf["intermediate_size"], down, "")
        dims = shape(k)
        if dims is not None and (len(dims) != 2 or dims[0] != c.groups * c.head_dim):
            refuse("num_key_value_heads", c.groups, k, f" (num_key_value_heads x hidden_size / num_attention_heads "
                   f"= {c.groups} x {c.head_dim} = {c.groups * c.head_dim} rows expected)")

    def _check_tensors(self) -> None:
        expected = self.hf_shapes()
        tied_head = not self.config.untie_embeddings_and_output_weights and "lm_head.weight" in self.where
        problems = [f"tensor {k!r} is missing" for k in expected if k not in self.where]
        for key, shape in expected.items():
            info = self.where[key].tensors[key] if key in self.where else None
            if info is not None and info.shape != shape:
                problems.append(f"tensor {key!r} in {self.where[key].path.name} has shape {list(info.shape)}, "
                                f"{CONFIG_FILE} implies {list(shape)}")
            if info is not None and not info.dtype.is_floating_point:
                problems.append(f"tensor {key!r} in {self.where[key].path.name} is {info.dtype}, not floating point")
        extra = sorted(k for k in self.where if k not in expected and not k.endswith("rotary_emb.inv_freq")
                       and not (k == "lm_head.weight" and tied_head))
        if extra:
            problems.append(f"{len(extra)} tensor(s) do not belong to a Llama of this config: {extra[:5]}")
        if problems:
            raise InteropError(f"{self.path}: " + "; ".join(problems[:10]))

    def our_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Our model tensors (global shape, dtype as stored in the HF files) in our naming."""
        c = self.config
        out = {}
        for ours, theirs in hf_one_to_one(c):
            info = self.where[theirs].tensors[theirs]
            out[ours] = (info.shape, info.dtype)
        for n in range(c.num_layers):
            q = self.where[f"{hf_module_of(n, 'q_proj')}.weight"].tensors[f"{hf_module_of(n, 'q_proj')}.weight"]
            g = self.where[f"{hf_module_of(n, 'gate_proj')}.weight"].tensors[f"{hf_module_of(n, 'gate_proj')}.weight"]
            out[f"{our_linear_of(n, 'linear_qkv')}.weight"] = ((c.qkv_size, c.hidden_size), q.dtype)
            out[f"{our_linear_of(n, 'linear_fc1')}.weight"] = ((2 * c.ffn, c.hidden_size), g.dtype)
        return out

    def _segments(self, ours: str, r0: int, r1: int) -> Segments:
        c = self.config
        for n in range(c.num_layers):
            if ours == f"{our_linear_of(n, 'linear_fc1')}.weight":
                gate, up = (f"{hf_module_of(n, p)}.weight" for p in ("gate_proj", "up_proj"))
                parts = [(gate, 0, c.ffn), (up, 0, c.ffn)]
                return _intersect(parts, r0, r1)
            if ours == f"{our_linear_of(n, 'linear_qkv')}.weight":
                q, k, v = (f"{hf_module_of(n, p)}.weight" for p in ("q_proj", "k_proj", "v_proj"))
                hd, hpg = c.head_dim, c.num_attention_heads // c.groups
                block = (hpg + 2) * hd
                parts = []
                for g in range(r0 // block, (r1 - 1) // block + 1):  # only the groups the rows touch
                    offset = g * block
                    group = [(q, g * hpg * hd, hpg * hd), (k, g * hd, hd), (v, g * hd, hd)]
                    parts += [(name, start, rows) for name, start, rows in
                              _intersect(group, r0 - offset, r1 - offset)]
                return parts
        theirs = dict(hf_one_to_one(c)).get(ours)
        if theirs is None:
            raise KeyError(f"{ours!r} is not a tensor of the HF model {self.path}")
        return [(theirs, r0, r1 - r0)]

    def model_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Our model tensors: ``{name: (global shape, dtype in the HF files)}`` (a tensor source of the tools)."""
        return {name: (torch.Size(shape), dtype) for name, (shape, dtype) in self.ours.items()}

    def model_tensors(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Whole tensors of ours, assembled from the HF files."""
        return {n: self.read(n) for n in (sorted(self.ours) if names is None else names)}

    def fingerprint(self, names: list[str], version: int = FINGERPRINT_VERSION) -> str:
        """The base fingerprint of tensors ``names``, read and summed one at a time."""
        return lazy_fingerprint(self, names, version)

    def read(self, ours: str, offsets: Sequence[int] | None = None, sizes: Sequence[int] | None = None
             ) -> torch.Tensor:
        """Region ``offsets``/``sizes`` (default: all) of our global tensor ``ours``, in the HF files' dtype."""
        shape, _ = self.ours[ours]
        offsets = list(offsets) if offsets is not None else [0] * len(shape)
        sizes = list(sizes) if sizes is not None else list(shape)
        cols = slice(offsets[1], offsets[1] + sizes[1]) if len(shape) > 1 else None
        pieces = [self.where[name].read(name, slice(start, start + rows), cols)
                  for name, start, rows in self._segments(ours, offsets[0], offsets[0] + sizes[0])]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def read_into(self, ours: str, offsets: Sequence[int], out: torch.Tensor) -> None:
        """:meth:`read` of the region at ``offsets`` the size of ``out``, into ``out``: each HF tensor's rows
        straight into ``out``'s rows where the layout allows (see :meth:`SafetensorsFile.read_into`)."""
        shape, _ = self.ours[ours]
        if not shape:
            out.copy_(self.read(ours))
            return
        sizes = list(out.shape)
        cols = slice(offsets[1], offsets[1] + sizes[1]) if len(shape) > 1 else None
        at = 0
        for name, start, rows in self._segments(ours, offsets[0], offsets[0] + sizes[0]):
            self.where[name].read_into(name, out.narrow(0, at, rows), slice(start, start + rows), cols)
            at += rows


def _intersect(parts: Sequence[tuple[str, int, int]], r0: int, r1: int) -> Segments:
    """The pieces of ``parts`` (consecutive row runs) that lie in rows ``[r0, r1)`` of their concatenation."""
    out: Segments = []
    at = 0
    for name, start, rows in parts:
        lo, hi = max(r0, at), min(r1, at + rows)
        if lo < hi:
            out.append((name, start + lo - at, hi - lo))
        at += rows
    return out
