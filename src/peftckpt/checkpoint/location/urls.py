"""The one place that tells a path from a URL: which URLs can hold checkpoints, and what a value names.

:func:`parse_location` turns a flag's value into a local :class:`~pathlib.Path` (``file:///abs/path`` is one) or
an :class:`~peftckpt.checkpoint.storage.object_store.ObjectStore`, refusing an unsupported URL with one reason;
:func:`~peftckpt.checkpoint.location.locate.locate` wraps the result in its
:class:`~peftckpt.checkpoint.location.base.Location`.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ..errors import CheckpointError
from ..storage.object_store import ObjectStore

__all__ = ["SCHEME_PACKAGES", "is_url", "url_problem", "local_only_problem", "parse_location"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

SCHEME_PACKAGES = {"s3": "s3fs", "s3a": "s3fs"}
"""The package that gives fsspec each object-store scheme peftckpt admits (the ``s3`` extra brings s3fs)."""

UNTESTED_SCHEMES = {"gs": "Google Cloud Storage", "gcs": "Google Cloud Storage", "az": "Azure Blob Storage",
                    "abfs": "Azure Blob Storage", "abfss": "Azure Blob Storage"}
"""Object stores fsspec could reach, refused until peftckpt's commit protocol has run against them (its
guarantees rest on each store's semantics: conditional writes, read-after-write, listing)."""


def is_url(value: object) -> bool:
    """Whether ``value`` is a URL (``scheme://...``) rather than a file system path."""
    return isinstance(value, str) and _URL.match(value) is not None


def url_problem(value: object) -> str | None:
    """Why the URL ``value`` cannot be a checkpoint location, or ``None`` (also for a plain path)."""
    if not isinstance(value, str):
        return None
    match = _URL.match(value)
    if match is None:
        return None
    scheme = match.group(1).lower()
    if scheme == "file":
        parts = urlsplit(value)
        if parts.netloc not in ("", "localhost"):
            return "is a file:// URL with a host; use file:///absolute/path"
        return None
    if scheme in UNTESTED_SCHEMES:
        return (f"is on {UNTESTED_SCHEMES[scheme]} ({scheme}://), which peftckpt does not support yet: its commit "
                "protocol has run only against S3 (s3://, or an S3-compatible server through AWS_ENDPOINT_URL); use "
                "one of those, or a local or mounted path")
    if scheme not in SCHEME_PACKAGES:
        return (f"has scheme {scheme}://, which peftckpt does not store checkpoints on (supported: "
                f"{', '.join(s + '://' for s in ('s3', 'file'))}, or a local path)")
    package = SCHEME_PACKAGES[scheme]
    if importlib.util.find_spec(package) is None:
        extra = " (pip install s3fs, or the s3 extra: pip install '.[s3]' in a peftckpt checkout)" \
            if package == "s3fs" else ""
        return f"needs the {package} package for {scheme}://, which is not installed{extra}"
    rest = value[match.end():]
    bucket = rest.split("/", 1)[0]
    if not bucket:
        return f"names no bucket (expected {scheme}://BUCKET/PREFIX)"
    if "\\" in rest or any(part in (".", "..") for part in rest.split("/")):
        return "has a '.' or '..' component or a backslash"
    return None


def local_only_problem(value: str | os.PathLike[str]) -> str | None:
    """Why ``value``, a path that must be local (an export's output directory, say), cannot be used, or
    ``None``: a URL such as ``s3://bucket/prefix`` would otherwise become a local directory named ``s3:``."""
    if not is_url(value):
        return None
    return "is a URL, but this path must be a local (or mounted) file system path"


def parse_location(value: str | os.PathLike[str], what: str) -> Path | ObjectStore:
    """``value`` as a local path or a store; ``what`` (e.g. ``"--save"``) names it in the one error a bad URL
    gets. ``file:///abs/path`` is the local path ``/abs/path`` (with the local commit protocol: rename, fsync)."""
    text = os.fspath(value)
    problem = url_problem(text)
    if problem is not None:
        raise CheckpointError(f"{what} {text} {problem}")
    if not is_url(text):
        return Path(text)
    if text.lower().startswith("file://"):
        return Path(unquote(urlsplit(text).path))
    return ObjectStore(text)
