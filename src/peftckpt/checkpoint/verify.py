"""Offline integrity check of a checkpoint: ``peftckpt verify DIR`` (no process group, no torchrun).

Steps of :func:`verify_checkpoint`:
    1. Resolve ``DIR`` (a save directory via its tracker, or a checkpoint directory).
    2. Read and validate the JSON manifest.
    3. Check every file against the manifest's sizes and checksums, and look for unlisted files.
    4. For ``torch_dist``: load DCP's ``.metadata`` through the restricted unpickler and check that every
       key of ``manifest.saved_keys`` is a tensor there with the recorded global shape and dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from peftckpt.checkpoint.checksums import verify_files
from peftckpt.checkpoint.errors import CheckpointError
from peftckpt.checkpoint.manifest import Manifest, read_manifest
from peftckpt.checkpoint.safe_pickle import load_dcp_metadata
from peftckpt.checkpoint.storage_layout import resolve_checkpoint_dir

__all__ = ["DCP_METADATA_FILENAME", "VerifyReport", "verify_checkpoint", "verify_main"]

DCP_METADATA_FILENAME = ".metadata"
"""DCP's global metadata file inside a ``torch_dist`` checkpoint directory."""


@dataclass
class VerifyReport:
    """Outcome of :func:`verify_checkpoint`."""

    path: Path
    """The checkpoint directory that was checked (after resolving a save directory)."""
    iteration: int
    """Its iteration."""
    problems: list[str] = field(default_factory=list)
    """One human-readable line per problem; empty when the checkpoint is intact."""
    num_files: int = 0
    """Number of files the manifest lists."""
    total_bytes: int = 0
    """Sum of their recorded sizes."""

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form (``peftckpt verify --json``)."""
        return {
            "path": str(self.path),
            "iteration": self.iteration,
            "ok": self.ok,
            "problems": list(self.problems),
            "num_files": self.num_files,
            "total_bytes": self.total_bytes,
        }


def _normalise_dtype(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def _check_dcp_keys(metadata: Metadata, manifest: Manifest, source: Path) -> list[str]:
    problems = []
    entries = metadata.state_dict_metadata
    for key, rec in sorted(manifest.saved_keys.items()):
        entry = entries.get(key)
        if entry is None:
            problems.append(f"{source}: saved key {key!r} listed in the manifest is absent from DCP metadata")
            continue
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(
                f"{source}: saved key {key!r} is a {type(entry).__name__} in DCP metadata, not a tensor"
            )
            continue
        got_shape = list(entry.size)
        if got_shape != list(rec["shape"]):
            problems.append(
                f"{source}: saved key {key!r} has global shape {got_shape} in DCP metadata, "
                f"manifest says {list(rec['shape'])}"
            )
        got_dtype = _normalise_dtype(entry.properties.dtype)
        if got_dtype != _normalise_dtype(rec["dtype"]):
            problems.append(
                f"{source}: saved key {key!r} has dtype {got_dtype} in DCP metadata, manifest says {rec['dtype']}"
            )
    return problems


def verify_checkpoint(path: str | os.PathLike[str]) -> VerifyReport:
    """Check a checkpoint offline; see the module docstring for the steps.

    Raises:
        CheckpointNotFoundError / CheckpointFormatError: ``path`` holds no committed checkpoint, or its
            manifest is unreadable (then nothing else can be checked). Damage to the checkpoint's other
            files is reported in :attr:`VerifyReport.problems`, not raised.
    """
    ckpt_dir, iteration = resolve_checkpoint_dir(path)  # 1
    manifest = read_manifest(ckpt_dir)  # 2
    report = VerifyReport(
        path=ckpt_dir, iteration=iteration, num_files=len(manifest.files), total_bytes=manifest.total_bytes
    )
    if manifest.iteration != iteration:
        report.problems.append(
            f"{ckpt_dir}: manifest says iteration {manifest.iteration} but the directory is iteration {iteration}"
        )
    report.problems.extend(verify_files(ckpt_dir, manifest))  # 3
    if manifest.format == "torch_dist":  # 4
        md_path = ckpt_dir / DCP_METADATA_FILENAME
        if DCP_METADATA_FILENAME not in manifest.files:
            report.problems.append(
                f"{md_path}: torch_dist checkpoint whose manifest does not list DCP metadata"
            )
        if md_path.is_file():
            try:
                metadata = load_dcp_metadata(md_path)
            except CheckpointError as exc:
                report.problems.append(str(exc))
            else:
                report.problems.extend(_check_dcp_keys(metadata, manifest, md_path))
    return report


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="peftckpt verify",
        description="Check a checkpoint offline: manifest, file sizes and checksums, DCP metadata.",
    )
    parser.add_argument(
        "dir", metavar="DIR", help="a save directory (uses its tracker) or an iter_* directory"
    )
    parser.add_argument("--json", action="store_true", help="print a JSON report on stdout")
    return parser


def verify_main(argv: list[str] | None = None) -> int:
    """``peftckpt verify DIR [--json]``. Exit code: 0 intact, 1 problems found, 2 usage error."""
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return exc.code if isinstance(exc.code, int) else 2
    target = Path(args.dir)
    if not target.exists():
        print(f"peftckpt verify: error: DIR {target} does not exist", file=sys.stderr)
        return 2
    try:
        report = verify_checkpoint(target)
    except CheckpointError as exc:
        if args.json:
            print(json.dumps({"path": str(target), "ok": False, "problems": [str(exc)]}, indent=2))
        print(f"peftckpt verify: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    if report.ok:
        if not args.json:
            mib = report.total_bytes / 2**20
            print(f"OK {report.path} (iteration {report.iteration}, {report.num_files} files, {mib:.1f} MiB)")
        return 0
    for problem in report.problems:
        print(problem, file=sys.stderr)
    print(f"FAILED {report.path}: {len(report.problems)} problem(s)", file=sys.stderr)
    return 1
