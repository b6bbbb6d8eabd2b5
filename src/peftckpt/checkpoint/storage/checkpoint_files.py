"""The files of one committed checkpoint as a load reads them.

A load needs four things from a checkpoint's files besides its small ones (manifest, ``.metadata``, which are
always local): their presence and sizes checked against the manifest, to know which data files carry a block
index (verified by the read itself, block by block), the whole-file checksums of the others, and byte ranges of
the data files for the reader. :class:`CheckpointFiles` answers them for a local directory; a location that keeps
its data elsewhere -- a store, read where it lies -- answers them its own way
(:class:`~peftckpt.checkpoint.location.store_reads.StoreFiles`), so the load itself never asks where it reads from.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from .byte_sources import ByteSource
from .checksums import verify_checksums, verify_files
from .dcp_reader import has_block_index
from .manifest import Manifest

__all__ = ["CheckpointFiles"]


class CheckpointFiles:
    """A checkpoint directory ``root`` read in place (see the module docstring)."""

    verified_while_read = False
    """Its data files are verified only as they are read (the reads never see a whole local file)."""

    def __init__(self, root: Path, url: str | None = None, hashed: bool = False, cached: Path | None = None,
                 fetched: int | None = None) -> None:
        self.root = root
        self.url = url
        """The name messages give the checkpoint when ``root`` is not it (a store's URL); ``None``: ``root`` is."""
        self.hashed = hashed
        """Every file was already hashed against the manifest (a verified copy): a load does not hash them again."""
        self.cached = cached
        """The host's cached copy of the checkpoint that ``root`` is (a base fetched from a store), if it is one."""
        self._fetched = fetched

    @property
    def listed(self) -> Mapping[str, int] | None:
        """The data files' sizes as listed elsewhere (``None``: the files under :attr:`root` are examined)."""
        return None

    @property
    def sources(self) -> Callable[[str], ByteSource] | None:
        """Opens a data file by its name (``None``: the reader opens the file under :attr:`root`)."""
        return None

    def file_problems(self, manifest: Manifest, shard: tuple[int, int], hash_if: Callable[[str], bool] | None
                      ) -> list[str]:
        """:func:`~peftckpt.checkpoint.storage.checksums.verify_files` of this rank's share."""
        return verify_files(self.root, manifest, shard, hash_if=hash_if)

    def has_block_index(self, rel: str) -> bool:
        """Whether data file ``rel`` ends with a block index."""
        return has_block_index(self.root / rel)

    def checksum_problems(self, manifest: Manifest, rels: list[str]) -> list[str]:
        """The whole-file checksums of data files ``rels`` (already checked for presence and size)."""
        return verify_checksums(self.root, manifest, rels)

    @property
    def bytes_fetched(self) -> int | None:
        """Bytes this rank fetched from elsewhere for the load: by its reads so far, or for the host's cached copy
        ``root`` is (the whole copy on the rank that fetched it, 0 on the others and on a cache hit); ``None``: a
        directory, or a fresh verified copy."""
        return self._fetched

    def close(self) -> None:
        """Release what the reads held (nothing, for a directory)."""
