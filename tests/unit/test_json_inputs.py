"""JSON files a user or an adversary controls (a checkpoint's manifest, a safetensors header, an HF or PEFT config,
a ``.jsonl`` corpus line) nested deeper than the parser goes: one message naming the file, never a traceback (the
parser's ``RecursionError``), and nothing loaded."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from peftckpt.checkpoint.errors import CheckpointError
from peftckpt.interop.hf_dir import HFModelDir
from peftckpt.interop.hf_llama import InteropError
from peftckpt.interop.peft import read_peft_dir
from peftckpt.interop.safetensors_io import SafetensorsError, SafetensorsFile
from peftckpt.json_text import parse_json
from peftckpt.train.data import load_token_documents
from tests.unit.small_model import small_checkpointer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

DEEP = "[" * 100_000 + "]" * 100_000


def test_parse_json_reports_deep_nesting_as_a_decode_error() -> None:
    assert parse_json('{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json(DEEP)
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_json(DEEP.encode())


def test_a_deeply_nested_manifest_is_one_checkpoint_error(tmp_path: Path) -> None:
    ckpt, model = small_checkpointer()
    path = Path(ckpt.save(tmp_path, 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (path / "metadata.json").write_text(DEEP)
    with pytest.raises(CheckpointError, match=r"metadata\.json.*nested too deeply"):
        small_checkpointer(seed=3)[0].load(tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_deeply_nested_interop_files_are_one_message(tmp_path: Path) -> None:
    header = DEEP.encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(SafetensorsError, match=r"model\.safetensors cannot be read as safetensors: nested too deep"):
        SafetensorsFile(tmp_path / "model.safetensors")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(DEEP)
    with pytest.raises(InteropError, match=r"config\.json is not valid JSON: nested too deeply"):
        HFModelDir(hf)
    peft = tmp_path / "peft"
    peft.mkdir()
    (peft / "adapter_config.json").write_text(DEEP)
    (peft / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(InteropError, match=r"adapter_config\.json is not valid JSON: nested too deeply"):
        read_peft_dir(peft)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "hello"}\n' + DEEP + "\n")
    with pytest.raises(ValueError, match=r"corpus\.jsonl:2: invalid JSON \(nested too deeply"):
        load_token_documents(corpus)
