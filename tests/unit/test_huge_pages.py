"""Loads ask for transparent huge pages for the memory they fill (peftckpt.checkpoint.storage.huge_pages).

The advice is checked where the kernel records it: the ``hg`` flag (``VM_HUGEPAGE``) of the mapping holding a
tensor's memory, in ``/proc/self/smaps``. On a kernel without transparent huge pages the advice is refused and
``prefer_huge_pages`` answers 0; these tests then check that (and that nothing else changed).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from peftckpt import Checkpointer
from peftckpt.checkpoint.storage import huge_pages
from peftckpt.checkpoint.storage.huge_pages import HUGE_PAGE, prefer_huge_pages

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled").is_file()


def _flags_at(address: int) -> set[str]:
    """The VmFlags of the mapping of this process holding ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


_MAPPED = 40 << 20
"""Bytes of a tensor malloc always maps on its own (above glibc's largest mmap threshold, 32 MiB): a new mapping,
never heap memory an earlier test in this process advised."""


def _middle(t: torch.Tensor) -> int:
    return t.data_ptr() + t.nbytes // 2


def test_the_aligned_runs_of_each_storage_are_advised_once() -> None:
    big = torch.empty(_MAPPED, dtype=torch.uint8)
    assert "hg" not in _flags_at(_middle(big))
    views = [big[: 1 << 20], big[8 << 20:], big.view(torch.int32)]  # three views, one storage
    advised = prefer_huge_pages(views)
    if not _THP:
        assert advised == 0
        return
    start, end = big.data_ptr(), big.data_ptr() + big.nbytes
    first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    assert advised == last - first  # the whole storage's aligned runs, counted once for the three views
    assert "hg" in _flags_at(_middle(big))
    # under two huge pages (no aligned run worth a mapping of its own), empty, or not in this process's memory
    assert prefer_huge_pages([torch.empty(HUGE_PAGE, dtype=torch.uint8), torch.empty(0),
                              torch.empty(3, device="meta")]) == 0


def test_advice_on_memory_already_written_keeps_its_values() -> None:
    t = torch.arange(3 << 20, dtype=torch.int32)
    prefer_huge_pages([t])
    assert torch.equal(t, torch.arange(3 << 20, dtype=torch.int32))


def test_a_kernel_refusing_the_advice_is_asked_no_more(monkeypatch) -> None:
    calls = []

    def refuse(address: int, length: int, advice: int) -> int:
        calls.append(advice)
        return -1  # EINVAL: a kernel built without transparent huge pages

    monkeypatch.setattr(huge_pages, "_madvise", refuse)
    t = torch.empty(8 << 20, dtype=torch.uint8)
    assert prefer_huge_pages([t]) == 0
    assert huge_pages._madvise is False
    assert prefer_huge_pages([t]) == 0 and calls == [14]


class _Base(nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(_MAPPED // 4 // 1024, 1024, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(1024, device=device))


def test_a_base_load_advises_the_memory_it_fills(tmp_path: Path) -> None:
    """load_pretrained of a full checkpoint (the ranged DCP reader) and load_base_tensors (a source read by key,
    as an HF directory is) both advise the model's memory before reading into it; the values are the base's."""
    saved = _Base()
    Checkpointer(saved).save(tmp_path, 1)
    tensors = {f"model.{k}": v for k, v in saved.state_dict().items()}
    for how in ("load_pretrained", "load_base_tensors"):
        fresh = _Base("meta").to_empty(device="cpu")
        assert "hg" not in _flags_at(_middle(fresh.weight))
        ckpt = Checkpointer(fresh)
        if how == "load_pretrained":
            ckpt.load_pretrained(tmp_path)
        else:
            ckpt.load_base_tensors("a test source", {k: v.shape for k, v in tensors.items()},
                                   lambda k, offsets, sizes: tensors[k])
        assert torch.equal(fresh.weight, saved.weight), how
        assert ("hg" in _flags_at(_middle(fresh.weight))) == _THP, how
