"""The base-model fingerprint: bit-exact, layout independent, and (versions 2-4) independent of the dtype
a base is held in wherever its values are the same (single process). Versions 1-3 are still computed
to check the checkpoints that recorded them, so their values must never change."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from peftckpt.checkpoint.state import fingerprint as fingerprint_module
from peftckpt.checkpoint.state import fingerprint_sums
from peftckpt.checkpoint.state.fingerprint import Fingerprinting, base_fingerprint
from peftckpt.sharding.entries import GlobalTensor, Piece, global_tensor_of

VERSION = 4


def _fp(entries: dict[str, GlobalTensor]) -> str:
    return base_fingerprint(entries, distributed=False, version=VERSION)


@pytest.fixture(params=[2, 3, 4], autouse=True)
def version(request: pytest.FixtureRequest) -> int:
    """Every test runs with the current version and with versions 2 and 3 (which old checkpoints recorded)."""
    global VERSION
    VERSION = request.param
    return request.param


def _whole(t: torch.Tensor) -> GlobalTensor:
    return GlobalTensor(t.shape, t.dtype, [Piece((0,) * t.ndim, t)], replicated=True)


def _rows(t: torch.Tensor, bounds: list[int]) -> GlobalTensor:
    """``t`` as row pieces ``[bounds[i], bounds[i+1])``."""
    pieces = [Piece((a,) + (0,) * (t.ndim - 1), t[a:b]) for a, b in zip(bounds, bounds[1:])]
    return GlobalTensor(t.shape, t.dtype, pieces)


def _fused_tp(t: torch.Tensor, tp: int, num_chunks: int = 2) -> GlobalTensor:
    """The pieces every TP rank holds of a fused ``[gate; up]`` tensor (canonical layout), in rank order:
    rank r holds row block r of every chunk, i.e. the canonical offset ``c * G/k + r * G/(k*tp)``."""
    rows = t.shape[0] // num_chunks
    per_rank = rows // tp
    pieces = [Piece((c * rows + r * per_rank, 0), t[c * rows + r * per_rank: c * rows + (r + 1) * per_rank])
              for r in range(tp) for c in range(num_chunks)]
    return GlobalTensor(t.shape, t.dtype, pieces)


@pytest.fixture
def weight() -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(3))


def test_format_and_stability(weight: torch.Tensor, version: int) -> None:
    fp = _fp({"model.w": _whole(weight)})
    assert re.fullmatch(rf"v{version}:sha256:[0-9a-f]{{64}}", fp)
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", base_fingerprint({"model.w": _whole(weight)}, False, version=1))
    assert _fp({"model.w": _whole(weight)}) == fp
    assert _fp({"model.w": _whole(weight.clone())}) == fp  # depends on values, not on storage
    assert _fp({}) == _fp({})
    assert _fp({}) != fp


def test_split_rows_equal_one_replicated_piece(weight: torch.Tensor) -> None:
    whole = _fp({"model.w": _whole(weight)})
    assert _fp({"model.w": _rows(weight, [0, 3, 6])}) == whole
    assert _fp({"model.w": _rows(weight, [0, 1, 4, 6])}) == whole  # uneven split
    cols = GlobalTensor(weight.shape, weight.dtype, [Piece((0, 2), weight[:, 2:]), Piece((0, 0), weight[:, :2])])
    assert not cols.pieces[0].tensor.is_contiguous()
    assert _fp({"model.w": cols}) == whole  # column pieces, non-contiguous views, any order
    assert _fp({"model.w": GlobalTensor(weight.shape, weight.dtype, [Piece((0, 0), weight)])}) == whole


@pytest.mark.parametrize("tp", [1, 3])
def test_fused_two_chunk_layout_equals_the_whole_tensor(weight: torch.Tensor, tp: int) -> None:
    fused = _fused_tp(weight, tp)
    assert len(fused.pieces) == 2 * tp
    assert [p.offsets[0] for p in fused.pieces] == ([0, 3] if tp == 1 else [0, 3, 1, 4, 2, 5])
    assert _fp({"model.mlp.linear_fc1.weight": fused}) == _fp({"model.mlp.linear_fc1.weight": _whole(weight)})
    shuffled = list(fused.pieces)
    random.Random(0).shuffle(shuffled)
    assert _fp({"model.mlp.linear_fc1.weight": GlobalTensor(weight.shape, weight.dtype, shuffled)}) == \
        _fp({"model.mlp.linear_fc1.weight": fused})


def test_one_ulp_changes_it(weight: torch.Tensor) -> None:
    base = _fp({"model.w": _rows(weight, [0, 3, 6])})
    for index in [(0, 0), (2, 3), (5, 1)]:
        nudged = weight.clone()
        nudged[index] = torch.nextafter(nudged[index], torch.tensor(float("inf")))
        assert nudged[index] != weight[index] and torch.allclose(nudged, weight, rtol=1e-6, atol=0)
        assert _fp({"model.w": _rows(nudged, [0, 3, 6])}) != base, index
        assert _fp({"model.w": _whole(nudged)}) != base, index


def test_it_sees_bits_positions_shapes_and_dtypes(weight: torch.Tensor) -> None:
    base = _fp({"model.w": _whole(weight)})
    swapped = weight.clone()
    swapped[0, 0], swapped[5, 3] = weight[5, 3].item(), weight[0, 0].item()
    assert _fp({"model.w": _whole(swapped)}) != base  # same multiset of values, other positions
    assert _fp({"model.w": _whole(weight.reshape(4, 6))}) != base  # same flat bits, other shape
    assert _fp({"model.w": _whole(weight.view(torch.int32))}) != base  # same bits, other dtype
    zeros = torch.zeros(4)
    assert _fp({"b": _whole(zeros)}) != _fp({"b": _whole(-zeros)})  # -0.0 == 0.0 but not bit-identical


def test_a_renamed_key_changes_it(weight: torch.Tensor) -> None:
    base = _fp({"model.decoder.layers.0.mlp.linear_fc1.weight": _whole(weight)})
    assert _fp({"model.decoder.layers.1.mlp.linear_fc1.weight": _whole(weight)}) != base
    two = {"model.a": _whole(weight), "model.b": _whole(weight + 1)}
    swapped_names = {"model.a": _whole(weight + 1), "model.b": _whole(weight)}
    assert _fp(two) != _fp(swapped_names)
    assert _fp(dict(reversed(list(two.items())))) == _fp(two)  # insertion order does not matter


def test_flags_that_are_not_values_do_not_matter(weight: torch.Tensor) -> None:
    base = _fp({"model.w": _whole(weight)})
    assert _fp({"model.w": global_tensor_of(weight)}) == base
    assert _fp({"model.w": global_tensor_of(torch.nn.Parameter(weight.clone()))}) == base  # requires_grad


def test_bf16(version: int) -> None:
    t = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    base = _fp({"w": _whole(t)})
    assert _fp({"w": _rows(t, [0, 3, 6])}) == base
    assert _fp({"w": _fused_tp(t, tp=3)}) == base
    assert _fp({"w": _whole(t.float())}) == base  # same values, other dtype: the same base (versions 2, 3)
    assert base_fingerprint({"w": _whole(t.float())}, False, 1) != base_fingerprint({"w": _whole(t)}, False, 1)
    nudged = t.clone()
    nudged[4, 2] = torch.nextafter(nudged[4, 2], torch.tensor(float("inf"), dtype=torch.bfloat16))
    assert _fp({"w": _rows(nudged, [0, 3, 6])}) != base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_one_dimensional(dtype: torch.dtype) -> None:
    t = torch.linspace(-3, 3, 10, dtype=dtype)
    base = _fp({"model.norm.weight": _whole(t)})
    assert _fp({"model.norm.weight": _rows(t, [0, 4, 10])}) == base
    assert _fp({"model.norm.weight": _rows(t, [0, 1, 2, 7, 10])}) == base
    nudged = t.clone()
    nudged[9] = torch.nextafter(nudged[9], torch.tensor(-float("inf"), dtype=dtype))
    assert _fp({"model.norm.weight": _rows(nudged, [0, 4, 10])}) != base
    assert _fp({"model.norm.weight": _whole(t.flip(0))}) != base


def test_zero_dim_and_empty_pieces() -> None:
    scalar = torch.tensor(2.5)
    assert _fp({"s": _whole(scalar)}) == _fp({"s": _whole(scalar.clone())})
    assert _fp({"s": _whole(scalar)}) != _fp({"s": _whole(torch.tensor(2.0))})
    t = torch.arange(8.0)
    assert _fp({"v": _rows(t, [0, 4, 4, 8])}) == _fp({"v": _whole(t)})  # an empty piece adds nothing
    assert _fp({"v": _rows(t, [0, 8, 8])}) == _fp({"v": _whole(t)})


def test_v2_is_the_same_for_a_bf16_base_held_in_fp32_and_v1_is_not(weight: torch.Tensor) -> None:
    """Issue 12: --bf16 holds the base in bf16; an fp32 model loading the same bf16 files, and the offline
    tools reading them, must compute the same fingerprint, so an adapter moves between them."""
    bf16 = weight.to(torch.bfloat16)
    upcast = bf16.float()  # exact
    assert _fp({"model.w": _rows(bf16, [0, 2, 6])}) == _fp({"model.w": _whole(upcast)})
    assert _fp({"model.w": _whole(bf16.half().float().to(torch.bfloat16))}) != _fp({"model.w": _whole(weight)})
    v1 = {dtype: base_fingerprint({"model.w": _whole(t)}, False, version=1) for dtype, t in
          (("bf16", bf16), ("fp32", upcast))}
    assert v1["bf16"] != v1["fp32"]  # the old formula hashed raw bits and the dtype
    assert _fp({"model.w": _whole(upcast)}) != _fp({"model.w": _whole(weight)})  # rounding is a different base
    integers = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    assert _fp({"model.i": _whole(integers)}) != _fp({"model.i": _whole(integers.int())})  # not floats: dtype kept


def _old_entries() -> dict[str, GlobalTensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 5, generator=g)
    return {"model.w": GlobalTensor(w.shape, w.dtype, [Piece((0, 0), w[:2]), Piece((2, 0), w[2:])]),
            "model.b": GlobalTensor((7,), torch.bfloat16, [Piece((0,), torch.randn(7, generator=g).bfloat16())]),
            "model.i": GlobalTensor((3,), torch.int64, [Piece((0,), torch.tensor([1, -2, 3]))])}


def test_old_versions_keep_their_values() -> None:
    """The values the version 1 and 2 code computed before version 3 existed (release of 2026-12-03), and
    version 3's before version 4 (2026-12-05): a checkpoint that recorded one must still verify."""
    assert base_fingerprint(_old_entries(), False, 1) == \
        "sha256:968618d606d190c3954f7deeb10e43b3a5426742787ad1d18a43835848fee0a9"
    assert base_fingerprint(_old_entries(), False, 2) == \
        "v2:sha256:70a6e9ac089ef89b70cc1cd3c8ad4f30c427b814df4290299b29e98a56e28701"
    assert base_fingerprint(_old_entries(), False, 3) == \
        "v3:sha256:ff7a4ed65ad660a3d679c405dffbb9f2bcd2ed797b8e07c2579546eee7ecd987"


