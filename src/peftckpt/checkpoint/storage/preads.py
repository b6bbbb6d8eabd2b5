"""Positional reads straight into memory: ``preadv`` until the buffers are full.

The ranged DCP reader and the HF safetensors reader both put file bytes directly into their destination
(a model tensor's memory where its dtype and layout allow, else a reused buffer): no intermediate copy, no
memory map whose page faults stand in for reads, and the GIL released while the kernel copies.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["read_exactly"]


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
