"""The bench's S3 rows: a local S3-compatible server (moto's, the one the tests start) for the run's length."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

S3_ENV = "PEFTCKPT_BENCH_S3"
"""Set (to the base URL of the bench's objects) while the S3 server runs; the worker ranks inherit it."""


def available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("s3fs", "moto"))


@contextlib.contextmanager
def s3_for_bench(work: Path) -> Iterator[str]:
    """Start the server, point this process's AWS variables (inherited by spawned workers) at it, yield the base
    URL for the bench's checkpoints."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.s3_server
    from tests.s3_server import BUCKET, s3_server

    with s3_server(work / "s3-cache") as server:
        saved = {k: os.environ.get(k) for k in [*server.env, S3_ENV]}
        os.environ.update(server.env)
        os.environ[S3_ENV] = f"s3://{BUCKET}/bench"
        try:
            yield os.environ[S3_ENV]
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def drop(url: str) -> None:
    """Delete every object below ``url`` (untimed, between repeats)."""
    from peftckpt.checkpoint.storage.object_store import ObjectStore

    ObjectStore(url).delete("")
