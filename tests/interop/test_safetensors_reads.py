"""Reading regions of safetensors tensors straight into a destination (the HF base load's path): every kind of
region equals the reference ``safetensors`` reader's, through the direct and the buffered path, and a file cut
short is one error naming it, not a partly filled tensor passed off as read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peftckpt.interop import safetensors_io
from peftckpt.interop.safetensors_io import SafetensorsError, SafetensorsFile


@pytest.fixture
def stored(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(37, 24, generator=g).bfloat16(), "v": torch.randn(11, generator=g),
               "m": torch.randn(5, 3, 4, generator=g).half()}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, load_file(str(path))


def test_regions_equal_the_reference_reader(stored: tuple[Path, dict[str, torch.Tensor]],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path, ref = stored
    monkeypatch.setattr(safetensors_io, "_BOUNCE_BYTES", 3 * 24 * 2)  # buffered reads in runs of 3 rows
    f = SafetensorsFile(path)
    cases = [("w", None, None), ("w", slice(4, 30), None), ("w", slice(0, 37), slice(0, 24)),
             ("w", slice(2, 33), slice(12, 24)), ("w", None, slice(5, 7)), ("v", slice(3, 9), None),
             ("m", slice(1, 4), None), ("m", slice(1, 4), slice(1, 3))]
    for name, rows, cols in cases:
        expected = ref[name][rows or slice(None)]
        if cols is not None:
            expected = expected[:, cols]
        for dtype in (expected.dtype, torch.float32):  # the file's dtype (direct where whole rows), and another
            out = torch.full(expected.shape, float("nan"), dtype=dtype)
            f.read_into(name, out, rows, cols)
            assert torch.equal(out, expected.to(dtype)), (name, rows, cols, dtype)
        # a non-contiguous destination (a column block of a larger tensor) goes through the buffer
        wide = torch.zeros(expected.shape[0], *expected.shape[1:-1], expected.shape[-1] + 2, dtype=expected.dtype) \
            if expected.ndim > 1 else None
        if wide is not None:
            f.read_into(name, wide[..., 1:-1], rows, cols)
            assert torch.equal(wide[..., 1:-1], expected) and not wide[..., 0].any() and not wide[..., -1].any()


def test_a_file_cut_short_after_opening_is_an_error(stored: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, ref = stored
    f = SafetensorsFile(path)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 10)
    last = max(f.tensors, key=lambda n: f.tensors[n].begin)
    with pytest.raises(SafetensorsError, match=f"{path.name} is truncated.*{last}"):
        f.read_into(last, torch.empty(ref[last].shape, dtype=ref[last].dtype))
