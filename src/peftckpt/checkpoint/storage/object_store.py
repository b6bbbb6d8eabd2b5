"""Checkpoint locations on object storage: ``s3://bucket/prefix`` (and what else fsspec reaches).

An :class:`ObjectStore` is a thin, typed wrapper over the fsspec file system of one URL's scheme with the few
operations the commit protocol needs (read, write, upload -- whole or in parts --, download while hashing, list,
delete, copy); URLs are
parsed and refused by :mod:`peftckpt.checkpoint.location.urls`. Credentials and endpoints come from the store's own standard
configuration (for S3: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``~/.aws/config``,
``AWS_ENDPOINT_URL``), never from flags, so they never reach a manifest or a log.

Every failure a user can cause -- an unknown scheme, a missing package, no bucket, a missing bucket, no
credentials, an unreachable endpoint -- is one :class:`~peftckpt.checkpoint.errors.CheckpointError` naming
the URL (:func:`store_error`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from peftckpt.checkpoint.errors import CheckpointError, CheckpointNotFoundError

__all__ = ["ObjectStore", "store_error"]

_COPY_BLOCK = 8 * 1024 * 1024


class ObjectStore:
    """A checkpoint location on an object store: ``url`` (no trailing ``/``) and its fsspec file system.

    Relative names (``rel``) are ``/``-separated and relative to the location; ``""`` is the location itself.
    Errors from the store are translated by :func:`store_error` at the call sites that can name what failed.
    """

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        scheme = self.url.split("://", 1)[0].lower()
        self.scheme = scheme
        self.fs: Any = _file_system(scheme)
        self.root = self.url[len(scheme) + 3:]
        self.bucket = self.root.split("/", 1)[0]

    def __repr__(self) -> str:
        return f"ObjectStore({self.url!r})"

    def __str__(self) -> str:
        return self.url

    def key(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def url_of(self, rel: str = "") -> str:
        return f"{self.url}/{rel}" if rel else self.url

    def name(self) -> str:
        """The last component of the location (``iter_0000004`` for ``s3://b/run/iter_0000004``)."""
        return self.root.rstrip("/").rsplit("/", 1)[-1]

    # ------------------------------------------------------------------------------------- probing
    def check_reachable(self) -> None:
        """Raise one clear :class:`CheckpointError` unless the bucket exists and can be listed with the
        configured credentials (nothing is written)."""
        try:
            self.fs.call_s3("head_bucket", Bucket=self.bucket)  # a HEAD, not a LIST: every rank may ask
        except Exception as e:  # noqa: BLE001 - translated into one message naming the URL
            raise store_error(e, self.url, f"bucket {self.bucket}") from None

    # ---------------------------------------------------------------------------------- small objects
    def read_bytes(self, rel: str, max_bytes: int | None = None) -> bytes:
        """The object ``rel``; ``FileNotFoundError`` when absent, ``ValueError`` when larger than ``max_bytes``."""
        key = self.key(rel)
        if max_bytes is None:
            whole: bytes = self.fs.cat_file(key)
            return whole
        data: bytes = self.fs.cat_file(key, start=0, end=max_bytes + 1)  # one ranged GET, never past the bound
        if len(data) > max_bytes:
            raise ValueError(f"is more than the {max_bytes} bytes expected")
        return data

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write the object ``rel`` (one PUT: readers see the old object or the new one, never a part)."""
        self.fs.pipe_file(self.key(rel), data)

    def _object_key(self, rel: str) -> str:
        """The key of ``rel`` within the bucket (what the store's own API calls take)."""
        return self.key(rel)[len(self.bucket) + 1:]

    def exists(self, rel: str) -> bool:
        """Whether the object ``rel`` exists: one HEAD (fsspec's ``exists`` LISTs the prefix after a miss, to
        find a "directory")."""
        try:
            self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._object_key(rel))
        except FileNotFoundError:
            return False
        return True

    def size(self, rel: str) -> int:
        """The size of the object ``rel`` (one HEAD); ``FileNotFoundError`` when absent."""
        info = self.fs.call_s3("head_object", Bucket=self.bucket, Key=self._object_key(rel))
        return int(info["ContentLength"])

    # ----------------------------------------------------------------------------------- transfers
    def upload(self, local: Path, rel: str) -> None:
        """Copy the local file ``local`` to the object ``rel`` (multipart for large files)."""
        self.fs.put_file(str(local), self.key(rel))

    # A multipart upload: nothing is visible under ``rel`` until :meth:`finish_upload`, all of it at once.
    def start_upload(self, rel: str) -> str:
        """Begin a multipart upload of the object ``rel``; its upload id."""
        reply = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self._object_key(rel))
        return str(reply["UploadId"])

    def upload_part(self, rel: str, upload_id: str, number: int, data: bytes | bytearray) -> str:
        """Upload part ``number`` (from 1; every part but the last at least 5 MiB on S3); its ETag."""
        reply = self.fs.call_s3("upload_part", Bucket=self.bucket, Key=self._object_key(rel), UploadId=upload_id,
                                PartNumber=number, Body=data)
        return str(reply["ETag"])

    def finish_upload(self, rel: str, upload_id: str, etags: list[str]) -> None:
        """Complete the upload from its parts' ETags, in order: the object appears whole."""
        parts = [{"PartNumber": n, "ETag": etag} for n, etag in enumerate(etags, 1)]
        self.fs.call_s3("complete_multipart_upload", Bucket=self.bucket, Key=self._object_key(rel),
                        UploadId=upload_id, MultipartUpload={"Parts": parts})
        self.fs.invalidate_cache(self.key(rel))

    def abort_upload(self, rel: str, upload_id: str) -> None:
        """Abandon an unfinished upload: its parts are deleted, nothing appears."""
        self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self._object_key(rel), UploadId=upload_id)

    def unfinished_uploads(self, rel: str = "") -> list[tuple[str, str]]:
        """``(name relative to the location, upload id)`` of every multipart upload begun below ``rel`` and
        neither finished nor aborted (one listing request per 1000)."""
        below = self._object_key(rel)  # "" for the whole bucket
        prefix = f"{below}/" if below else ""
        location = self._object_key("")
        at = len(location) + 1 if location else 0
        found: list[tuple[str, str]] = []
        marks: dict[str, str] = {}
        while True:
            reply = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket, Prefix=prefix, **marks)
            found += [(u["Key"][at:], u["UploadId"]) for u in reply.get("Uploads", [])]
            if not reply.get("IsTruncated"):
                return found
            marks = {"KeyMarker": reply["NextKeyMarker"], "UploadIdMarker": reply["NextUploadIdMarker"]}

    def download(self, rel: str, local: Path, on_block: Callable[[memoryview], None] | None = None,
                 limit: int | None = None, size: int | None = None) -> int:
        """Stream the object ``rel`` into the local file ``local``, handing each block to ``on_block`` (a
        digest's ``update``) as it arrives; returns the bytes written. Stops with ``ValueError`` past ``limit``
        bytes (an object grown since it was recorded is never read without bound). ``size``: the object's size
        as a listing just gave it (a small object then comes in one GET, without the HEAD that asks for it)."""
        with open(local, "wb") as dst:
            def written(block: memoryview) -> None:
                if on_block is not None:
                    on_block(block)
                dst.write(block)

            return self.read_through(rel, written, limit, size)

    def read_through(self, rel: str, on_block: Callable[[memoryview], None], limit: int | None = None,
                     size: int | None = None) -> int:
        """Stream the object ``rel`` to ``on_block`` without keeping it; returns its size (``limit`` and ``size``
        as in :meth:`download`)."""
        total = 0
        for block in self._blocks(rel, limit, size):
            total += len(block)
            on_block(block)
        return total

    def _blocks(self, rel: str, limit: int | None, size: int | None) -> Iterator[memoryview]:
        """The bytes of the object ``rel`` in consecutive blocks (each valid until the next is asked for)."""
        if size is not None and size <= _COPY_BLOCK:
            yield memoryview(self.read_bytes(rel, limit))
            return
        total = 0
        buf = bytearray(_COPY_BLOCK)
        view = memoryview(buf)
        with self.fs.open(self.key(rel), "rb", block_size=_COPY_BLOCK) as src:
            while n := src.readinto(buf):
                total += n
                if limit is not None and total > limit:
                    raise ValueError(f"is larger than the {limit} bytes recorded")
                yield view[:n]

    def copy(self, src_rel: str, dst_rel: str) -> None:
        """Server-side copy of one object (no bytes through this process where the store supports it)."""
        self.fs.copy(self.key(src_rel), self.key(dst_rel))

    # ------------------------------------------------------------------------------------- listing
    def list_files(self, rel: str = "") -> dict[str, int]:
        """Every object below ``rel``: ``{name relative to rel: size}`` (empty when there is none)."""
        base = self.key(rel).rstrip("/")
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for key, info in found.items():
            if info.get("type", "file") != "file":
                continue
            name = key[len(base) + 1:] if key.startswith(base + "/") else None
            if name:
                out[name] = int(info.get("size") or 0)
        return out

    def list_tagged(self, rel: str = "") -> dict[str, tuple[int, str]]:
        """The objects directly below ``rel``: ``{name: (size, ETag)}`` (one listing; the ETag changes whenever the
        object is rewritten)."""
        base = self.key(rel).rstrip("/")
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.ls(base, detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        return {str(info["name"]).rsplit("/", 1)[-1]: (int(info.get("size") or 0), str(info.get("ETag", "")))
                for info in found if info.get("type", "file") == "file"}

    def children(self) -> list[str]:
        """The first-level names below the location (objects and common prefixes)."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted({str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries})

    def delete(self, rel: str) -> None:
        """Delete the object ``rel``, or every object below the prefix ``rel`` (absent: nothing happens)."""
        keys = [self.key(rel)] if self.fs.isfile(self.key(rel)) else [
            self.key(f"{rel}/{name}") for name in self.list_files(rel)]
        if keys:
            self.fs.rm(keys)
        self.fs.invalidate_cache(self.root)


_CLIENT_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
               "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_SHARED_CREDENTIALS_FILE",
               "AWS_CONFIG_FILE")
"""The environment a store's client is configured from: a client is reused only while these are unchanged."""
_FILE_SYSTEMS: dict[tuple[Any, ...], Any] = {}
_FILE_SYSTEMS_GUARD = threading.Lock()


def _file_system(scheme: str) -> Any:
    """The process's fsspec file system for ``scheme``, made once per configuration (making one -- a session, a
    client, its connections -- cost ~60 ms a save or load against a local server), without a listings cache
    (every listing is asked afresh: the commit protocol relies on what the store says now)."""
    import fsspec

    key = (scheme, os.getpid(), tuple(os.environ.get(k) for k in _CLIENT_ENV))
    with _FILE_SYSTEMS_GUARD:
        fs = _FILE_SYSTEMS.get(key)
        if fs is None:
            fs = _FILE_SYSTEMS[key] = fsspec.filesystem(scheme, skip_instance_cache=True, use_listings_cache=False)
        return fs


def store_error(exc: BaseException, url: str, what: str) -> CheckpointError:
    """One clear error for a store failure on ``what`` (an object or the bucket) of ``url``."""
    name = type(exc).__name__
    text = str(exc)
    if isinstance(exc, CheckpointError):
        return exc
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError") or (
            "credentials" in text.lower() and "locate" in text.lower()):
        return CheckpointError(
            f"{url}: no credentials for the object store: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE / ~/.aws/credentials); an S3-compatible server's address goes in AWS_ENDPOINT_URL")
    if isinstance(exc, PermissionError) or name in ("ClientError",) and "AccessDenied" in text:
        return CheckpointError(f"{url}: access to {what} denied with the configured credentials ({text})")
    if isinstance(exc, FileNotFoundError):
        if "bucket" in text.lower() and "not exist" in text.lower():
            bucket = url.split("://", 1)[1].split("/", 1)[0]
            return CheckpointNotFoundError(f"{url}: bucket {bucket} does not exist (create it first; peftckpt never "
                                           "creates buckets)")
        return CheckpointNotFoundError(f"{url}: {what} does not exist")
    if name in ("EndpointConnectionError", "ConnectTimeoutError", "ClientConnectorError", "ConnectionError") or \
            isinstance(exc, ConnectionError):
        return CheckpointError(f"{url}: cannot reach the object store ({text}); check AWS_ENDPOINT_URL and the "
                               "network")
    return CheckpointError(f"{url}: {what}: {name}: {text}")
