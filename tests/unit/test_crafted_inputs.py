"""Issue 25: crafted or odd inputs stay bounded, and each is one message naming the file and the value.

* An HF ``config.json`` or a checkpoint manifest (re-digested with the library's own function, as anyone can)
  that claims a bigger architecture than its files hold is refused before any model or buffer is sized by it:
  the value, the tensor and the file are named, and the CLI's peak memory stays at its import baseline.
* A manifest's unknown ``checksum_algorithm`` names the manifest, the algorithm and the supported ones.
* A PEFT ``adapter_config.json`` with a NaN, infinite or non-positive ``r`` / ``lora_alpha`` names the file and
  the key; a damaged ``adapter_model.safetensors`` is the very message import-hf gives for the same bytes.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from peftckpt.checkpoint.errors import CheckpointError, CheckpointFormatError
from peftckpt.checkpoint.location.directory import resolve_checkpoint_dir
from peftckpt.checkpoint.storage.checksums import new_digest
from peftckpt.checkpoint.storage.manifest import CHECKSUM_ALGORITHMS, read_manifest
from peftckpt.cli import main
from peftckpt.interop.architecture import ArchitectureMismatchError, checked_manifest
from peftckpt.interop.commands import export_hf, import_hf, import_peft
from peftckpt.interop.hf_dir import HFModelDir
from peftckpt.interop.hf_llama import InteropError
from peftckpt.interop.peft import read_peft_dir
from peftckpt.interop.safetensors_io import write_safetensors
from peftckpt.train.args import parse_train_args
from tests.integration.cli import env

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

HIDDEN, VOCAB, LAYERS, FFN, KV_ROWS, RANK = 64, 96, 4, 96, 32, 4  # the tiny Llama of tests/interop/common.py


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("crafted")


@pytest.fixture(scope="module")
def hf_dir(root: Path) -> Path:
    """A tiny random HF ``LlamaForCausalLM`` saved by transformers itself (built from a config, not downloaded)."""
    pytest.importorskip("transformers", reason="the [hf] extra builds the HF directory")
    from tests.interop.common import make_llama

    make_llama(root / "hf")
    return root / "hf"


@pytest.fixture(scope="module")
def base(root: Path, hf_dir: Path) -> Path:
    """``import-hf`` of it: a full base checkpoint (iteration 0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_hf(hf_dir, root / "base")
    return root / "base"


def _peft_dir(path: Path, config: dict[str, Any] | None = None) -> Path:
    """A PEFT LoRA adapter (q_proj and v_proj of every layer) as PEFT lays it out, written by hand."""
    g = torch.Generator().manual_seed(5)
    tensors = {}
    for n in range(LAYERS):
        for proj, rows in (("q_proj", HIDDEN), ("v_proj", KV_ROWS)):
            module = f"base_model.model.model.layers.{n}.self_attn.{proj}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g)
            tensors[f"{module}.lora_B.weight"] = torch.randn(rows, RANK, generator=g)
    path.mkdir(parents=True)
    write_safetensors(path / "adapter_model.safetensors", {k: (t.dtype, t.shape) for k, t in tensors.items()},
                      iter(tensors.items()))
    cfg = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
           "target_modules": ["q_proj", "v_proj"], **(config or {})}
    (path / "adapter_config.json").write_text(json.dumps(cfg))  # NaN and Infinity as json writes them
    return path


