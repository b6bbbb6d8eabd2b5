"""Vectored file I/O straight from and into memory: ``preadv`` until the buffers are full, ``writev`` until
every buffer is written.

The ranged DCP reader and the HF safetensors reader both put file bytes directly into their destination
(a model tensor's memory where its dtype and layout allow, else a reused buffer): no intermediate copy, no
memory map whose page faults stand in for reads, and the GIL released while the kernel copies. The framed DCP
writer writes many items' framing and tensor memory with one ``writev``, not through a stream's buffer (a copy of
every byte).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["read_exactly", "write_all"]

_IOV_MAX = 1024
"""Buffers per ``writev`` call (POSIX guarantees at least 16; Linux takes 1024)."""


def read_exactly(fd: int, views: Sequence[memoryview], offset: int) -> int:
    """``preadv`` into ``views`` until they are full; the bytes read (fewer only at the end of the file)."""
    views = [v for v in views if len(v)]
    total = 0
    while views:
        n = os.preadv(fd, views, offset + total)
        if n <= 0:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total


def write_all(fd: int, views: Sequence[memoryview]) -> int:
    """``writev`` ``views`` in order, resuming after short writes, at most :data:`_IOV_MAX` at a time; the bytes
    written (all of them, or an ``OSError``)."""
    views = [v for v in views if len(v)]
    total, at = 0, 0
    while at < len(views):
        n = os.writev(fd, views[at:at + _IOV_MAX])
        if n <= 0:
            raise OSError(f"writev on fd {fd} wrote nothing")
        total += n
        while at < len(views) and n >= len(views[at]):
            n -= len(views[at])
            at += 1
        if n:
            views[at] = views[at][n:]
    return total
