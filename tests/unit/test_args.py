"""Unit tests for ``peftckpt train`` flag validation, the CLI's exit code 2, and the pinned CLI help."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from peftckpt.cli import COMMANDS
from peftckpt.train.args import ArgumentError, parse_train_args

MODEL = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--vocab-size", "64",
         "--seq-length", "16"]
BASE = [*MODEL, "--mock-data"]


def _parse(extra: list[str], world_size: int = 1, base: list[str] = BASE):
    return parse_train_args([*base, *extra], world_size)


def _refused(extra: list[str], world_size: int = 1, base: list[str] = BASE) -> str:
    with pytest.raises(ArgumentError) as info:
        _parse(extra, world_size, base)
    return str(info.value)


def test_valid_layout_parses_and_fills_defaults() -> None:
    args = _parse(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--lora-rank", "4"], world_size=8)
    assert args.max_position_embeddings == 16  # default: --seq-length
    assert args.lr_decay_iters == args.train_iters == 20
    assert args.lora_rank == 4


@pytest.mark.parametrize(
    ("extra", "world_size", "expected"),
    [
        pytest.param(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 6,
                     "world size 6 is not divisible by --tensor-model-parallel-size (2) x "
                     "--pipeline-model-parallel-size (2); launch a multiple of 4 processes", id="world-vs-tp-pp"),
        pytest.param(["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2,
                     "--num-layers (3) must be divisible by --pipeline-model-parallel-size (2)", id="layers-vs-pp"),
        pytest.param(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
                     "--num-layers (4) must be divisible by --pipeline-model-parallel-size (2) x "
                     "--num-layers-per-virtual-pipeline-stage (3)", id="layers-vs-pp-vpp"),
        pytest.param(["--num-layers-per-virtual-pipeline-stage", "1"], 1,
                     "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2",
                     id="vpp-without-pp"),
        pytest.param(["--hidden-size", "48", "--num-attention-heads", "6", "--num-query-groups", "2",
                      "--tensor-model-parallel-size", "4"], 4,
                     "--num-attention-heads (6) must be divisible by --tensor-model-parallel-size (4)",
                     id="heads-vs-tp"),
        pytest.param(["--num-query-groups", "1", "--tensor-model-parallel-size", "2"], 2,
                     "--num-query-groups (1) must be divisible by --tensor-model-parallel-size (2)",
                     id="groups-vs-tp"),
        pytest.param(["--ffn-hidden-size", "33", "--tensor-model-parallel-size", "2"], 2,
                     "--ffn-hidden-size (33) must be divisible by --tensor-model-parallel-size (2)", id="ffn-vs-tp"),
        pytest.param(["--hidden-size", "30"], 1,
                     "--hidden-size (30) must be divisible by --num-attention-heads (4)", id="hidden-vs-heads"),
        pytest.param(["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "linear_x"], 1,
                     "--lora-target-modules: unknown target(s) ['linear_x']", id="lora-target"),
        pytest.param(["--lora-rank", "4", "--lora-target-modules", "linear_qkv", "linear_q"], 1,
                     "--lora-target-modules: linear_q is a part of linear_qkv", id="lora-target-part"),
        pytest.param(["--lora-rank", "4", "--no-swiglu", "--lora-target-modules", "linear_fc1_up"], 1,
                     "--lora-target-modules linear_fc1_up need --swiglu", id="lora-gate-up-gelu"),
        pytest.param(["--global-batch-size", "6", "--micro-batch-size", "4"], 1,
                     "--global-batch-size (6) must be divisible by --micro-batch-size (4) x data-parallel size (1)",
                     id="gbs-vs-micro"),
        pytest.param(["--global-batch-size", "6", "--micro-batch-size", "2"], 2,
                     "--global-batch-size (6) must be divisible by --micro-batch-size (2) x data-parallel size (2)",
                     id="gbs-vs-micro-dp"),
        pytest.param(["--pipeline-model-parallel-size", "2", "--global-batch-size", "2", "--micro-batch-size", "2"],
                     2, "needs at least --pipeline-model-parallel-size (2) micro-batches per step; "
                     "--global-batch-size / (--micro-batch-size x data-parallel size) = 1", id="too-few-micro"),
        pytest.param(["--tensor-model-parallel-size", "2", "--vocab-size", "1"], 2,
                     "--vocab-size (1) is too small to split over --tensor-model-parallel-size (2): every rank "
                     "needs rows of the embedding table", id="vocab-too-small-for-tp"),
        pytest.param(["--data-path", "x.jsonl"], 1, "pass exactly one of --mock-data and --data-path",
                     id="both-data"),
        pytest.param(["--max-position-embeddings", "8"], 1,
                     "--seq-length (16) exceeds --max-position-embeddings (8)", id="seq-vs-max-pos"),
    ],
)
def test_refused_with_flag_names(extra: list[str], world_size: int, expected: str) -> None:
    assert expected in _refused(extra, world_size)


def test_neither_data_source_is_refused() -> None:
    assert _refused([], base=MODEL) == "pass exactly one of --mock-data and --data-path"


def test_the_same_flags_pass_once_fixed() -> None:
    """The refusals above are about the named values, not the flags themselves."""
    _parse(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4)
    _parse(["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 2)
    _parse(["--num-query-groups", "2", "--tensor-model-parallel-size", "2", "--ffn-hidden-size", "34"], 2)
    _parse(["--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--micro-batch-size", "2"], 2)
    _parse(["--use-distributed-optimizer"], 2)
    _parse(["--no-untie-embeddings-and-output-weights"], 1)
    _parse(["--max-position-embeddings", "16"], 1)
    _parse(["--data-path", "x.jsonl"], 1, base=MODEL)  # the file is read by the trainer, not here


def _cli(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "peftckpt", *argv], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_cli_bad_flags_exit_2_with_one_error_line_and_write_nothing(tmp_path: Path) -> None:
    metrics = tmp_path / "out" / "metrics.jsonl"
    proc = _cli("train", *BASE, "--pipeline-model-parallel-size", "2", "--metrics-file", str(metrics),
                cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("peftckpt train: error: ")
    assert "--pipeline-model-parallel-size (2)" in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_cli_lists_commands() -> None:
    proc = _cli("--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: peftckpt <command> [options]")
    for command in ("train", "verify"):
        assert f"\n  {command} " in proc.stdout
    proc = _cli("frobnicate")
    assert proc.returncode == 2
    assert "peftckpt: unknown command 'frobnicate'" in proc.stderr


TRAIN_FLAGS = (
    "--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --seq-length --max-position-embeddings "
    "--micro-batch-size --global-batch-size --train-iters --lr --min-lr --lr-decay-style --lr-warmup-iters "
    "--weight-decay --clip-grad --seed --log-interval --mock-data --data-path --tensor-model-parallel-size "
    "--pipeline-model-parallel-size --num-layers-per-virtual-pipeline-stage --use-distributed-optimizer "
    "--metrics-file --eval-interval --eval-iters --lora-rank"
).split()


def test_train_help_pins_megatron_flag_names() -> None:
    proc = _cli("train", "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: peftckpt train")
    # Every option as argparse lists it: "  --flag ..." at the start of a help line.
    listed = {tok.rstrip(",") for line in proc.stdout.splitlines() if line.startswith("  --")
              for tok in line.split() if tok.startswith("--")}
    missing = [f for f in TRAIN_FLAGS if f not in listed]
    assert not missing, f"not in `peftckpt train --help`: {missing}"


def test_hf_peft_target_names_are_aliases() -> None:
    args = _parse(["--swiglu", "--lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj", "o_proj",
                   "gate_proj", "up_proj", "down_proj", "linear_k"])
    assert args.lora_target_modules == ["linear_q", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up",
                                        "linear_fc2", "linear_k"]
    assert "HF PEFT's names ['q_proj'" in _refused(["--lora-rank", "4", "--lora-target-modules", "qkv_proj"])


def test_trainable_only_without_lora_is_said_at_start() -> None:
    note = "--save-trainable-params-only without LoRA (--lora-rank 0): every parameter trains"
    assert any(note in n for n in _parse(["--save-trainable-params-only"]).checkpoint_defaults)
    assert not any(note in n for n in _parse(["--save-trainable-params-only", "--lora-rank", "4"]).checkpoint_defaults)


def _option_blocks(help_text: str) -> dict[str, str]:
    """``--help`` text -> {first option string: its whole entry (the option line and its help lines)}."""
    blocks: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        if line.startswith("  -"):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current is not None and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def test_every_help_answers_without_importing_torch_and_states_every_default() -> None:
    """`--help` parses before importing torch (a few seconds saved on each), for every command; the text
    names every command's flags as before, and every option's entry states its default."""
    code = """
