"""The commit protocol's contract, the same cases against both kinds of location: a directory, and a prefix on a
real S3 server (moto, a separate process). Tracker rule, resolve and its fallbacks, a crash at every fault point of
a save and of a re-save, retention, the run lock, damage named."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

import pytest
import torch

from peftckpt.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointIntegrityError,
    CheckpointNotFoundError,
)
from peftckpt.checkpoint.faults import FAULT_ENV
from peftckpt.checkpoint.location import protocol
from peftckpt.checkpoint.location.base import Location
from peftckpt.checkpoint.location.locate import locate
from peftckpt.checkpoint.location.names import TRACKER_FILENAME, CheckpointFallbackWarning
from peftckpt.checkpoint.options import SaveOptions
from peftckpt.checkpoint.tools.inspect import COMMITTED, CORRUPTED, UNCOMMITTED, inspect_path

from ..s3_server import S3Server, s3_server
from .small_model import small_checkpointer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    with s3_server(tmp_path_factory.mktemp("cache")) as s:
        yield s


KINDS = ["directory", "store"]
POINTS = ["data", "upload", "before_manifest", "before_rename", "before_tracker"]


@pytest.fixture(params=KINDS)
def where(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh save location of each kind, as a user names it."""
    if request.param == "directory":
        return str(tmp_path / "save")
    s3: S3Server = request.getfixturevalue("server")
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    return s3.url(f"contract/{uuid.uuid4().hex[:8]}")


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model[0].weight.add_(1.0)


def _loaded(where: str) -> tuple[int, dict[str, torch.Tensor]]:
    ckpt, model = small_checkpointer(seed=123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointFallbackWarning)
        iteration = ckpt.load(where).iteration
    return iteration, _weights(model)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _leftovers(loc: Location) -> list[str]:
    return [n for n in loc.names() if n.startswith(".") and n != ".peftckpt.lock"]


def test_tracker_rule_and_resolve(where: str) -> None:
    loc = locate(where, "save")
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint|does not exist"):
        protocol.resolve(loc)
    ckpt, model = small_checkpointer()
    ckpt.save(where, 2)
    ckpt.save(where, 1)  # a late save of an older iteration: the tracker keeps naming the newest
    ckpt.close()
    assert protocol.list_committed(loc) == [1, 2] and protocol.read_tracker(loc) == 2
    assert protocol.resolve(loc) == ("iter_0000002", 2)
    assert protocol.resolve(loc.sub("iter_0000001")) == ("", 1)  # a checkpoint itself
    protocol.write_tracker(loc, 1)  # a deliberate rewind is followed
    assert protocol.resolve(loc) == ("iter_0000001", 1)
    protocol.write_tracker(loc, 7)  # not committed: the newest, said
    with pytest.warns(CheckpointFallbackWarning, match="names iteration 7, which is not committed.*iteration 2"):
        assert protocol.resolve(loc) == ("iter_0000002", 2)
    loc.write_atomic(TRACKER_FILENAME, b"seven")
    with pytest.raises(CheckpointFormatError, match="is garbled"):
        protocol.resolve(loc)
    _leave_uncommitted(loc, 5)
    with pytest.raises(CheckpointNotFoundError, match="iter_0000005 is not a committed checkpoint"):
        protocol.resolve(loc.sub("iter_0000005"))


def _leave_uncommitted(loc: Location, iteration: int) -> None:
    """Leave ``iter_N`` holding files but no manifest."""
    target = loc.begin_save(iteration, "crashed")
    (target.local / "__0_0.distcp").write_bytes(b"half")
    loc.upload(target, [target.local / "__0_0.distcp"], 0)
    name = f"iter_{iteration:07d}"
    if target.name != name:  # a directory stages aside: give the leftover the committed name itself
        Path(loc.describe(target.name)).rename(loc.describe(name))


@pytest.mark.parametrize("where, point", [(kind, point) for kind in KINDS for point in POINTS
                                          if kind == "store" or point != "upload"], indirect=["where"])
