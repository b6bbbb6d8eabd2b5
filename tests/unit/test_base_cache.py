"""The host's base cache (issue 27): a hit reads the entry as it is, a miss fills it whole and renames it into
place, two fills of one entry keep one, the least recently used entries go beyond the cap -- never one in use."""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from peftckpt.checkpoint.location.base_cache import BaseCache


def _filler(nbytes: int, calls: list[Path]):  # type: ignore[no-untyped-def]
    def fill(into: Path) -> list[str]:
        calls.append(into)
        into.mkdir(parents=True)
        (into / "data").write_bytes(b"x" * nbytes)
        return []
    return fill


def test_hit_miss_and_a_failed_fill(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path / "bases", cap_bytes=10_000)
    calls: list[Path] = []
    with cache.use("a", _filler(100, calls)) as (where, hit, problems):
        assert not hit and problems == [] and where == cache.entry("a") and (where / "data").is_file()
    with cache.use("a", _filler(100, calls)) as (where, hit, _):
        assert hit and where == cache.entry("a")
    assert len(calls) == 1  # the hit fetched nothing
    with cache.use("b", lambda into: (into.mkdir(parents=True), ["bad object"])[1]) as (where, hit, problems):
        assert problems == ["bad object"] and not hit
    assert not cache.entry("b").exists() and [p.name for p in (tmp_path / "bases").iterdir()
                                               if not p.name.startswith(".")] == ["a"]  # nothing of a bad fill kept


def test_a_fill_that_loses_the_race_uses_the_winner(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path / "bases", cap_bytes=10_000)

    def racing(into: Path) -> list[str]:  # another run completes the entry while this one fills
        _filler(5, [])(into)
        _filler(7, [])(cache.entry("k"))
        return []

    with cache.use("k", racing) as (where, hit, problems):
        assert where == cache.entry("k") and problems == [] and (where / "data").stat().st_size == 7
    assert [p.name for p in (tmp_path / "bases").iterdir() if not p.name.startswith(".")] == ["k"]


def test_the_least_recently_used_entries_beyond_the_cap_go_unless_in_use(tmp_path: Path) -> None:
    cache = BaseCache(tmp_path / "bases", cap_bytes=250)
    for key in ("old", "mid"):
        with cache.use(key, _filler(100, [])):
            pass
        time.sleep(0.02)
    os.utime(cache.entry("old"), (time.time() - 100, time.time() - 100))
    held = os.open(tmp_path / "bases" / ".old.lock", os.O_RDWR)  # another run reads "old" right now
    fcntl.flock(held, fcntl.LOCK_SH)
    with cache.use("new", _filler(100, [])):
        pass
    assert cache.entry("old").is_dir()  # over the cap (300 > 250), but in use: kept
    os.close(held)
    with cache.use("newer", _filler(100, [])):
        pass
    left = sorted(p.name for p in (tmp_path / "bases").iterdir() if not p.name.startswith("."))
    assert left == ["new", "newer"]  # "old" (least recent) and then "mid" went; the one just filled stays