@pytest.fixture(scope="module")
def adapter(root: Path, base: Path) -> Path:
    """``import-peft`` of :func:`_peft_dir`: an adapter-only checkpoint on ``base``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_peft(_peft_dir(root / "peft"), root / "adapter", base)
    return root / "adapter"


def _hf_variant(hf_dir: Path, dest: Path, **changes: Any) -> Path:
    shutil.copytree(hf_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    config.pop("head_dim", None)  # follows hidden_size / num_attention_heads
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _re_signed(save: Path, dest: Path, model: dict[str, Any] | None = None, adapter: dict[str, Any] | None = None,
               **fields: Any) -> Path:
    """A copy of checkpoint ``save`` whose manifest an attacker rewrote and re-digested (``Manifest.to_json``
    computes the digest the reader checks: it guards against damage, not tampering)."""
    shutil.copytree(save, dest)
    ckpt = resolve_checkpoint_dir(dest)[0]
    manifest = read_manifest(ckpt)
    manifest.model_config.update(model or {})
    if adapter:
        assert manifest.adapter_config is not None
        manifest.adapter_config.update(adapter)
    for name, value in fields.items():
        setattr(manifest, name, value)
    (ckpt / "metadata.json").write_bytes(manifest.to_json())
    return dest


# ----------------------------------------------------------------------- (a) HF config vs safetensors
@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_size": 8192}, "says hidden_size 8192 but model.embed_tokens.weight is [96, 64] in model.safetensors"),
    ({"vocab_size": 32000}, "says vocab_size 32000 but model.embed_tokens.weight is [96, 64] in model.safetensors"),
    ({"num_hidden_layers": 80}, "says num_hidden_layers 80 but the safetensors files in {dir} hold layers 0-3 (model.layers.N.*)"),
    ({"intermediate_size": 28672},
     "says intermediate_size 28672 but model.layers.0.mlp.down_proj.weight is [64, 96] in model.safetensors"),
    ({"num_key_value_heads": 4},
     "says num_key_value_heads 4 but model.layers.0.self_attn.k_proj.weight is [32, 64] (num_key_value_heads x "
     "hidden_size / num_attention_heads = 4 x 16 = 64 rows expected) in model.safetensors"),
], ids=["hidden", "vocab", "layers", "ffn", "kv-heads"])
def test_an_hf_config_claiming_more_than_its_files_names_the_value(hf_dir: Path, tmp_path: Path,
                                                                  changes: dict[str, Any], message: str) -> None:
    src = _hf_variant(hf_dir, tmp_path / "hf", **changes)
    expected = f"{src / 'config.json'} " + message.format(dir=src)
    with pytest.raises(InteropError) as caught:
        HFModelDir(src)
    assert str(caught.value) == expected
    with pytest.raises(InteropError, match=f"^{_escaped(expected)}$"):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_config_claiming_millions_of_layers_is_refused_in_bounded_memory(hf_dir: Path, tmp_path: Path) -> None:
    """The layer count is held to the layers the headers name before anything is enumerated per layer (the
    expected tensor names of 10^8 layers grew the process by gigabytes, for minutes)."""
    src = _hf_variant(hf_dir, tmp_path / "hf", num_hidden_layers=10**8)
    tracemalloc.start()
    try:
        with pytest.raises(InteropError, match="says num_hidden_layers 100000000 but the safetensors files"):
            HFModelDir(src)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


# -------------------------------------------------------------------- (a) manifest vs DCP .metadata
@pytest.mark.parametrize(("model", "message"), [
    ({"hidden_size": 65536}, "says hidden_size 65536 but model.embedding.word_embeddings.weight is [96, 64]"),
    ({"vocab_size": 128000, "hidden_size": 8192},
     "says vocab_size 128000 but model.embedding.word_embeddings.weight is [96, 64]"),
    ({"num_layers": 80}, "says num_layers 80 but the checkpoint holds layers 0-3 (model.decoder.layers.N.* in "),
    ({"ffn_hidden_size": 229376}, "says ffn_hidden_size 229376 but model.decoder.layers.0.mlp.linear_fc1.weight is "
                                  "[192, 64]"),
    ({"num_query_groups": 4}, "says num_attention_heads 4 and num_query_groups 4 but "
                              "model.decoder.layers.0.self_attention.linear_qkv.weight is [128, 64]"),
    ({"untie_embeddings_and_output_weights": False},
     ": its model_config and adapter_config describe no tensor model.output_layer.weight, which the checkpoint "
     "stores"),
], ids=["hidden", "vocab", "layers", "ffn", "groups", "tied"])
def test_a_re_signed_manifest_claiming_another_model_is_refused_before_anything_is_built(
        base: Path, tmp_path: Path, model: dict[str, Any], message: str) -> None:
    crafted = _re_signed(base, tmp_path / "crafted", model=model)
    ckpt = resolve_checkpoint_dir(crafted)[0]
    assert read_manifest(ckpt).model_config["num_layers"] == model.get("num_layers", LAYERS)  # the digest passes
    prefix = f"manifest {ckpt / 'metadata.json'}" + ("" if message.startswith(":") else " ")
    with pytest.raises(ArchitectureMismatchError) as caught:
        checked_manifest(crafted)
    text = str(caught.value)
    assert text.startswith(prefix + message) and text.endswith("; nothing was built from it"), text
    if "holds" not in message and "describe" not in message:
        assert f" in {ckpt / '.metadata'}" in text
    # The trainer takes its architecture from it while parsing its flags: refused there, nothing built.
    for flag in ("--pretrained-checkpoint", "--load"):
        with pytest.raises(CheckpointError) as parsed:
            parse_train_args([flag, str(crafted), "--mock-data", "--device", "cpu"], 1)
        assert str(parsed.value) == text
    with pytest.raises(CheckpointError, match=_escaped(prefix + message)):
        export_hf(crafted, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_honest_checkpoints_pass(base: Path, adapter: Path) -> None:
    assert checked_manifest(base).model_config["hidden_size"] == HIDDEN
    assert checked_manifest(adapter).adapter_config is not None
    args = parse_train_args(["--pretrained-checkpoint", str(base), "--load", str(adapter), "--mock-data"], 1)
    assert (args.hidden_size, args.num_layers, args.lora_rank) == (HIDDEN, LAYERS, RANK)


def test_an_adapter_manifest_claiming_another_rank_or_base_is_refused(adapter: Path, tmp_path: Path) -> None:
    ckpt = resolve_checkpoint_dir(adapter)[0]
    crafted = _re_signed(adapter, tmp_path / "rank", adapter={"rank": 4096})
    with pytest.raises(ArchitectureMismatchError, match=_escaped(
            f"manifest {tmp_path / 'rank' / ckpt.name / 'metadata.json'} says adapter_config rank 4096 but "
            "model.decoder.layers.0.self_attention.linear_qkv.lora_A_q is [4, 64]")):
        checked_manifest(crafted)
    # A trainable-only checkpoint stores no base: its layer count is held to the layers it names at all.
    crafted = _re_signed(adapter, tmp_path / "layers", model={"num_layers": 80})
    with pytest.raises(ArchitectureMismatchError, match=r"says num_layers 80 but the checkpoint holds layers 0-3 "
                                                        r"\(stored or recorded as left out\)"):
        parse_train_args(["--load", str(crafted), "--mock-data"], 1)


# ------------------------------------------------------------------------ (b) checksum algorithm
@pytest.mark.parametrize("algorithm", ["crc99", "shake_128"])
def test_an_unknown_checksum_algorithm_is_one_message(base: Path, tmp_path: Path, algorithm: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    crafted = _re_signed(base, tmp_path / "crafted", checksum_algorithm=algorithm)
    manifest = resolve_checkpoint_dir(crafted)[0] / "metadata.json"
    expected = (f"manifest {manifest} is malformed: unknown checksum_algorithm '{algorithm}', which this peftckpt "
                f"cannot verify (supported: {', '.join(CHECKSUM_ALGORITHMS)})")
    with pytest.raises(CheckpointFormatError) as caught:
        read_manifest(manifest.parent)
    assert str(caught.value) == expected
    assert "xxh3_128" in CHECKSUM_ALGORITHMS and "sha256" in CHECKSUM_ALGORITHMS  # what checkpoints record
    with pytest.raises(CheckpointFormatError, match=f"unknown checksum algorithm '{algorithm}'"):
        new_digest(algorithm)  # SHAKE's hexdigest() wants a length: it was a TypeError traceback
    capsys.readouterr()
    assert main(["export-hf", str(crafted), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err == f"peftckpt export-hf: error: {expected}\n"


# -------------------------------------------------------------------------- (c) PEFT config numbers
@pytest.mark.parametrize(("key", "value", "rule"), [
    ("lora_alpha", math.nan, "a positive finite number"), ("lora_alpha", math.inf, "a positive finite number"),
    ("lora_alpha", 0, "a positive finite number"), ("lora_alpha", -8, "a positive finite number"),
    ("lora_alpha", "8", "a positive finite number"),
    ("r", math.nan, "a positive integer (the LoRA rank)"), ("r", 0, "a positive integer (the LoRA rank)"),
    ("r", -4, "a positive integer (the LoRA rank)"), ("r", 4.5, "a positive integer (the LoRA rank)"),
    ("r", True, "a positive integer (the LoRA rank)"), ("r", "4", "a positive integer (the LoRA rank)"),
    ("lora_dropout", math.nan, "a number in [0, 1)"), ("lora_dropout", 1.0, "a number in [0, 1)"),
])
def test_peft_config_numbers_are_checked_by_name(base: Path, tmp_path: Path, key: str, value: Any,
                                                 rule: str) -> None:
    peft = _peft_dir(tmp_path / "peft", {key: value})
    expected = f"{peft}/adapter_config.json: {key} must be {rule}, got {value!r}"
    with pytest.raises(InteropError) as caught:
        import_peft(peft, tmp_path / "out", base)
    assert str(caught.value) == expected
    assert not (tmp_path / "out").exists()


def test_a_peft_config_that_is_not_an_object_is_one_message(tmp_path: Path) -> None:
    peft = _peft_dir(tmp_path / "peft")
    (peft / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(InteropError, match=f"^{_escaped(str(peft / 'adapter_config.json'))} must hold a JSON object, "
                                           "not list$"):
        read_peft_dir(peft)
    (peft / "adapter_config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(InteropError, match="adapter_config.json is not valid JSON"):
        read_peft_dir(peft)


# ------------------------------------------------------------------------ (d) PEFT safetensors files
def _header(raw: bytes) -> tuple[dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _with_header(header: dict[str, Any], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _damaged(raw: bytes, damage: str) -> bytes:
    header, data = _header(raw)
    first = next(k for k in header if k != "__metadata__")
    if damage == "truncated":
        return raw[: len(raw) - 100]
    if damage == "header-length":
        return b"\xff" * 8 + raw[8:]
    if damage == "not-json":
        return struct.pack("<Q", 9) + b"{not json" + data
    if damage == "dtype":
        header[first]["dtype"] = "F99"
    elif damage == "fractional-shape":
        header[first]["shape"] = [header[first]["shape"][0], 64.5]
    elif damage == "negative-offset":
        header[first]["data_offsets"] = [-8, header[first]["data_offsets"][1]]
    return _with_header(header, data)


@pytest.mark.parametrize("damage", ["truncated", "header-length", "not-json", "dtype", "fractional-shape",
                                    "negative-offset"])
def test_a_damaged_adapter_file_is_the_message_import_hf_gives(hf_dir: Path, tmp_path: Path, damage: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    peft = _peft_dir(tmp_path / "peft")
    weights = peft / "adapter_model.safetensors"
    bad = _damaged(weights.read_bytes(), damage)
    weights.write_bytes(bad)
    hf = shutil.copytree(hf_dir, tmp_path / "hf")
    (hf / "model.safetensors").write_bytes(bad)
    with pytest.raises(InteropError) as from_peft:
        read_peft_dir(peft)
    with pytest.raises(InteropError) as from_hf:
        HFModelDir(hf)
    assert str(weights) in str(from_peft.value)
    assert str(from_peft.value).replace(str(weights), "FILE") == str(from_hf.value).replace(
        str(hf / "model.safetensors"), "FILE")
    capsys.readouterr()
    assert main(["import-peft", str(peft), str(tmp_path / "out"), "--base", str(hf_dir)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"peftckpt import-peft: error: {weights}") and "Traceback" not in err


# ---------------------------------------------------------------------- the CLI's memory stays bounded
_LIMIT = 2 << 30
_MEASURED = f"""
import os, sys, threading

def kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

def watch():  # a process that grows past the limit is stopped (a regression must not take the machine down)
    while True:
        if kib("VmRSS") * 1024 > {_LIMIT}:
            print(f"PEAK_RSS_KIB {{kib('VmHWM')}} (stopped: over the limit)", flush=True)
            os._exit(99)
        threading.Event().wait(0.02)

threading.Thread(target=watch, daemon=True).start()
from peftckpt.cli import main
code = main(sys.argv[1:])
print(f"PEAK_RSS_KIB {{kib('VmHWM')}}", flush=True)
sys.exit(code)
"""


def _measured(args: list[str]) -> tuple[int, int, str]:
    """``peftckpt ARGS`` in a process of its own: exit code, peak RSS in bytes, stderr."""
    proc = subprocess.run([sys.executable, "-c", _MEASURED, *args], capture_output=True, text=True, env=env(),
                          timeout=600)
    peak = int(proc.stdout.rsplit("PEAK_RSS_KIB", 1)[1].split()[0]) * 1024
    return proc.returncode, peak, proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_cli_refuses_a_claimed_huge_model_within_its_import_memory(hf_dir: Path, base: Path,
                                                                      tmp_path: Path) -> None:
    """``import-hf`` and ``train --pretrained-checkpoint`` of an HF directory whose config.json claims a huge model
    (before: the per-layer enumeration grew without bound), and ``train --load`` of a re-digested manifest claiming
    a 1.7B-parameter model (before: the model was built and initialised, 7.6 GB, before the load compared a shape):
    exit 1, one message line, and a peak RSS under 1 GiB -- what the imports alone take, a few hundred MB."""
    huge = _hf_variant(hf_dir, tmp_path / "huge", hidden_size=65536, num_hidden_layers=10**7,
                       intermediate_size=229376, vocab_size=128000, num_attention_heads=64, num_key_value_heads=8)
    crafted = _re_signed(base, tmp_path / "crafted",
                         model={"hidden_size": 4096, "num_layers": 8, "ffn_hidden_size": 11008, "vocab_size": 32000})
    run = ["--mock-data", "--train-iters", "1", "--device", "cpu", "--seq-length", "16", "--micro-batch-size", "1",
           "--global-batch-size", "1"]
    hf_message = f"{huge / 'config.json'} says hidden_size 65536 but model.embed_tokens.weight is [96, 64] in " \
                 "model.safetensors"
    manifest = resolve_checkpoint_dir(crafted)[0] / "metadata.json"
    cases = [
        (["import-hf", str(huge), str(tmp_path / "out")], f"peftckpt import-hf: error: {hf_message}"),
        (["train", "--pretrained-checkpoint", str(huge), "--lora-rank", "2", "--save", str(tmp_path / "run"), *run],
         f"peftckpt train: error: --pretrained-checkpoint: {hf_message}"),
        (["train", "--load", str(crafted), *run],
         f"peftckpt train: error: manifest {manifest} says vocab_size 32000 but "
         "model.embedding.word_embeddings.weight is [96, 64]"),
    ]
    for args, message in cases:
        code, peak, err = _measured(args)
        print(f"{args[0]} {args[1]}: exit {code}, peak RSS {peak / 2**20:.0f} MiB")
        assert code == 1, (args, err)
        assert peak < 1 << 30, (args, peak)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message) and "Traceback" not in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


def _escaped(text: str) -> str:
    import re

    return re.escape(text)