@pytest.mark.parametrize("resave", [False, True], ids=["fresh", "resave"])
def test_a_failure_at_every_point_keeps_the_last_good_checkpoint(where: str, point: str, resave: bool,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A save (of a new iteration, or re-saving a committed one) failing at each fault point: the location
    still resolves to a complete checkpoint with the weights of the last good save, and the next save leaves
    nothing behind."""
    loc = locate(where, "save")
    on_store = where.startswith("s3://")
    ckpt, model = small_checkpointer()
    ckpt.save(where, 1)
    good = _weights(model)
    _step(model)
    monkeypatch.setenv(FAULT_ENV, f"{point}:eio")
    with pytest.raises(CheckpointError, match="injected I/O error"):
        ckpt.save(where, 1 if resave else 2)
    monkeypatch.delenv(FAULT_ENV)
    iteration, loaded = _loaded(where)
    assert iteration == 1
    # Only a re-save that got past its rename replaced iteration 1 (the tracker already named it).
    assert _same(loaded, _weights(model) if resave and point == "before_tracker" else good)
    # A fresh iteration is committed once renamed -- on a store, once its manifest object is written.
    committed_2 = not resave and (point == "before_tracker" or (on_store and point == "before_rename"))
    assert protocol.list_committed(loc) == ([1, 2] if committed_2 else [1])
    _step(model)
    ckpt.save(where, 3)
    ckpt.close()
    assert _leftovers(loc) == []
    assert protocol.read_tracker(loc) == 3 and protocol.list_committed(loc) == ([1, 2, 3] if committed_2 else [1, 3])
    iteration, loaded = _loaded(where)
    assert iteration == 3 and _same(loaded, _weights(model))


def test_retention_keeps_the_newest_the_tracked_and_the_protected(where: str) -> None:
    loc = locate(where, "save")
    ckpt, model = small_checkpointer()
    for it in (1, 2, 3, 4):
        _step(model)
        ckpt.save(where, it, options=SaveOptions(keep_last_k=3))
    ckpt.close()
    assert protocol.list_committed(loc) == [2, 3, 4]
    protocol.write_tracker(loc, 2)  # a rewind: the tracker's checkpoint survives
    assert protocol.apply_retention(loc, 1, protect=[3]) == []  # 2 tracked, 3 protected, 4 newest
    assert protocol.apply_retention(loc, 1) == [3]
    assert protocol.list_committed(loc) == [2, 4] and _leftovers(loc) == []
    with pytest.raises(ValueError, match="keep_last_k must be >= 1"):
        protocol.apply_retention(loc, 0)


def test_one_run_per_location(where: str) -> None:
    """A location locked by this process is refused to another one, naming this process; within the process the
    lock is shared; released, it is free again."""
    loc = locate(where, "--save")
    held = loc.lock()
    again = loc.lock()  # the same process: shared, not refused
    probe = ("import sys\nfrom peftckpt.checkpoint.location.locate import locate\n"
             "from peftckpt.checkpoint.location.dir_lock import SaveDirInUseError\n"
             "try:\n    locate(sys.argv[1], '--save').lock().release()\nexcept SaveDirInUseError as e:\n"
             "    print(e); sys.exit(3)\n")
    refused = subprocess.run([sys.executable, "-c", probe, where], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 3 and "in use by another run" in refused.stdout, refused.stderr
    again.release()
    held.release()
    free = subprocess.run([sys.executable, "-c", probe, where], capture_output=True, text=True, timeout=120)
    assert free.returncode == 0, free.stdout + free.stderr


def test_damage_is_named_by_its_path_or_url(where: str, server: S3Server) -> None:
    loc = locate(where, "save")
    ckpt, _ = small_checkpointer()
    ckpt.save(where, 1)
    ckpt.close()
    name = "iter_0000001/__0_0.distcp"
    size = loc.read_manifest("iter_0000001").files["__0_0.distcp"]["size"]
    if where.startswith("s3://"):
        server.flip_byte(f"{where.split('/', 3)[3]}/{name}", offset=size // 2)
    else:
        path = Path(loc.describe(name))
        data = bytearray(path.read_bytes())
        data[size // 2] ^= 0x01
        path.write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=re.escape(loc.describe(name))):
        small_checkpointer(seed=5)[0].load(where)


def test_inspect_lists_a_save_location_of_either_kind(where: str) -> None:
    """``inspect`` of a save location: every entry with its cheap state, the tracker's checkpoint selected and
    fully checked -- the same report for a directory and for a store."""
    loc = locate(where, "save")
    ckpt, _ = small_checkpointer()
    ckpt.save(where, 1)
    ckpt.save(where, 2)
    ckpt.close()
    _leave_uncommitted(loc, 5)
    loc.write_atomic("iter_0000001/stray.bin", b"x")  # an unlisted file inside iteration 1: that entry is damaged
    report = inspect_path(where)
    assert report.kind == "save_dir" and report.state == COMMITTED and report.save_dir is not None
    states = {e.name: (e.state, e.selected) for e in report.save_dir.entries}
    assert states == {"iter_0000001": (CORRUPTED, False), "iter_0000002": (COMMITTED, True),
                      "iter_0000005": (UNCOMMITTED, False)}
    assert report.save_dir.tracker == 2 and str(report.save_dir.selected) == loc.describe("iter_0000002")
    assert report.checkpoint is not None and report.checkpoint.checksums_verified
    assert str(report.checkpoint.path) == loc.describe("iter_0000002")
    entry = next(e for e in report.save_dir.entries if e.name == "iter_0000001")
    assert f"{loc.describe('iter_0000001/stray.bin')}: unexpected" in (entry.reason or "")


def test_two_names_for_one_iteration_are_refused_and_nothing_is_deleted(where: str) -> None:
    loc = locate(where, "save")
    ckpt, _ = small_checkpointer()
    ckpt.save(where, 1)
    ckpt.save(where, 2)
    twin = "iter_00000002"  # parses to 2 as well
    if not where.startswith("s3://"):
        Path(loc.describe(twin)).mkdir()
    loc.write_atomic(f"{twin}/metadata.json", loc.read_small("iter_0000002/metadata.json", 1 << 20))
    _leave_uncommitted(loc, 7)
    before = loc.names()
    said = "iter_00000002 and iter_0000002 both name iteration 2"
    for act in (lambda: protocol.list_committed(loc), lambda: protocol.clean(loc),
                lambda: protocol.apply_retention(loc, 1), lambda: ckpt.save(where, 3)):
        with pytest.raises(CheckpointError, match=said):
            act()
    # a load of the checkpoint the tracker names, by the name a save writes, is no guess (and lists nothing)
    assert protocol.resolve(loc) == ("iter_0000002", 2)
    loc.write_atomic("latest_checkpointed_iteration.txt", b"7")
    with pytest.raises(CheckpointError, match=said):  # a tracker naming no committed checkpoint: the listing decides
        protocol.resolve(loc)
    ckpt.close()
    assert [n for n in loc.names() if n != ".peftckpt.lock"] == [n for n in before if n != ".peftckpt.lock"]


def test_two_checkpointers_of_one_process_keep_each_others_saves(where: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The run lock is shared within a process, so a second checkpointer saving into the same location must not
    clean away the first one's save in flight: its written files (in the directory's staging, or in a store's
    node-local spool before the upload)."""
    from peftckpt.checkpoint import save as save_module

    written, go_on = threading.Event(), threading.Event()
    hand_over = save_module.hand_over_files

    def held(*args: object) -> object:  # the first save's thread: its files written, not yet handed over
        written.set()
        assert go_on.wait(60)
        return hand_over(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(save_module, "hand_over_files", held)
    first, _ = small_checkpointer()
    second, _ = small_checkpointer(seed=1)
    handle = first.async_save(where, 1)
    assert written.wait(60)
    monkeypatch.setattr(save_module, "hand_over_files", hand_over)
    second.save(where, 2)  # its clean (and on a store its spool's cleanup) runs while the first is in flight
    go_on.set()
    assert str(handle.result()).endswith("iter_0000001")
    first.close()
    second.close()
    assert protocol.list_committed(locate(where, "save")) == [1, 2]


@pytest.mark.parametrize("where", ["store"], indirect=True)
def test_a_lease_taken_over_is_found_on_the_store_before_anything_is_cleaned(where: str) -> None:
    """A run whose lease another run took while it was stopped (its renewal thread never ran) finds out from the
    store itself before its next save cleans or commits anything."""
    loc = locate(where, "save")
    ckpt, _ = small_checkpointer()
    ckpt.save(where, 1)  # takes the lease
    _leave_uncommitted(loc, 5)  # what another run may be uploading
    loc.write_atomic(".peftckpt.lock", b'{"holder": "host other, pid 1", "sequence": 0}\n')  # taken over
    with pytest.raises(CheckpointError, match="taken over by another run"):
        ckpt.save(where, 2)
    assert "iter_0000005" in loc.names() and protocol.list_committed(loc) == [1]
    ckpt.close()


def _follow(call: Callable[[], object], where: str) -> tuple[Counter[str], list[str]]:
    """Follow the save location through ``call()`` as a reader would: every call into ``peftckpt.checkpoint``
    that is handed the location -- a ``Location``, a ``SaveTarget`` or ``PendingCommit`` (which hold one), the path
    or URL itself or one inside it; ``self`` included, property reads excluded. Returns how often each module is
    entered (a function's calls into another module count once) and the calls that entered a module already on
    the stack above them (the path coming back up)."""
    from peftckpt.checkpoint.commit import PendingCommit
    from peftckpt.checkpoint.location.base import SaveTarget

    package = str(Path(protocol.__file__).parents[1]) + os.sep
    prefix = where.rstrip("/") + "/"

    def carries(value: object) -> bool:
        if isinstance(value, (Location, SaveTarget, PendingCommit)):
            return True
        text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
        return isinstance(text, str) and (text == where or text.startswith(prefix))

    stack: list[tuple[FrameType, str | None]] = []
    entries: Counter[str] = Counter()
    entered: set[tuple[int, str]] = set()
    back_up: list[str] = []

    def profile(frame: FrameType, event: str, _arg: object) -> None:
        if event == "return" and stack and stack[-1][0] is frame:
            stack.pop()
        if event != "call":
            return
        code, module = frame.f_code, None
        if code.co_filename.startswith(package):
            me = frame.f_locals.get("self")
            read = me is not None and isinstance(getattr(type(me), code.co_name, None), property)
            handed = list(frame.f_locals.values())[:code.co_argcount + code.co_kwonlyargcount]
            if not read and any(carries(v) for v in handed):
                module = os.path.relpath(code.co_filename, package)
        if module is not None:
            above = [m for _, m in stack if m is not None]
            caller = next((f for f, m in reversed(stack) if m is not None), None)
            if not above or above[-1] != module:
                if (id(caller), module) not in entered:
                    entered.add((id(caller), module))
                    entries[module] += 1
                if module in above:
                    back_up.append(" > ".join(above) + f" -> {module}:{code.co_name}")
        stack.append((frame, module))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entries, back_up


def test_a_save_and_a_load_read_top_down(where: str) -> None:
    """Following the location through ``Checkpointer.save`` and ``Checkpointer.load``: no module is entered again
    from below (the orchestration calls the protocol, the protocol the location, never back), and the modules that
    orchestrate -- api, save, commit, load, load_objects -- are each entered once."""
    ckpt, _ = small_checkpointer(seed=0)
    ckpt.save(where, 1)  # the location exists and holds a committed checkpoint; the traced save re-plans nothing new
    saved, save_back_up = _follow(lambda: ckpt.save(where, 2), where)
    target, _ = small_checkpointer(seed=1)
    loaded, load_back_up = _follow(lambda: target.load(where), where)
    assert save_back_up == [] and load_back_up == []
    assert {m: saved[m] for m in ("api.py", "save.py", "commit.py")} == {"api.py": 1, "save.py": 1, "commit.py": 1}
    assert {m: loaded[m] for m in ("api.py", "load.py")} == {"api.py": 1, "load.py": 1}
    assert loaded["load_objects.py"] <= 1
    assert saved["location/protocol.py"] >= 1 and loaded["location/protocol.py"] >= 1  # the tracer sees the protocol
