"""A real S3-compatible server for the object-store tests: moto's standalone server, a separate process on
127.0.0.1, started and stopped by a fixture (nothing to set up by hand)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from peftckpt.checkpoint.location.names import LOCK_FILENAME

BUCKET = "peftckpt-test"


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]
    """The AWS variables a client needs (credentials, region, endpoint), a node-local cache directory, and a short
    run-lock lease (2 s: a rerun after a killed run takes the location over after 1 s)."""
    recording: Path | None = None

    def record(self) -> None:
        """Start counting requests from now (the server's recorder, emptied; needs ``recording``)."""
        assert self.recording is not None, "start the server with a recording file"
        for action in ("reset-recording", "start-recording"):
            urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/recorder/{action}",
                                                          method="POST"), timeout=10).close()

    def requests(self) -> Counter[str]:
        """The requests served since :meth:`record`, by S3 operation: ``LIST`` (of objects or of unfinished
        uploads), ``HEAD``, ``GET`` (ranged or
        not), ``PUT`` (objects, parts and copies), ``POST`` (multipart uploads, batch deletes), ``DELETE``; and apart,
        ``LEASE``: any request on the run lock's lease object (taken, renewed every quarter lease while the run holds
        the location, so its count grows with the run's duration, not with what a save or load does)."""
        assert self.recording is not None
        counts: Counter[str] = Counter()
        if not self.recording.exists():
            return counts
        for entry in _json_records(self.recording.read_text()):
            parts = urlsplit(entry["url"])
            query = parse_qs(parts.query, keep_blank_values=True)
            on_bucket = parts.path.strip("/").count("/") == 0
            method = entry["method"]
            listing = method == "GET" and on_bucket and ("list-type" in query or "prefix" in query or "uploads" in query
                                                         or "delimiter" in query or not query)
            lease = parts.path.endswith(f"/{LOCK_FILENAME}")
            counts["LEASE" if lease else "LIST" if listing else method] += 1
        return counts

    def fs(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(key=self.env["AWS_ACCESS_KEY_ID"], secret=self.env["AWS_SECRET_ACCESS_KEY"],
                                 endpoint_url=self.endpoint, skip_instance_cache=True)

    def url(self, prefix: str) -> str:
        return f"s3://{BUCKET}/{prefix}"

    def flip_byte(self, key: str, offset: int = -100) -> None:
        """Flip one byte of the object ``key`` (below the bucket) in place."""
        fs = self.fs()
        data = bytearray(fs.cat_file(f"{BUCKET}/{key}"))
        data[offset] ^= 0x01
        fs.pipe_file(f"{BUCKET}/{key}", bytes(data))

    def keys(self, prefix: str) -> list[str]:
        fs = self.fs()
        fs.invalidate_cache()
        try:
            return sorted(k.removeprefix(f"{BUCKET}/{prefix}/") for k in fs.find(f"{BUCKET}/{prefix}"))
        except FileNotFoundError:
            return []

    def download(self, prefix: str, into: Path) -> Path:
        """Every object below ``prefix``, copied into the local directory ``into``."""
        fs = self.fs()
        for key in fs.find(f"{BUCKET}/{prefix}"):
            target = into / key.removeprefix(f"{BUCKET}/{prefix}/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(fs.cat_file(key))
        return into


def _json_records(text: str) -> Iterator[dict[str, Any]]:
    """The JSON objects of moto's recording, one after another (a record with a large body may not end its line)."""
    decoder = json.JSONDecoder()
    at = 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return
        entry, at = decoder.raw_decode(text, at)
        yield entry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_moto(port: int, detached: bool = False, recording: Path | None = None) -> subprocess.Popen[bytes]:
    """Start moto's S3 server on 127.0.0.1:``port`` and return once it serves (``detached``: in a session of its
    own, outliving this process; ``recording``: the file where moto's recorder logs each request once started,
    see :meth:`S3Server.requests`). Raises ``RuntimeError`` if it does not come up."""
    env = {**os.environ, "MOTO_RECORDER_FILEPATH": str(recording)} if recording is not None else None
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=detached, env=env)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1:{port} (is moto installed? "
                                   "pip install 'moto[server]')") from None
            time.sleep(0.2)


@contextmanager
def s3_server(cache: Path, recording: Path | None = None) -> Iterator[S3Server]:
    """Start moto's S3 server on a free port, create the test bucket, yield it; stop it afterwards.
    ``recording``: a file for :meth:`S3Server.requests` (the server can then count the requests it serves)."""
    port = _free_port()
    proc = launch_moto(port, recording=recording)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": endpoint, "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "AWS_CONFIG_FILE": os.devnull,
               "PEFTCKPT_CACHE_DIR": str(cache), "PEFTCKPT_STORE_LEASE_S": "2"}
        server = S3Server(endpoint, env, recording)
        server.fs().mkdir(BUCKET)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
