"""The bench's S3 rows: a local S3-compatible server (moto's, the one the tests start) for the run's length."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

S3_ENV = "PEFTCKPT_BENCH_S3"
"""Set (to the base URL of the bench's objects) while the S3 server runs; the worker ranks inherit it."""
RECORDING_ENV = "PEFTCKPT_BENCH_S3_RECORDING"
"""Set (to the server's request log) while the S3 server runs: :func:`requests` counts what it recorded."""


def _importable_tests() -> None:
    root = str(Path(__file__).resolve().parents[1])  # the repository root: tests.s3_server
    if root not in sys.path:
        sys.path.insert(0, root)


def available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("s3fs", "moto"))


@contextlib.contextmanager
def s3_for_bench(work: Path) -> Iterator[str]:
    """Start the server, point this process's AWS variables (inherited by spawned workers) at it, yield the base
    URL for the bench's checkpoints."""
    _importable_tests()
    from tests.s3_server import BUCKET, s3_server

    from peftckpt.checkpoint.location.store_lease import LEASE_ENV

    with s3_server(work / "s3-cache", recording=work / "s3-requests.jsonl") as server:
        env = {k: v for k, v in server.env.items() if k != LEASE_ENV}  # the default lease, not the tests' 2 s: its
        saved = {k: os.environ.get(k) for k in [*env, S3_ENV, RECORDING_ENV]}  # renewals would load the server
        os.environ.update(env)
        os.environ[S3_ENV] = f"s3://{BUCKET}/bench"
        os.environ[RECORDING_ENV] = str(server.recording)
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


def _server() -> Any:
    _importable_tests()
    from tests.s3_server import S3Server

    return S3Server(os.environ["AWS_ENDPOINT_URL"], {}, Path(os.environ[RECORDING_ENV]))


def record() -> None:
    """Start counting the server's requests from now (one process calls it)."""
    _server().record()


def requests() -> dict[str, int]:
    """The requests the server served since :func:`record`, by S3 operation (LIST, HEAD, GET, PUT, POST, DELETE)."""
    return dict(sorted(_server().requests().items()))


class PlainTransfer:
    """The reference for our S3 rows: the same files put to and got from the same server with s3fs's own
    concurrent ``put`` / ``get`` (all files in flight at once), no checkpoint protocol."""

    def __init__(self, url: str):
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        self.prefix = url.removeprefix("s3://")

    def put(self, files: list[Path], root: Path) -> None:
        self.fs.put([str(f) for f in files], [f"{self.prefix}/{f.relative_to(root)}" for f in files])

    def get_ranged(self, files: list[Path], root: Path) -> None:
        """The same objects by ranged GETs of the parts a load of ours cuts them into (``PART_BYTES``, as many in
        flight as its pool has threads), into memory: the request pattern of our loads, no protocol, no copy."""
        from concurrent.futures import ThreadPoolExecutor

        from peftckpt.checkpoint.location.store_reads import GET_THREADS
        from peftckpt.checkpoint.storage.object_ranges import PART_BYTES

        ranges = [(f"{self.prefix}/{f.relative_to(root)}", start, min(start + PART_BYTES, f.stat().st_size))
                  for f in files for start in range(0, f.stat().st_size, PART_BYTES)]
        with ThreadPoolExecutor(GET_THREADS) as pool:
            list(pool.map(lambda r: self.fs.cat_file(r[0], start=r[1], end=r[2]), ranges))

    def get(self, files: list[Path], root: Path, into: Path) -> None:
        for f in files:
            (into / f.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
        self.fs.get([f"{self.prefix}/{f.relative_to(root)}" for f in files],
                    [str(into / f.relative_to(root)) for f in files])