def _check_odd_splits(dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """Row, column, grid and flat splits of an odd-shaped tensor all equal the whole; the tensor and its value."""
    t = (torch.randn(40, 37, generator=torch.Generator().manual_seed(5)) * 100).to(dtype)
    whole = _fp({"w": _whole(t)})
    assert _fp({"w": _rows(t, [0, 1, 13, 40])}) == whole
    cols = GlobalTensor(t.shape, t.dtype, [Piece((0, 0), t[:, :10]), Piece((0, 10), t[:, 10:])])
    assert _fp({"w": cols}) == whole
    grid = [Piece((a, b), t[a:a + 20, b:b + 19]) for a in (0, 20) for b in (0, 19)]
    assert _fp({"w": GlobalTensor(t.shape, t.dtype, grid)}) == whole
    flat = t.reshape(-1)
    assert _fp({"f": _rows(flat, [0, 100, 1000, flat.numel()])}) == _fp({"f": _whole(flat)})
    return t, whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_v3_long_and_unaligned_runs(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs longer than one summed row, rows whose phase in the periodic weights differs (a row length that
    the period does not divide), and tiles of many rows: every split equals the whole tensor."""
    monkeypatch.setattr(fingerprint_module, "_RUN", 64)  # long runs at a small size
    monkeypatch.setattr(fingerprint_sums, "_TILE_V3", 256)
    monkeypatch.setattr(fingerprint_sums, "_PERIOD", 7)
    monkeypatch.setattr(fingerprint_sums, "_R", fingerprint_sums._R[:7])
    t, whole = _check_odd_splits(dtype)
    changed = t.clone()
    changed[39, 36] += 1
    assert _fp({"w": _whole(changed)}) != whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_v4_chunk_edges_and_long_runs(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Version 4 sums whole 64-element chunks as one matrix product and partial chunks at a piece's edges
    apart: pieces starting and ending anywhere in a chunk, rows of different phases (a row length 64 does
    not divide), TP-like column shards of an aligned row (11008 / 8 = 1376 is not a multiple of 64), one long
    run cut into segments -- every split equals the whole tensor, and one changed element changes it."""
    monkeypatch.setattr(fingerprint_module, "_SEGMENT", 1 << 10)  # long runs at a small size
    t, whole = _check_odd_splits(dtype)
    wide = (torch.randn(3, 11008, generator=torch.Generator().manual_seed(6)) * 100).to(dtype)
    shards = [Piece((0, r * 1376), wide[:, r * 1376:(r + 1) * 1376]) for r in range(8)]
    assert _fp({"w": GlobalTensor(wide.shape, wide.dtype, shards)}) == _fp({"w": _whole(wide)})
    for index in [(39, 36), (0, 0), (17, 5)]:
        changed = t.clone()
        changed[index] += 1
        assert _fp({"w": _whole(changed)}) != whole, index


@pytest.mark.parametrize("kernel", sorted(fingerprint_sums._KERNELS))
def test_v4_kernels_give_the_same_sums(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    """Each chunk kernel (``torch._int_mm``, the int32-widened tiles) gives the same exact sums as a plain int64
    product, on whole and partial chunks, tiles cut across rows and within one long row, and extreme bytes."""
    monkeypatch.setattr(fingerprint_sums, "_KERNEL", [kernel])
    monkeypatch.setattr(fingerprint_sums, "_TILE_BYTES", 640)  # several tiles per call, and rows cut in tiles
    g = torch.Generator().manual_seed(8)
    extreme = torch.tensor([-128, 127], dtype=torch.int8)[torch.randint(0, 2, (3, 7, 128), generator=g)]
    for chunks in (torch.randint(-128, 128, (4, 3, 128), dtype=torch.int8, generator=g), extreme,
                   torch.randint(-128, 128, (2, 13, 256), dtype=torch.int8, generator=g)[:, 1:12],
                   torch.randint(-128, 128, (3, 1, 40), dtype=torch.int8, generator=g)):
        weights = torch.tensor(fingerprint_sums._W_FLOAT[:chunks.shape[2]], dtype=torch.int8)
        expected = (chunks.to(torch.int64) * weights.to(torch.int64)).sum(2).numpy()
        assert (fingerprint_sums._chunk_sums(chunks, weights) == expected).all()
    t = torch.randn(130, 200, generator=g).to(torch.bfloat16)
    entries = {"w": _rows(t, [0, 7, 130]), "b": _whole(torch.randn(77, generator=g)),
               "n": _whole(torch.arange(-40, 60, dtype=torch.int64))}
    ours = base_fingerprint(entries, False, 4)
    monkeypatch.setattr(fingerprint_sums, "_KERNELS", {"plain": lambda c, w: (c.long() * w.long()).sum(2)})
    monkeypatch.setattr(fingerprint_sums, "_KERNEL", ["plain"])
    assert base_fingerprint(entries, False, 4) == ours


def test_v4_kernel_chosen_by_the_cpu_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch._int_mm`` where the CPU has int8 dot-product instructions, the widened sums elsewhere, chosen
    once; an ``_int_mm`` that refuses a shape hands over to the widened sums for good, with the same result."""
    for flags, expected in (({"avx2", "avx512_vnni"}, "int_mm"), ({"avx2", "fma"}, "widened"), (set(), "widened")):
        monkeypatch.setattr(fingerprint_sums, "cpu_flags", lambda flags=flags: flags)
        monkeypatch.setattr(fingerprint_sums, "_KERNEL", [None])
        assert fingerprint_sums.chunk_kernel() == expected
        monkeypatch.setattr(fingerprint_sums, "cpu_flags", set)
        assert fingerprint_sums.chunk_kernel() == expected  # chosen once
    monkeypatch.undo()
    listed = re.search(r"^(?:flags|Features)\s*:\s*(\S+)", Path("/proc/cpuinfo").read_text(), re.M)
    assert listed is not None and listed.group(1) in fingerprint_sums.cpu_flags()  # this machine's, read

    def refuse(chunks: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no int8 product for this shape")
    monkeypatch.setattr(fingerprint_sums, "_KERNELS", {**fingerprint_sums._KERNELS, "int_mm": refuse})
    monkeypatch.setattr(fingerprint_sums, "_KERNEL", ["int_mm"])
    chunks = torch.randint(-128, 128, (2, 3, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    weights = torch.tensor(fingerprint_sums._W_FLOAT[:128], dtype=torch.int8)
    expected_sums = (chunks.to(torch.int64) * weights.to(torch.int64)).sum(2).numpy()
    assert (fingerprint_sums._chunk_sums(chunks, weights) == expected_sums).all()
    assert fingerprint_sums._KERNEL == ["widened"]


def test_v4_swapped_bytes_within_a_chunk() -> None:
    """The 128 weights of a bf16 chunk are all different: two elements of a chunk swapped, or a bf16's
    two bytes swapped, change the fingerprint."""
    t = torch.randn(64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    base = base_fingerprint({"w": _whole(t)}, False, 4)
    for i, j in [(0, 1), (3, 60), (31, 32)]:
        swapped = t.clone()
        swapped[i], swapped[j] = t[j], t[i]
        assert base_fingerprint({"w": _whole(swapped)}, False, 4) != base, (i, j)
    byteswapped = t.view(torch.int16).clone()
    byteswapped[5] = int.from_bytes(int(byteswapped[5]).to_bytes(2, "little", signed=True), "big", signed=True)
    assert base_fingerprint({"w": _whole(byteswapped.view(torch.bfloat16))}, False, 4) != base


@pytest.mark.parametrize("version", [3, 4])
def test_fp16_and_bf16_values_held_in_fp32(version: int) -> None:
    for narrow in (torch.float16, torch.bfloat16):
        t = torch.randn(9, 33, generator=torch.Generator().manual_seed(2)).to(narrow)
        assert base_fingerprint({"w": _whole(t)}, False, version) == \
            base_fingerprint({"w": _whole(t.float())}, False, version)


def test_pieces_added_as_they_are_read_equal_the_whole(weight: torch.Tensor) -> None:
    """:class:`Fingerprinting` takes pieces one at a time (as a base load reads them); a piece not added
    is an error, not a silently different fingerprint."""
    entries = {"model.w": _rows(weight, [0, 2, 6]), "model.v": _whole(weight[0])}
    job = Fingerprinting(entries, distributed=False, version=VERSION)
    for k, e in entries.items():
        for p in reversed(e.pieces):
            job.add(k, p.offsets, p.tensor)
    assert job.result() == _fp(entries)
    partial = Fingerprinting(entries, distributed=False, version=VERSION)
    partial.add("model.v", (0,), weight[0])
    with pytest.raises(RuntimeError, match="model.w .* never added"):
        partial.result()
