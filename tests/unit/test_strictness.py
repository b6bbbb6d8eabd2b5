"""``--dist-ckpt-strictness``: ``check_keys`` against the table, then end to end through
:class:`~peftckpt.checkpoint.api.Checkpointer` (single process, real DCP files)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from peftckpt.checkpoint.api import Checkpointer, LoadOptions, LoadResult, SaveOptions
from peftckpt.checkpoint.checks.load_checks import optimizer_state_missing
from peftckpt.checkpoint.checks.strictness import STRICTNESS_FLAG, KeyReport, StrictHandling, check_keys
from peftckpt.checkpoint.errors import CheckpointError, StrictnessError
from peftckpt.checkpoint.storage.safe_pickle import load_dcp_metadata

S = StrictHandling

# Megatron-LM's eight modes, one row per mode: (what happens to unexpected keys, what happens to missing keys).
# unexpected: "raise" | "warn" (removed) | "silent" (removed);  missing: "raise" | "warn" | "returned" | "ignored"
TABLE: dict[StrictHandling, tuple[str, str]] = {
    S.ASSUME_OK_UNEXPECTED: ("raise", "ignored"),
    S.LOG_UNEXPECTED: ("warn", "ignored"),
    S.LOG_ALL: ("warn", "warn"),
    S.RAISE_UNEXPECTED: ("raise", "ignored"),
    S.RAISE_ALL: ("raise", "raise"),
    S.RETURN_UNEXPECTED: ("silent", "ignored"),
    S.RETURN_ALL: ("silent", "returned"),
    S.IGNORE_ALL: ("silent", "ignored"),
}

KEPT = "model.layers.0.linear_qkv.weight"
NEW = "model.layers.0.linear_qkv.adapter.lora_A.weight"  # requested, not saved -> unexpected
GONE = "model.layers.0.pre_mlp_layernorm.bias"  # saved, requested by nobody -> missing

CASES = {
    "unexpected": ([KEPT, NEW], [KEPT]),
    "missing": ([KEPT], [KEPT, GONE]),
    "both": ([KEPT, NEW], [KEPT, GONE]),
}


def test_table_covers_every_mode() -> None:
    assert set(TABLE) == set(StrictHandling)
    assert S("assume_ok_unexpected") is S.ASSUME_OK_UNEXPECTED
    assert {m for m in S if m.needs_missing} == {S.LOG_ALL, S.RAISE_ALL, S.RETURN_ALL}


def _call(mode: StrictHandling, requested: list[str], saved: list[str], rank: int = 0,
          requested_by_all: list[str] | None = None, hints: dict[str, str] | None = None,
          ) -> tuple[KeyReport | StrictnessError, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: KeyReport | StrictnessError = check_keys(
                mode, requested, saved, rank=rank,
                requested_by_all=requested if requested_by_all is None else requested_by_all, hints=hints)
        except StrictnessError as e:
            result = e
    return result, [str(w.message) for w in caught]


def _expected(mode: StrictHandling, case: str) -> tuple[str, list[str], list[str]]:
    """("raise-unexpected" | "raise-missing" | "ok", unexpected keys returned, missing keys returned)."""
    requested, saved = CASES[case]
    unexpected = sorted(set(requested) - set(saved))
    missing = sorted(set(saved) - set(requested))
    on_unexpected, on_missing = TABLE[mode]
    if unexpected and on_unexpected == "raise":
        return "raise-unexpected", unexpected, []
    if missing and on_missing == "raise":
        return "raise-missing", unexpected, missing
    return "ok", unexpected, missing if on_missing in ("warn", "returned") else []


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode", list(StrictHandling), ids=lambda m: m.value)
def test_check_keys_follows_the_table(mode: StrictHandling, case: str) -> None:
    requested, saved = CASES[case]
    result, messages = _call(mode, requested, saved)
    outcome, unexpected, missing = _expected(mode, case)
    on_unexpected, on_missing = TABLE[mode]

    if outcome == "raise-unexpected":
        assert isinstance(result, StrictnessError)
        text = str(result)
        assert text.startswith(f"rank 0: 1 key(s) requested but absent from checkpoint:\n  {NEW}\n")
        assert f"pass {STRICTNESS_FLAG} log_unexpected (or ignore_all)" in text
        assert KEPT not in text
        assert messages == []
        return
    if outcome == "raise-missing":
        assert isinstance(result, StrictnessError)
        text = str(result)
        assert text.startswith(f"1 key(s) in checkpoint requested by no rank:\n  {GONE}\n")
        assert f"pass {STRICTNESS_FLAG} log_all (or raise_unexpected) to load without them" in text
        assert messages == []
        return

    assert isinstance(result, KeyReport), result
    assert result.unexpected == unexpected
    assert result.missing == missing
    expected_messages = []
    if unexpected and on_unexpected == "warn":
        expected_messages.append(f"rank 0: skipping 1 key(s) absent from checkpoint:\n  {NEW}")
    if missing and on_missing == "warn":
        expected_messages.append(f"1 key(s) in checkpoint requested by no rank:\n  {GONE}")
    assert messages == expected_messages


@pytest.mark.parametrize("mode", [m for m in StrictHandling if not m.needs_missing], ids=lambda m: m.value)
def test_missing_is_not_computed_without_a_global_view(mode: StrictHandling) -> None:
    """Modes that ignore missing keys need no all-gather: ``requested_by_all=None`` is fine, missing stays []."""
    report = check_keys(mode, [KEPT], [KEPT, GONE, "model.other"], rank=3, requested_by_all=None)
    assert report == KeyReport(unexpected=[], missing=[])


@pytest.mark.parametrize("mode", [S.LOG_ALL, S.RAISE_ALL, S.RETURN_ALL], ids=lambda m: m.value)
def test_missing_modes_refuse_without_the_global_view(mode: StrictHandling) -> None:
    with pytest.raises(ValueError, match=f"^strictness {mode.value} needs the keys requested by all ranks$"):
        check_keys(mode, [KEPT], [KEPT], rank=0, requested_by_all=None)


def test_missing_is_global_unexpected_is_per_rank() -> None:
    # GONE is requested by another rank: not missing. NEW is requested by *this* rank and absent: unexpected,
    # even though another rank's request does not contain it.
    report = check_keys(S.RETURN_ALL, [KEPT, NEW], [KEPT, GONE, "model.z"], rank=1,
                        requested_by_all=[KEPT, GONE])
    assert report == KeyReport(unexpected=[NEW], missing=["model.z"])


def test_log_all_warns_missing_on_rank_zero_only() -> None:
    report, messages = _call(S.LOG_ALL, [KEPT], [KEPT, GONE], rank=1)
    assert isinstance(report, KeyReport)
    assert report.missing == [GONE]
    assert messages == []
    _, messages = _call(S.LOG_ALL, [KEPT, NEW], [KEPT, GONE], rank=2)
    assert messages == [f"rank 2: skipping 1 key(s) absent from checkpoint:\n  {NEW}"]


def test_hints_are_printed_next_to_their_key() -> None:
    hints = {NEW: "trainable now but frozen at save", "model.unused": "never shown"}
    err, _ = _call(S.RAISE_UNEXPECTED, [KEPT, NEW, "model.b"], [KEPT], hints=hints)
    assert isinstance(err, StrictnessError)
    assert f"\n  model.b\n  {NEW}  (trainable now but frozen at save)\n" in str(err)
    assert "never shown" not in str(err)
    _, messages = _call(S.LOG_UNEXPECTED, [KEPT, NEW], [KEPT], hints=hints)
    assert messages == [f"rank 0: skipping 1 key(s) absent from checkpoint:\n  {NEW}  (trainable now but frozen at save)"]
    err, _ = _call(S.RAISE_ALL, [KEPT], [KEPT, GONE], hints={GONE: "dropped on purpose"})
    assert f"\n  {GONE}  (dropped on purpose)\n" in str(err)


def test_long_listings_are_cut_at_twenty_and_sorted() -> None:
    keys = [f"model.k{i:02d}" for i in range(24, -1, -1)]  # 25 keys, reverse order
    err, _ = _call(S.RAISE_UNEXPECTED, keys, [], rank=5)
    assert isinstance(err, StrictnessError)
    lines = str(err).splitlines()
    assert lines[0] == "rank 5: 25 key(s) requested but absent from checkpoint:"
    assert lines[1:21] == [f"  model.k{i:02d}" for i in range(20)]
    assert lines[21] == "  ... and 5 more"


def test_source_is_named() -> None:
    with pytest.raises(StrictnessError, match=r"^rank 0: 1 key\(s\) requested but absent from checkpoint /c/iter_1:"):
        check_keys(S.RAISE_ALL, [NEW], [], rank=0, requested_by_all=[NEW], source="checkpoint /c/iter_1")


def test_raise_all_reports_unexpected_and_missing_at_once() -> None:
    err, _ = _call(S.RAISE_ALL, [KEPT, NEW], [KEPT, GONE])
    assert isinstance(err, StrictnessError)
    assert NEW in str(err) and GONE in str(err)


# ---------------------------------------------------------------------------------------------- end to end

KW = dict(layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, coords={"tp": 0, "pp": 0, "dp": 0},
          model_config={"hidden_size": 8, "num_layers": 1})


class Net(nn.Module):
    def __init__(self, extra: bool = False, norm_bias: bool = True) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)
        self.norm = nn.LayerNorm(3, bias=norm_bias)
        if extra:
            self.extra = nn.Parameter(torch.full((3,), 7.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.fc2(torch.relu(self.fc1(x))))
        return y + self.extra if hasattr(self, "extra") else y


TARGETS = {"unexpected": dict(extra=True), "missing": dict(norm_bias=False),
           "both": dict(extra=True, norm_bias=False)}
UNEXPECTED_PARAM = "extra"
MISSING_PARAM = "norm.bias"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], dict[str, dict]]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for _ in range(2):
        net(torch.randn(5, 4)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    root = tmp_path_factory.mktemp("strict")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Checkpointer([net], opt, **KW).save(root, 2, {"iteration": 2}, SaveOptions())
    params = {n: p.detach().clone() for n, p in net.named_parameters()}
    moments = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in net.named_parameters()}
    return root, params, moments


def _tensor_stats(root: Path) -> list[str]:
    """Names of the per-parameter optimizer tensors the checkpoint stores (e.g. exp_avg, exp_avg_sq)."""
    md = load_dcp_metadata(root / "iter_0000002" / ".metadata").state_dict_metadata
    prefix = "optimizer.state.fc1.weight."
    stats = sorted(k.removeprefix(prefix) for k in md if k.startswith(prefix))
    assert {"exp_avg", "exp_avg_sq"} <= set(stats)
    return stats


def _load(root: Path, target: Net, mode: StrictHandling, **options: object,
          ) -> tuple[LoadResult | CheckpointError, list[str], torch.optim.Optimizer]:
    opt = torch.optim.AdamW(target.parameters(), lr=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result: LoadResult | CheckpointError = Checkpointer([target], opt, **KW).load(
                root, LoadOptions(strictness=mode, **options))  # type: ignore[arg-type]
        except CheckpointError as e:
            result = e
    ours = [str(w.message) for w in caught if "torch.distributed is disabled" not in str(w.message)]
    return result, ours, opt


@pytest.mark.parametrize("case", list(TARGETS))
@pytest.mark.parametrize("mode", list(StrictHandling), ids=lambda m: m.value)
def test_checkpointer_follows_the_table(saved: tuple[Path, dict, dict], mode: StrictHandling, case: str) -> None:
    root, params, moments = saved
    stats = _tensor_stats(root)
    torch.manual_seed(1)
    target = Net(**TARGETS[case])
    before = {n: p.detach().clone() for n, p in target.named_parameters()}
    for n, p in before.items():
        if n in params:
            assert not torch.equal(p, params[n]), n
    has_unexpected, has_missing = "extra" in TARGETS[case], "norm_bias" in TARGETS[case]
    unexpected = sorted([f"model.{UNEXPECTED_PARAM}"] + [f"optimizer.state.{UNEXPECTED_PARAM}.{s}" for s in stats]
                        ) if has_unexpected else []
    missing = sorted([f"model.{MISSING_PARAM}"] + [f"optimizer.state.{MISSING_PARAM}.{s}" for s in stats]
                     ) if has_missing else []

    result, messages, opt = _load(root, target, mode)
    on_unexpected, on_missing = TABLE[mode]

    if (has_unexpected and on_unexpected == "raise") or (has_missing and on_missing == "raise"):
        assert isinstance(result, StrictnessError), result
        text = str(result)
        if has_unexpected:  # unexpected keys are checked (and reported) first
            assert re.search(rf"^rank 0: {len(unexpected)} key\(s\) requested but absent from checkpoint "
                             rf"\S+iter_0000002:\n", text), text
            assert f"  model.{UNEXPECTED_PARAM}\n" in text
            assert f"pass {STRICTNESS_FLAG} log_unexpected (or ignore_all)" in text
        else:
            assert text.startswith(f"{len(missing)} key(s) in checkpoint ")
            assert f"  model.{MISSING_PARAM}\n" in text
            assert f"pass {STRICTNESS_FLAG} log_all (or raise_unexpected)" in text
        for n, p in target.named_parameters():  # a refused load loads nothing
            assert torch.equal(p, before[n]), n
        return

    assert isinstance(result, LoadResult), result
    assert result.iteration == 2
    assert result.report.unexpected == unexpected
    assert result.report.missing == (missing if on_missing in ("warn", "returned") else [])
    for n, p in target.named_parameters():
        if n == UNEXPECTED_PARAM:
            assert torch.equal(p, before[n])  # kept its own value
            continue
        assert torch.equal(p, params[n]), n
        for stat in stats:
            assert torch.equal(opt.state[p][stat], moments[n][stat]), (n, stat)
        assert float(opt.state[p]["step"]) == 2.0
    assert opt.param_groups[0]["lr"] == 0.1  # hyper-parameters come from the checkpoint

    expected_messages = []
    if has_unexpected and on_unexpected == "warn":
        expected_messages.append(f"skipping {len(unexpected)} key(s) absent from checkpoint")
    if has_missing and on_missing == "warn":
        expected_messages.append(f"{len(missing)} key(s) in checkpoint")
    assert len(messages) == len(expected_messages), messages
    for got, want in zip(messages, expected_messages):
        assert want in got
        for key in (unexpected if "skipping" in want else missing):
            assert f"\n  {key}" in got


def test_raise_all_ignores_the_optimizer_when_it_is_not_loaded(saved: tuple[Path, dict, dict]) -> None:
    """With --no-load-optim the optimizer keys are not 'missing': an exact model loads under raise_all."""
    root, params, _ = saved
    torch.manual_seed(1)
    target = Net()
    result, messages, opt = _load(root, target, S.RAISE_ALL, load_optim=False)
    assert isinstance(result, LoadResult), result
    assert result.report == KeyReport(unexpected=[], missing=[])
    assert messages == []
    for n, p in target.named_parameters():
        assert torch.equal(p, params[n]), n
        assert float(torch.as_tensor(opt.state[p].get("step", 0.0))) == 0.0
    assert opt.param_groups[0]["lr"] == 0.5


def test_exact_model_is_silent_under_every_mode(saved: tuple[Path, dict, dict]) -> None:
    root, params, _ = saved
    for mode in StrictHandling:
        torch.manual_seed(1)
        target = Net()
        result, messages, _ = _load(root, target, mode)
        assert isinstance(result, LoadResult), (mode, result)
        assert result.report == KeyReport(unexpected=[], missing=[]), mode
        assert messages == [], mode
        assert torch.equal(target.fc2.weight, params["fc2.weight"])


@pytest.mark.parametrize("mode", list(StrictHandling))
def test_missing_optimizer_state_follows_the_mode(mode: StrictHandling) -> None:
    error = optimizer_state_missing(["optimizer.scalar_state.model.w"], mode, 3, Path("/c/iter_0000002"))
    assert optimizer_state_missing([], mode, 3, Path("/c")) is None
    if mode.removes_unexpected:
        assert error is None
    else:
        assert isinstance(error, StrictnessError) and str(error) == (
            "rank 3: checkpoint /c/iter_0000002 lacks the optimizer state of 1 parameter(s): "
            "optimizer.scalar_state.model.w; pass LoadOptions(load_optim=False) to start a fresh optimizer")
