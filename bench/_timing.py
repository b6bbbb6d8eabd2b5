"""Timing, statistics and raw-disk helpers of the checkpoint benchmark (no peftckpt imports).

Every timed call runs between two barriers when ``torch.distributed`` is up, and its time is the slowest
rank's: that is how long the job as a whole waits for it.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from peftckpt.checkpoint.state.fingerprint_sums import INT8_DOT_FLAGS, cpu_flags
from peftckpt.checkpoint.storage.durable import fsync_dir, fsync_file
from peftckpt.checkpoint.storage.preads import read_exactly

__all__ = ["Stat", "Ctx", "raw_write", "raw_read", "balanced_read", "evict", "dir_bytes", "fsync_paths", "rmtree", "machine_info",
           "int8_dot_flags"]

RAW_BLOCK_BYTES = 16 << 20
"""Block size of the raw sequential write/read (one reused buffer)."""


@dataclass
class Stat:
    """Samples (seconds) of one measurement; reported as median [min, max]."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    @property
    def min(self) -> float:
        return min(self.samples) if self.samples else float("nan")

    @property
    def max(self) -> float:
        return max(self.samples) if self.samples else float("nan")

    def to_dict(self) -> dict[str, Any]:
        return {"median_s": self.median, "min_s": self.min, "max_s": self.max, "samples_s": self.samples}


class Ctx:
    """This process's place in the run: rank, world, and collective helpers that do nothing alone."""

    def __init__(self) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def slowest(self, seconds: float) -> float:
        if not self.distributed:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def timed(self, fn: Callable[[int], Any], i: int) -> float:
        """``fn(i)`` between barriers: the slowest rank's seconds."""
        self.barrier()
        t0 = time.perf_counter()
        fn(i)
        elapsed = time.perf_counter() - t0
        self.barrier()
        return self.slowest(elapsed)

    def time(self, fn: Callable[[int], Any], repeats: int, before: Callable[[int], Any] | None = None,
             after: Callable[[int], Any] | None = None) -> Stat:
        """Run ``fn(i)`` for ``i < repeats``; ``before(i)`` / ``after(i)`` (untimed) prepare and clean up."""
        stat = Stat()
        for i in range(repeats):
            if before is not None:
                before(i)
            stat.samples.append(self.timed(fn, i))
            if after is not None:
                after(i)
        return stat

    def rounds(self, repeats: int, steps: dict[str, tuple[Callable[[int], Any], Callable[[int], Any] | None]]
               ) -> dict[str, Stat]:
        """Interleaved repeats: round ``i`` runs every step ``fn(i)`` once, in order, after its untimed
        ``before(i)``; so the things compared share the machine's state (page cache, other load) of that
        round instead of each meeting its own."""
        stats = {name: Stat() for name in steps}
        for i in range(repeats):
            for name, (fn, before) in steps.items():
                if before is not None:
                    before(i)
                stats[name].samples.append(self.timed(fn, i))
        return stats


# ------------------------------------------------------------------------------------------ disk
def fsync_paths(paths: list[Path]) -> None:
    """fsync files and then their directories (what a durable save must do)."""
    for p in paths:
        fsync_file(p)
    for d in sorted({p.parent for p in paths}):
        fsync_dir(d)


def evict(path: Path, mode: str) -> None:
    """Make the next read of ``path`` (a file or a tree) come from the disk, per ``mode``:
    ``evict`` -- ``posix_fadvise(DONTNEED)`` on each (already fsynced) file; ``drop`` -- the whole page
    cache (``/proc/sys/vm/drop_caches``, root only); ``warm`` -- nothing (reads may hit the page cache)."""
    if mode == "warm":
        return
    if mode == "drop":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(path: Path, num_bytes: int, block: memoryview) -> None:
    """Sequential write of ``num_bytes`` from one reused buffer, then fsync of the file and directory."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = num_bytes
        while left > 0:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def raw_read(path: Path, block: bytearray) -> int:
    """Sequential read of the whole file into one reused buffer; returns the bytes read."""
    total = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(block):
            total += n
    return total


def balanced_read(files: list[Path], readers: int = 2, fresh: bool = False) -> float:
    """Seconds ``readers`` threads take to read ``files`` with equal shares of their bytes (reader ``i`` takes the
    ``i``-th slice of the files laid end to end), as a load's ranks split a base; the page cache is evicted first.
    Into one reused buffer each, or (``fresh``) into new memory the size of the share, advised huge pages as a
    load's destinations are: the floor of any load that fills freshly allocated tensors."""
    from peftckpt.checkpoint.storage.huge_pages import prefer_huge_pages

    for f in files:
        evict(f, "evict")
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)

    def read(i: int) -> None:
        lo, hi = i * total // readers, (i + 1) * total // readers
        block = torch.empty(hi - lo if fresh else RAW_BLOCK_BYTES, dtype=torch.uint8)
        prefer_huge_pages([block])
        view = memoryview(block.numpy()) if block.numel() else memoryview(b"")
        at, got = 0, 0
        for f, size in zip(files, sizes):
            a, b = max(lo, at), min(hi, at + size)
            if a < b:
                fd = os.open(f, os.O_RDONLY)
                try:
                    while a < b:
                        n = min(b - a, RAW_BLOCK_BYTES)
                        if read_exactly(fd, [view[got:got + n] if fresh else view[:n]], a - at) != n:
                            raise EOFError(f"{f}: fewer than {n} bytes at {a - at}")
                        a, got = a + n, got + n
                finally:
                    os.close(fd)
            at += size

    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            read(i)
        except BaseException as e:  # noqa: BLE001 - raised below, on the caller's thread
            errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def rmtree(path: Path) -> None:
    """Remove a directory tree or a file, if there."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------- machine
def _meminfo_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def int8_dot_flags() -> list[str]:
    """The CPU's vector and int8 dot-product instructions: what the fingerprint's chunk sums run on."""
    return sorted(cpu_flags() & (INT8_DOT_FLAGS | {"avx2", "avx512bw"}))


def machine_info(workdir: Path) -> dict[str, Any]:
    """CPU count, model and int8 instructions, RAM, and the device / filesystem / rotational flag behind
    ``workdir``."""
    info: dict[str, Any] = {"nproc": os.cpu_count(), "ram_gib": round(_meminfo_gib(), 1),
                            "torch": torch.__version__, "loadavg_start": os.getloadavg(),
                            "cpu_int8_dot": int8_dot_flags()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        out = subprocess.run(["df", "-PT", str(workdir)], capture_output=True, text=True, check=True).stdout
        device, fstype = out.splitlines()[1].split()[:2]
        info["disk"] = {"device": device, "filesystem": fstype}
        rot = Path(f"/sys/block/{Path(device).name.rstrip('0123456789')}/queue/rotational")
        if rot.exists():
            info["disk"]["rotational"] = rot.read_text().strip() == "1"
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
        pass
    return info
