"""Fixtures shared by the unit tests that run against the local S3-compatible server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ..s3_server import S3Server, s3_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1, one per test module."""
    with s3_server(tmp_path_factory.mktemp("cache")) as s:
        yield s


@pytest.fixture
def s3(server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The server, with this process's environment pointed at it (credentials, endpoint, cache directory)."""
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    return server
