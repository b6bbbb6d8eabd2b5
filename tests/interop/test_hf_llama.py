"""import-hf / export-hf against real ``transformers`` Llama models (tiny, built from configs)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from peftckpt.checkpoint.api import Checkpointer
from peftckpt.checkpoint.location.directory import resolve_checkpoint_dir
from peftckpt.checkpoint.storage.manifest import read_manifest
from peftckpt.interop import InteropError, import_hf
from peftckpt.model.config import GPTConfig
from peftckpt.model.gpt import GPTModel
from peftckpt.parallel.dims import ParallelDims, stage_layer_numbers
from tests.distributed.harness import run_distributed
from tests.integration.cli import peftckpt
from tests.interop.common import make_llama, our_model, tokens

ATOL = 2e-5


def _logits_tp2_pp2(rank: int, world: int, base: str, toks: torch.Tensor) -> torch.Tensor | None:
    """Our model at TP=2 x PP=2 with the base loaded (the vocabulary split over TP); the last stage's TP rank 0
    returns the logits of the whole vocabulary."""
    dims = ParallelDims.from_world(world, tp=2, pp=2)
    meshes = dims.build("cpu")
    cfg = GPTConfig.from_dict(read_manifest(resolve_checkpoint_dir(base)[0]).model_config)
    (stage,) = meshes.stage_ids()
    chunk = GPTModel(cfg, meshes.tp, stage_layer_numbers(cfg.num_layers, 2, stage), pre_process=stage == 0,
                     post_process=stage == 1)
    Checkpointer([chunk], None, layout=dims.to_dict(), coords={"tp": meshes.tp_rank, "pp": stage, "dp": 0},
                 model_config=cfg.to_dict()).load_pretrained(base)
    pp = meshes.group("pp")
    assert pp is not None
    with torch.no_grad():
        if stage == 0:
            dist.send(chunk(toks).contiguous(), dst=dist.get_global_rank(pp, 1))
            return None
        hidden = torch.empty(*toks.shape, cfg.hidden_size)
        dist.recv(hidden, src=dist.get_global_rank(pp, 0))
        logits = chunk(hidden)  # this TP rank's vocabulary columns
        parts: list[torch.Tensor] = [torch.empty(0)] * 2
        dist.all_gather_object(parts, logits, group=meshes.group("tp"))
    return torch.cat(parts, dim=-1) if meshes.tp_rank == 0 else None


def test_imported_base_computes_hf_logits_at_tp1(hf_dir: Path, base: Path) -> None:
    manifest = read_manifest(resolve_checkpoint_dir(base)[0])
    cfg = manifest.model_config
    assert (cfg["num_query_groups"], cfg["num_attention_heads"], cfg["rotary_base"], cfg["norm_epsilon"]) == (
        2, 4, 5000.0, 1e-5)
    assert cfg["untie_embeddings_and_output_weights"] is True and not manifest.trainable_only
    hf = LlamaForCausalLM.from_pretrained(hf_dir).eval()
    toks = tokens()
    with torch.no_grad():
        expected = hf(toks).logits
        got = our_model(base)(toks)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_imported_base_computes_hf_logits_at_tp2_pp2(hf_dir: Path, base: Path) -> None:
    toks = tokens(seed=5)
    results = run_distributed(_logits_tp2_pp2, 4, str(base), toks)
    (got,) = [r for r in results if r is not None]
    with torch.no_grad():
        expected = LlamaForCausalLM.from_pretrained(hf_dir).eval()(toks).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_tied_sharded_model_imports_and_exports_exactly(tmp_path: Path) -> None:
    hf = make_llama(tmp_path / "hf", seed=2, tied=True, max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ckpt = import_hf(tmp_path / "hf", tmp_path / "base")
    assert read_manifest(ckpt).model_config["untie_embeddings_and_output_weights"] is False
    toks = tokens(seed=7)
    with torch.no_grad():
        torch.testing.assert_close(our_model(tmp_path / "base")(toks), hf(toks).logits, rtol=0, atol=ATOL)
    # Back to HF: the very same tensors (bit for bit), loadable by transformers.
    proc = peftckpt(["export-hf", str(tmp_path / "base"), str(tmp_path / "back")])
    assert proc.returncode == 0
    exported = load_file(str(tmp_path / "back" / "model.safetensors"))
    original = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original)
    with torch.no_grad():
        again = LlamaForCausalLM.from_pretrained(tmp_path / "back").eval()(toks).logits
    torch.testing.assert_close(again, hf(toks).logits, rtol=0, atol=0)


def _variant(hf_dir: Path, dest: Path, **changes: object) -> Path:
    shutil.copytree(hf_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}},
     "rope type 'linear' (rope scaling) is not supported"),
    ({"attention_bias": True}, "attention_bias = True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ({"head_dim": 32}, "head_dim = 32 differs from hidden_size / num_attention_heads = 16"),
    ({"model_type": "mixtral"}, "model_type 'mixtral'; only Llama-architecture models"),
    ({"intermediate_size": 128},
     "config.json says intermediate_size 128 but model.layers.0.mlp.down_proj.weight is [64, 96] in model.safetensors"),
], ids=["rope-scaling", "bias", "act", "head-dim", "model-type", "shapes"])
def test_unsupported_configs_are_refused_before_writing(hf_dir: Path, tmp_path: Path, changes: dict,
                                                        message: str) -> None:
    src = _variant(hf_dir, tmp_path / "hf", **changes)
    with pytest.raises(InteropError, match=re.escape(message)):
        import_hf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_hf_cli_errors(hf_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = peftckpt(["import-hf", str(tmp_path / "empty"), str(tmp_path / "out")], check=False)
    assert proc.returncode == 1
    assert f"peftckpt import-hf: error: {tmp_path / 'empty'} is not an HF model directory: config.json is missing" \
        in proc.stderr
    bin_only = tmp_path / "bin"
    bin_only.mkdir()
    shutil.copy(hf_dir / "config.json", bin_only / "config.json")
    (bin_only / "pytorch_model.bin").write_bytes(b"not read")
    proc = peftckpt(["import-hf", str(bin_only), str(tmp_path / "out")], check=False)
    assert proc.returncode == 1 and "only safetensors weights are read" in proc.stderr
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("keep me")
    proc = peftckpt(["import-hf", str(hf_dir), str(tmp_path / "busy")], check=False)
    assert proc.returncode == 1 and "is not an empty directory; nothing was written" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "busy").iterdir()) == ["x"]
    assert not (tmp_path / "out").exists()
