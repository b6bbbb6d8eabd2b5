"""A local S3-compatible server to try checkpoints on object storage without an AWS account.

    python scripts/local_s3.py start --port 9753 --bucket my-bucket   # returns once it serves; prints the exports
    python scripts/local_s3.py stop --port 9753

It runs moto's standalone server (installed with the test extra: ``pip install -e ".[test]"``) in the
background on 127.0.0.1, keeps objects in memory until stopped, and accepts any credentials. Point peftckpt at it
with the standard AWS variables (``start`` prints them); with a real bucket, set those for your account instead.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def _pid_file(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"peftckpt-local-s3-{port}.pid"


def start(port: int, bucket: str) -> int:
    endpoint = f"http://127.0.0.1:{port}"
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            print(f"local_s3: port {port} is in use (stop it with: python scripts/local_s3.py stop --port {port})",
                  file=sys.stderr)
            return 1
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' launcher
    from tests.s3_server import launch_moto

    try:
        proc = launch_moto(port, detached=True)
    except RuntimeError as e:
        print(f"local_s3: {e}", file=sys.stderr)
        return 1
    _pid_file(port).write_text(str(proc.pid))
    import s3fs

    s3fs.S3FileSystem(key=ENV["AWS_ACCESS_KEY_ID"], secret=ENV["AWS_SECRET_ACCESS_KEY"], endpoint_url=endpoint).mkdir(bucket)
    exports = " ".join(f"{k}={v}" for k, v in {**ENV, "AWS_ENDPOINT_URL": endpoint}.items())
    print(f"local S3 server on {endpoint} (pid {proc.pid}), bucket {bucket}; use it with:\nexport {exports}")
    return 0


def stop(port: int) -> int:
    pid_file = _pid_file(port)
    if not pid_file.exists():
        print(f"local_s3: no server started here on port {port}", file=sys.stderr)
        return 1
    pid = int(pid_file.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    pid_file.unlink()
    print(f"stopped the local S3 server on port {port} (pid {pid})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=["start", "stop"])
    p.add_argument("--port", type=int, default=9753)
    p.add_argument("--bucket", default="my-bucket", help="bucket to create (start)")
    args = p.parse_args(argv)
    return start(args.port, args.bucket) if args.action == "start" else stop(args.port)


if __name__ == "__main__":
    sys.exit(main())
