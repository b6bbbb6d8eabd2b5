"""A full-precision base seen as the NF4-held base a QLoRA run trained on, for the offline tools.

A QLoRA checkpoint (``model_config['base_quantization']``) records the fingerprint of the quantized base: the
NF4 codes, scales and factors of every linear weight, and the other frozen tensors as they are. NF4 is defined on
the global tensor (:mod:`peftckpt.model.nf4`), so quantizing the base here, in one process, one weight at a time,
gives exactly the tensors every layout of the run held: :class:`NF4Base` serves them under their names
(``<linear>.weight_nf4``, ``.weight_scales``, ``.weight_factors``) next to the base's own, and an export can check
that it merges the adapter into the base it was trained on.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.checks.load_checks import QUANTIZATION_KEY
from ..checkpoint.tools.offline import TensorSource
from ..model import nf4

__all__ = ["NF4Base", "is_nf4"]

_PARTS = {"weight_nf4": "codes", "weight_scales": "scales", "weight_factors": "factors"}


def is_nf4(model_config: Mapping[str, Any]) -> bool:
    """Whether a checkpoint's ``model_config`` says its base's linear weights were held in NF4."""
    held = model_config.get(QUANTIZATION_KEY)
    return isinstance(held, Mapping) and held.get("method") == "nf4"


class NF4Base:
    """``source`` with the linear weights ``linears`` (names ending in ``.weight``) served as their NF4 parts,
    each quantized when one of its parts is first read (the last one kept, so its three parts cost one read)."""

    def __init__(self, source: TensorSource, linears: list[str], dtype: torch.dtype | None = None):
        self.source = source
        self.dtype = dtype
        """Each weight is cast to this dtype before it is quantized (``None``: as the source holds it)."""
        self.path: Path | str = source.path
        self.linears = set(linears)
        self._last: tuple[str, nf4.NF4Weight] | None = None
        self.error = [0.0, 0.0]
        """``|W - NF4(W)|^2`` and ``|W|^2`` summed over the weights quantized so far."""

    @staticmethod
    def is_part(name: str) -> bool:
        """Whether ``name`` is one of the NF4 parts of a quantized weight."""
        return name.rsplit(".", 1)[-1] in _PARTS

    def model_shapes(self) -> dict[str, tuple[torch.Size, torch.dtype]]:
        shapes = dict(self.source.model_shapes())
        for name in self.linears & set(shapes):
            shape, _ = shapes.pop(name)
            prefix = name.removesuffix("weight")
            for part, held in nf4.stored_shapes(tuple(shape)).items():
                shapes[prefix + part] = (torch.Size(held), torch.float32 if part == "weight_factors" else torch.uint8)
        return shapes

    def model_tensors(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        names = list(self.model_shapes()) if names is None else names
        out: dict[str, torch.Tensor] = {}
        plain = [n for n in names if not self.is_part(n)]
        if plain:
            out.update(self.source.model_tensors(plain))
        for name in names:
            prefix, part = name.rsplit(".", 1)
            if part in _PARTS:
                out[name] = getattr(self._quantized(f"{prefix}.weight"), _PARTS[part])
        return out

    def _quantized(self, weight: str) -> nf4.NF4Weight:
        if self._last is None or self._last[0] != weight:
            w = self.source.model_tensors([weight])[weight]
            if self.dtype is not None:
                w = w.to(self.dtype)
            q = nf4.quantize(w, w.shape[1])
            self._last = (weight, q)
            w = w.float()
            self.error[0] += float((w - nf4.dequantize(q, torch.float32)).square().sum())
            self.error[1] += float(w.square().sum())
        return self._last[1]

    def relative_error(self) -> float:
        """The relative norm of ``W - NF4(W)`` over every weight quantized so far."""
        return (self.error[0] / max(self.error[1], 1e-30)) ** 0.5
