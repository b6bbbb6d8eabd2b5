"""Issue 25, "a damaged newest checkpoint is a dead end", as a user meets it: a resume whose newest checkpoint is
damaged stops with one message (once under torchrun, every rank exiting 1, nothing deleted) that names the damage
and the newest intact earlier checkpoint as the ``--load`` to resume from; that command resumes there; ``verify
--all`` checks every committed checkpoint of the save directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .cli import TINY, no_worker_traceback, peftckpt

pytestmark = pytest.mark.slow


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _listing(save: Path) -> dict[str, list[str]]:
    return {d.name: sorted(f.name for f in d.iterdir()) for d in sorted(save.iterdir()) if d.is_dir()}


def test_a_damaged_newest_checkpoint_points_at_the_intact_one_to_resume_from(tmp_path: Path) -> None:
    save = tmp_path / "run"
    peftckpt(["train", *TINY, "--train-iters", "6", "--save-interval", "2", "--save", str(save)])
    damaged = save / "iter_0000006" / "__0_0.distcp"
    _flip(damaged)
    before = _listing(save)

    verify = peftckpt(["verify", "--all", str(save)], check=False)
    assert verify.returncode == 1, verify.stderr
    assert verify.stdout.splitlines()[0].startswith(f"DAMAGED {save / 'iter_0000006'}: {damaged}: xxh3_128 checksum "
                                                    "mismatch")
    assert [line.split()[:2] for line in verify.stdout.splitlines()[1:]] == [
        ["OK", str(save / "iter_0000004")], ["OK", str(save / "iter_0000002")]]
    assert verify.stderr == (f"FAILED {save}: 3 committed checkpoint(s), 2 intact, 1 damaged (iteration 6); the "
                             f"tracker names iteration 6; newest intact: {save / 'iter_0000004'}\n")

    resume = ["train", *TINY, "--train-iters", "8", "--save-interval", "2", "--save", str(save)]
    hint = (f"the newest intact earlier checkpoint in {save} is iteration 4: resume from it explicitly with --load "
            f"{save / 'iter_0000004'} (a load never goes back to an earlier checkpoint by itself)")
    commands = []
    for nproc in (0, 2):
        load = peftckpt([*resume, "--load", str(save)], nproc, check=False)
        assert load.returncode == 1, load.stderr  # a checkpoint error; torchrun reports any failure as 1 too
        assert load.stderr.count("peftckpt train: error: ") == 1, load.stderr  # said once, not once per rank
        assert load.stderr.count(f"checkpoint {save / 'iter_0000006'} is damaged:\n  {damaged}: xxh3_64 checksum "
                                 "mismatch in the bytes of ") == 1, load.stderr
        assert load.stderr.count(hint) == 1, load.stderr
        assert "--no-verify-checksums" not in load.stderr  # not the advice while an intact checkpoint exists
        no_worker_traceback(load.stderr, nproc)
        if nproc:  # every worker left with the same code (the launcher lists those it saw end)
            assert set(re.findall(r"exitcode\s*: (-?\d+)", load.stderr)) == {"1"}, load.stderr
        assert "iteration " not in load.stdout  # no step was trained
        assert _listing(save) == before  # nothing deleted, nothing left behind
        commands.append(re.search(r"resume from it explicitly with --load (\S+)", load.stderr))
    assert all(c is not None and c.group(1) == str(save / "iter_0000004") for c in commands)

    # the printed command resumes from iteration 4; its save of iteration 6 replaces the damaged copy
    hinted = commands[0]
    assert hinted is not None
    rerun = peftckpt([*resume, "--load", hinted.group(1)])
    assert f"resumed from {save / 'iter_0000004'} at iteration 4" in rerun.stdout + rerun.stderr
    verify = peftckpt(["verify", "--all", str(save)])
    assert [line.split()[:2] for line in verify.stdout.splitlines()[:4]] == [
        ["OK", str(save / f"iter_{it:07d}")] for it in (8, 6, 4, 2)]
    assert verify.stdout.splitlines()[4] == (f"{save}: 4 committed checkpoint(s), 4 intact, 0 damaged; the tracker "
                                             "names iteration 8")
