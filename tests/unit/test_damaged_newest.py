"""Issue 25, "a damaged newest checkpoint is a dead end": a load that finds the checkpoint it resolved damaged
says what is wrong with it and names the newest intact earlier checkpoint of the same save location (verified,
newest first, a few at most) and how to load it -- never falling back by itself; ``verify --all`` checks every
committed checkpoint of a save location."""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from peftckpt.checkpoint import load_damage as load_module
from peftckpt.checkpoint.api import LoadOptions
from peftckpt.checkpoint.errors import CheckpointError, CheckpointIntegrityError, CheckpointMismatchError
from peftckpt.checkpoint.tools.verify import newest_intact_before, verify_all
from peftckpt.cli.verify import verify_main
from peftckpt.train.flag_words import in_flag_terms

from .small_model import small_checkpointer

ITERATIONS = (2, 4, 6)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("pristine") / "run"
    ckpt, _ = small_checkpointer()
    for it in ITERATIONS:
        ckpt.save(save, it, {"iteration": it})
    return save


@pytest.fixture
def save(pristine: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(pristine, copy)
    return copy


def _flip(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x01
    p.write_bytes(bytes(data))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _edit(p: Path) -> None:
    manifest = json.loads(p.read_text())
    manifest["iteration"] += 1  # still a valid manifest, but not the one its self-checksum covers
    p.write_text(json.dumps(manifest))


def _garble(p: Path) -> None:
    p.write_bytes(p.read_bytes()[:-2])


def _ckpt(save: Path, it: int) -> Path:
    return save / f"iter_{it:07d}"


def _load_error(path: str | Path, options: LoadOptions | None = None) -> str:
    target, _ = small_checkpointer(seed=1)
    with pytest.raises(CheckpointError) as info:
        target.load(path, options or LoadOptions(objects=["iteration"]))
    assert getattr(info.value, "every_rank", False)  # agreed: a launcher says it once
    return str(info.value)


def _loads(path: str | Path) -> int:
    target, _ = small_checkpointer(seed=1)
    return int(target.load(path, LoadOptions(objects=["iteration"])).objects["iteration"])


DAMAGE: dict[str, tuple[str, Callable[[Path], None], str]] = {
    # damage: (file, how, what the message says of it)
    "bit-flipped data": ("__0_0.distcp", _flip, "__0_0.distcp: xxh3_64 checksum mismatch"),
    "truncated data": ("__0_0.distcp", _truncate, "__0_0.distcp: size mismatch (truncated)"),
    "deleted .metadata": (".metadata", Path.unlink, ".metadata: missing"),
    "edited manifest": ("metadata.json", _edit, "metadata.json is damaged: its content does not match"),
    "garbled manifest": ("metadata.json", _garble, "metadata.json is not valid JSON"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_names_the_newest_intact_earlier_one(save: Path, damage: str) -> None:
    name, how, said = DAMAGE[damage]
    how(_ckpt(save, 6) / name)
    message = _load_error(save)
    assert message.startswith(f"manifest {_ckpt(save, 6) / name}" if name == "metadata.json"
                              else f"checkpoint {_ckpt(save, 6)} is damaged:\n  {_ckpt(save, 6) / name}")
    assert said in message
    hint = (f"the newest intact earlier checkpoint in {save} is iteration 4: resume from it explicitly with "
            f"Checkpointer.load('{_ckpt(save, 4)}') (a load never goes back to an earlier checkpoint by itself)")
    assert message.endswith("\n" + hint), message
    assert "verify_checksums" not in message  # skipping the check that caught it is no advice when 4 is intact
    assert in_flag_terms(message).endswith(f"resume from it explicitly with --load {_ckpt(save, 4)} (a load never "
                                           "goes back to an earlier checkpoint by itself)")
    # the hint is right: that checkpoint loads, and nothing was deleted or moved
    assert _loads(_ckpt(save, 4)) == 4
    assert sorted(p.name for p in save.iterdir() if p.name != ".peftckpt.lock") == [
        "iter_0000002", "iter_0000004", "iter_0000006", "latest_checkpointed_iteration.txt"]


def test_the_search_goes_back_past_damaged_ones_and_says_when_none_is_intact(save: Path) -> None:
    _flip(_ckpt(save, 6) / "__0_0.distcp")
    _flip(_ckpt(save, 4) / "__0_0.distcp")
    message = _load_error(save)
    assert message.startswith(f"checkpoint {_ckpt(save, 6)} is damaged:\n")
    assert (f"the newest intact earlier checkpoint in {save} is iteration 2 (iteration 4 is damaged too): resume "
            f"from it explicitly with Checkpointer.load('{_ckpt(save, 2)}')") in message
    assert _loads(_ckpt(save, 2)) == 2
    # a checkpoint named explicitly: the search is in its save location, before it
    message = _load_error(_ckpt(save, 4))
    assert message.startswith(f"checkpoint {_ckpt(save, 4)} is damaged:\n")
    assert f"is iteration 2: resume from it explicitly with Checkpointer.load('{_ckpt(save, 2)}')" in message

    (_ckpt(save, 2) / ".metadata").unlink()
    message = _load_error(save)
    assert message.startswith(f"checkpoint {_ckpt(save, 6)} is damaged:\n")
    assert f"\nno intact earlier checkpoint in {save} (iterations 4, 2 are damaged too)\n" in message
    assert message.endswith("\nas a last resort, LoadOptions(verify_checksums=False) loads it without its "
                            "checksums, damaged bytes and all")
    assert in_flag_terms(message).endswith("\nas a last resort, --no-verify-checksums loads it without its checksums, "
                                           "damaged bytes and all")
    # the oldest has nothing before it
    message = _load_error(_ckpt(save, 2))
    assert f"\nno intact earlier checkpoint in {save} (none is committed before it)" in message
    assert "verify_checksums" not in message  # a missing file: skipping checksums would not help


def test_the_search_is_bounded(save: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_module, "newest_intact_before", functools.partial(newest_intact_before, limit=1))
    _flip(_ckpt(save, 6) / "__0_0.distcp")
    _flip(_ckpt(save, 4) / "__0_0.distcp")
    message = _load_error(save)
    assert (f"\nno intact earlier checkpoint among the 1 newest in {save} (iteration 4 is damaged too); "
            f"`peftckpt verify --all {save}` checks the 1 older one(s)\n") in message


def test_only_damage_gets_the_hint(save: Path) -> None:
    """A checkpoint that does not fit the model is not damaged: no earlier checkpoint would fit better."""
    target, _ = small_checkpointer(seed=1)
    target.parts.model_config = {"width": 65}
    with pytest.raises(CheckpointMismatchError) as info:
        target.load(save)
    assert "intact" not in str(info.value)


def test_verify_all(save: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert verify_main(["--all", str(save)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[:3]] == [["OK", str(_ckpt(save, it))] for it in (6, 4, 2)]
    assert out[3] == f"{save}: 3 committed checkpoint(s), 3 intact, 0 damaged; the tracker names iteration 6"

    _flip(_ckpt(save, 4) / "__0_0.distcp")
    assert verify_main(["--all", str(save)]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith(f"OK      {_ckpt(save, 6)} (iteration 6,")
    assert lines[1].startswith(f"DAMAGED {_ckpt(save, 4)}: {_ckpt(save, 4) / '__0_0.distcp'}: xxh3_128 checksum "
                               "mismatch: expected ")
    assert lines[2].startswith(f"OK      {_ckpt(save, 2)} (iteration 2,")
    assert captured.err == (f"FAILED {save}: 3 committed checkpoint(s), 2 intact, 1 damaged (iteration 4); the "
                            f"tracker names iteration 6; newest intact: {_ckpt(save, 6)}\n")

    assert verify_main(["--all", str(save), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert (report["ok"], report["tracker"], report["newest_intact"]) == (False, 6, str(_ckpt(save, 6)))
    assert [(c["iteration"], c["ok"]) for c in report["checkpoints"]] == [(6, True), (4, False), (2, True)]
    assert set(report["checkpoints"][0]) == {"path", "iteration", "ok", "problems", "num_files", "total_bytes"}
    # an unreadable manifest is that checkpoint's line, not the end of the check
    _flip(_ckpt(save, 2) / "metadata.json")
    assert [r.ok for r in verify_all(save).checkpoints] == [True, False, False]
    # plain verify of the save directory checks the tracker's checkpoint and points at --all when it fails
    _flip(_ckpt(save, 6) / "__0_0.distcp")
    assert verify_main([str(save)]) == 1
    assert f"`peftckpt verify --all {save}` checks the earlier ones" in capsys.readouterr().err
    # usage: a checkpoint is not a save directory; nothing committed is a failure
    assert verify_main(["--all", str(_ckpt(save, 4))]) == 2
    assert f"DIR {_ckpt(save, 4)} is a checkpoint, not a save directory; --all takes the save directory ({save})" \
        in capsys.readouterr().err
    (save.parent / "empty").mkdir()
    assert verify_main(["--all", str(save.parent / "empty")]) == 1
    assert "no committed checkpoint in" in capsys.readouterr().err


def test_an_intact_newest_checkpoint_loads_as_before(save: Path) -> None:
    """The search runs only on damage: a load of an intact checkpoint does not verify earlier ones."""
    _flip(_ckpt(save, 4) / "__0_0.distcp")
    assert _loads(save) == 6


def test_a_damaged_base_gets_no_earlier_checkpoint(save: Path) -> None:
    """load_pretrained: an earlier base is another base (another fingerprint), so only the last resort is said."""
    _flip(_ckpt(save, 6) / "__0_0.distcp")
    target, _ = small_checkpointer(seed=1)
    with pytest.raises(CheckpointIntegrityError) as info:
        target.load_pretrained(save, LoadOptions(verify_while_reading=False))
    assert "intact earlier" not in str(info.value)
    assert str(info.value).endswith("\nLoadOptions(verify_checksums=False) loads it without its checksums, damaged "
                                    "bytes and all")


def test_on_an_object_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """The same through the Location abstraction on S3 (moto's server): the load names the earlier checkpoint by
    URL (no last resort: a store's objects are always verified as they are fetched or read), ``verify --all`` checks every
    one, and the copies it fetched to verify are deleted as it goes."""
    from ..s3_server import s3_server

    with s3_server(tmp_path / "cache") as s3:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        url = s3.url("damaged-newest")
        ckpt, _ = small_checkpointer()
        for it in ITERATIONS:
            ckpt.save(url, it, {"iteration": it})
        ckpt.close()
        assert verify_main(["--all", url]) == 0
        assert capsys.readouterr().out.splitlines()[-1] == (f"{url}: 3 committed checkpoint(s), 3 intact, 0 damaged; "
                                                            "the tracker names iteration 6")
        s3.flip_byte("damaged-newest/iter_0000006/__0_0.distcp")
        message = _load_error(url)
        # read in place: the flipped byte (in the block index at the object's end) is found by the ranged read
        assert message.startswith(f"checkpoint {url}/iter_0000006 is damaged:\n  {url}/iter_0000006/__0_0.distcp: "
                                  "xxh3_64 checksum mismatch of its block index")
        assert message.endswith(f"\nthe newest intact earlier checkpoint in {url} is iteration 4: resume from it "
                                f"explicitly with Checkpointer.load('{url}/iter_0000004') (a load never goes back to an "
                                "earlier checkpoint by itself)")
        assert _loads(f"{url}/iter_0000004") == 4
        s3.flip_byte("damaged-newest/iter_0000004/__0_0.distcp")
        s3.flip_byte("damaged-newest/iter_0000002/__0_0.distcp")
        message = _load_error(url)
        assert message.endswith(f"\nno intact earlier checkpoint in {url} (iterations 4, 2 are damaged too)")
        assert verify_main(["--all", url]) == 1
        out = capsys.readouterr().out.splitlines()
        assert [line.split()[:2] for line in out] == [["DAMAGED", f"{url}/iter_{it:07d}:"] for it in (6, 4, 2)]
        assert not list((tmp_path / "cache").rglob("*.distcp"))  # every fetched copy deleted
