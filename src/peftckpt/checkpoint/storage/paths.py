"""Paths inside a checkpoint directory: never outside it, never anything but a regular file.

Every name a checkpoint's own files give (the manifest's ``files``, DCP's storage items) is checked here
before anything is opened: a crafted checkpoint must not make a load read ``/etc/shadow`` through ``..`` or an
absolute path, follow a symlink out of the directory, block forever on a FIFO, or stream gigabytes from
``/dev/zero``. Files are opened with ``O_NOFOLLOW | O_NONBLOCK`` and checked to be regular with ``fstat`` on
the opened descriptor, so what is checked is what is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["relpath_problem", "file_problem", "recorded_file_problem", "read_regular_file"]


def relpath_problem(rel: object) -> str | None:
    """Why ``rel`` is not a safe POSIX path relative to a checkpoint directory, or ``None`` when it is.

    Safe: a non-empty string of ``/``-separated components, none empty, ``.`` or ``..``; not absolute; no
    backslash or NUL."""
    if not isinstance(rel, str) or not rel:
        return "is empty" if rel == "" else f"is not a string ({type(rel).__name__})"
    if rel.startswith("/"):
        return "is an absolute path"
    if "\\" in rel or "\x00" in rel:
        return "contains a backslash or NUL"
    if any(part in ("", ".", "..") for part in rel.split("/")):
        return "has an empty, '.' or '..' component"
    return None


def _lstat_problem(root: Path, rel: str) -> tuple[str | None, os.stat_result | None]:
    path = root / rel
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "is missing", None
    except OSError as e:
        return f"cannot be examined ({e.strerror})", None
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (a checkpoint's files must be regular files inside it)", st
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a directory, FIFO, socket or device)", st
    real_root = os.path.realpath(root)
    if os.path.commonpath([real_root, os.path.realpath(path)]) != real_root:
        return "resolves outside the checkpoint directory", st
    return None, st


def file_problem(root: Path, rel: str) -> str | None:
    """Why ``root/rel`` is not a regular file inside ``root`` (missing, a symlink, a directory, a FIFO, a
    device, or reached through a symlinked directory that leads outside), or ``None``. ``rel`` must already
    have passed :func:`relpath_problem`."""
    return _lstat_problem(root, rel)[0]


def recorded_file_problem(root: Path, rel: str, size: int) -> str | None:
    """One message naming ``root/rel`` if it is not a regular file inside ``root`` of ``size`` bytes (missing,
    truncated, extended, a symlink, a FIFO...), else ``None``: the same words wherever it is checked."""
    path = root / rel
    why, st = _lstat_problem(root, rel)
    if why == "is missing":
        return f"{path}: missing (expected {size} bytes)"
    if why is not None or st is None:
        return f"{path}: {why}"
    if st.st_size != size:
        kind = "truncated" if st.st_size < size else "extended"
        return f"{path}: size mismatch ({kind}): expected {size} bytes, got {st.st_size}"
    return None


def read_regular_file(path: Path, max_bytes: int | None = None) -> bytes:
    """The bytes of ``path``, refusing (``OSError``/``ValueError``) a symlink, a non-regular file, or one
    larger than ``max_bytes``; never blocks on a FIFO (opened non-blocking, checked with ``fstat``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file, or larger than ``max_bytes`` (the message says which).
        OSError: any other failure to open or read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == getattr(os, "ELOOP", -1) or os.path.islink(path):
            raise ValueError("is a symbolic link (a checkpoint's files must be regular files)") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("is not a regular file (a directory, FIFO, socket or device)")
        if max_bytes is not None and st.st_size > max_bytes:
            raise ValueError(f"is {st.st_size} bytes, more than the {max_bytes} expected")
        data = f.read(st.st_size + 1)  # +1: a file that grew since fstat is noticed, not read without bound
        if max_bytes is not None and len(data) > max_bytes:
            raise ValueError(f"grew past the {max_bytes} bytes expected while being read")
        return data