import contextlib, io, json, sys
from peftckpt.cli import COMMANDS, main
texts = {}
for command in COMMANDS:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([command, "--help"])
        except SystemExit as e:
            assert e.code == 0, (command, e.code)
    assert f"peftckpt {command}" in out.getvalue(), command
    texts[command] = out.getvalue()
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))[:5]
print(json.dumps(texts))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    texts = json.loads(done.stdout)
    assert set(texts) == set(COMMANDS)  # every command, the launcher and plot included
    for command, text in texts.items():
        blocks = _option_blocks(text)
        assert "--help" not in blocks and "-h" in blocks, command
        silent = [flag for flag, entry in blocks.items() if flag != "-h" and "default" not in entry]
        assert not silent, f"peftckpt {command} --help states no default for {silent}"
    train = _option_blocks(texts["train"])
    assert "(default: 4)" in train["--num-layers"] and "(default: off)" in train["--bf16"]
    assert "(default: torch_dist)" in train["--ckpt-format"] and "(default: none)" in train["--save"]


def test_a_usage_error_comes_first_with_the_closest_flag(capsys) -> None:  # type: ignore[no-untyped-def]
    """The error line first (not after a page of synopsis), the closest known flag for a typo, and the usage
    only where it is short."""
    from peftckpt.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train", "--mock-data", "--lora-rnak", "4", "--hiden-size=64"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == ("peftckpt train: error: unrecognized arguments: --lora-rnak (did you mean --lora-rank?) 4 "
                   "--hiden-size=64 (did you mean --hidden-size?)\n(`peftckpt train --help` lists every option)\n")
    assert main(["verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peftckpt verify: error: the following arguments are required: DIR\nusage: peftckpt verify")
