"""export-peft / import-peft / export-hf / eval against real ``peft`` and ``transformers``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from peftckpt.checkpoint.location.directory import resolve_checkpoint_dir
from peftckpt.checkpoint.storage.manifest import read_manifest
from peftckpt.interop import InteropError, import_hf, import_peft
from peftckpt.train.data import GlobalBatchSampler, build_datasets
from tests.integration.cli import peftckpt, read_dcp_tensors, train_records
from tests.interop.common import ALL_PROJ, SEQ, VOCAB, hf_loss, make_llama, our_model, samples, tokens

ATOL = 2e-5


def _peft_model(hf_dir: Path, adapter: Path) -> PeftModel:
    return PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(hf_dir), adapter).eval()


# ----------------------------------------------------------------- trained here -> PEFT (must-show 2)
def test_tp2_pp2_adapter_exports_to_peft_with_equal_logits(lora_run: Path, hf_dir: Path, base: Path,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "peft"
    peftckpt(["export-peft", str(lora_run), str(out), "--base-model-name-or-path", "tiny-llama"])
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, "tiny-llama")
    assert sorted(config["target_modules"]) == sorted(ALL_PROJ)
    keys = load_file(str(out / "adapter_model.safetensors"))
    assert len(keys) == 4 * 7 * 2  # layers x projections x (A, B)
    assert keys["base_model.model.model.layers.3.self_attn.k_proj.lora_B.weight"].shape == (32, 4)  # 2 KV heads
    toks = tokens(seed=11)
    with torch.no_grad():
        ours = our_model(base, lora_run)(toks)
        plain = our_model(base)(toks)
        theirs = _peft_model(hf_dir, out)(toks).logits
    assert (ours - plain).abs().max() > 1e-3  # the trained adapter changes the function
    torch.testing.assert_close(theirs, ours, rtol=0, atol=ATOL)


def test_eval_at_tp2_pp2_equals_peft_loss(lora_run: Path, hf_dir: Path, base: Path, data: Path,
                                          tmp_path: Path) -> None:
    peftckpt(["export-peft", str(lora_run), str(tmp_path / "peft")])
    proc = peftckpt(["eval", "--pretrained-checkpoint", str(base), "--load", str(lora_run), "--data-path", str(data),
                     "--seq-length", str(SEQ), "--tensor-model-parallel-size", "2",
                     "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
                     "--json"], nproc=4)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (report["samples"], report["tokens"], report["layout"]["tp"], report["layout"]["pp"]) == (48, 48 * SEQ, 2, 2)
    expected = hf_loss(_peft_model(hf_dir, tmp_path / "peft"), samples(data))
    assert report["loss"] == pytest.approx(expected, abs=1e-5)


def test_export_hf_merges_the_adapter(lora_run: Path, base: Path, tmp_path: Path) -> None:
    # No --base: the adapter's manifest records the --pretrained-checkpoint it was trained on.
    peftckpt(["export-hf", str(lora_run), str(tmp_path / "merged")])
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    toks = tokens(seed=12)
    with torch.no_grad():
        torch.testing.assert_close(merged(toks).logits, our_model(base, lora_run)(toks), rtol=0, atol=ATOL)


def test_export_hf_refuses_an_adapter_on_another_base(lora_run: Path, tmp_path: Path) -> None:
    make_llama(tmp_path / "other_hf", seed=9)
    import_hf(tmp_path / "other_hf", tmp_path / "other")
    proc = peftckpt(["export-hf", str(lora_run), str(tmp_path / "out"), "--base", str(tmp_path / "other")],
                    check=False)
    assert proc.returncode == 1
    assert "was trained on a different base than --base" in proc.stderr and "--no-verify-base" in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    peftckpt(["export-hf", str(lora_run), str(tmp_path / "forced"), "--base", str(tmp_path / "other"),
              "--no-verify-base"])
    assert (tmp_path / "forced" / "model.safetensors").is_file()


# ---------------------------------------------------------------- PEFT -> here (must-show 3)
def _random_peft(hf_dir: Path, out: Path, targets: list[str], **lora: object) -> PeftModel:
    model = get_peft_model(LlamaForCausalLM.from_pretrained(hf_dir),
                           LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, **lora))
    g = torch.Generator().manual_seed(21)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.eval().save_pretrained(out)
    return model


def test_peft_adapter_imports_exactly_and_training_resumes_from_it(hf_dir: Path, base: Path, data: Path,
                                                                   tmp_path: Path) -> None:
    targets = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    peft = _random_peft(hf_dir, tmp_path / "peft", targets, use_rslora=True)
    peftckpt(["import-peft", str(tmp_path / "peft"), str(tmp_path / "adapter"), "--base", str(base)])
    manifest = read_manifest(resolve_checkpoint_dir(tmp_path / "adapter")[0])
    assert manifest.trainable_only and manifest.iteration == 0 and "optimizer" not in manifest.sections
    assert manifest.adapter_config is not None
    assert sorted(manifest.adapter_config["target_modules"]) == ["linear_fc1_gate", "linear_fc2", "linear_proj",
                                                                 "linear_q", "linear_v"]
    assert manifest.adapter_config["alpha"] == pytest.approx(8 * 2.0)  # rsLoRA: alpha * sqrt(r)
    toks = tokens(seed=13)
    with torch.no_grad():
        theirs = peft(toks).logits
        ours = our_model(base, tmp_path / "adapter")(toks)
        plain = LlamaForCausalLM.from_pretrained(hf_dir).eval()(toks).logits
    assert (theirs - plain).abs().max() > 1e-2
    torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)

    # Round trip back to PEFT: the very same tensors.
    peftckpt(["export-peft", str(tmp_path / "adapter"), str(tmp_path / "again")])
    original = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    again = load_file(str(tmp_path / "again" / "adapter_model.safetensors"))
    assert sorted(again) == sorted(original) and all(torch.equal(again[k], original[k]) for k in original)

    # `train --load` resumes from it at TP=2: no architecture or LoRA flag, the first loss is PEFT's.
    metrics = tmp_path / "metrics.jsonl"
    proc = peftckpt(["train", "--pretrained-checkpoint", str(base), "--load", str(tmp_path / "adapter"),
                     "--save", str(tmp_path / "resumed"), "--save-trainable-params-only", "--data-path", str(data),
                     "--seq-length", str(SEQ), "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                     "--global-batch-size", "4", "--train-iters", "2", "--metrics-file", str(metrics)], nproc=2)
    assert "LoRA flags from --load" in proc.stdout and "resumed from" in proc.stdout
    train_set, _ = build_datasets(data, False, SEQ, VOCAB, seed=1234)
    first_batch = GlobalBatchSampler(train_set, 4, 1234).next_global_batch()
    losses = [r["loss"] for r in train_records(metrics)]
    assert losses[0] == pytest.approx(hf_loss(peft, first_batch), abs=1e-5)
    saved = read_dcp_tensors(resolve_checkpoint_dir(tmp_path / "resumed")[0], "model.")
    imported = read_dcp_tensors(resolve_checkpoint_dir(tmp_path / "adapter")[0], "model.")
    assert sorted(saved) == sorted(imported)
    key = "model.decoder.layers.1.self_attention.linear_qkv.lora_B_q"
    assert not torch.equal(saved[key], imported[key])  # trained on


@pytest.mark.parametrize(("lora", "message"), [
    ({"use_dora": True}, "sets use_dora; DoRA is not supported"),
    ({"rank_pattern": {"q_proj": 8}}, "sets rank_pattern; rank_pattern (per-module ranks) is not supported"),
    ({"bias": "lora_only"}, "bias = 'lora_only'; only bias = 'none' is supported"),
], ids=["dora", "rank-pattern", "bias"])
def test_unsupported_peft_adapters_are_refused(hf_dir: Path, base: Path, tmp_path: Path, lora: dict,
                                               message: str) -> None:
    _random_peft(hf_dir, tmp_path / "peft", ["q_proj", "k_proj"], **lora)
    with pytest.raises(InteropError, match=message.replace("(", r"\(").replace(")", r"\)")):
        import_peft(tmp_path / "peft", tmp_path / "out", base)
    assert not (tmp_path / "out").exists()


def test_import_peft_cli_errors(hf_dir: Path, base: Path, tmp_path: Path) -> None:
    _random_peft(hf_dir, tmp_path / "embed", ["embed_tokens", "q_proj"])
    proc = peftckpt(["import-peft", str(tmp_path / "embed"), str(tmp_path / "out"), "--base", str(base)],
                    check=False)
    assert proc.returncode == 1
    assert "are not LoRA A/B of a Llama projection" in proc.stderr and "embed_tokens" in proc.stderr
    # An adapter whose shapes do not fit (its config says r = 8): the message names the layer and both sizes.
    _random_peft(hf_dir, tmp_path / "r8", ["o_proj"])
    cfg = json.loads((tmp_path / "r8" / "adapter_config.json").read_text())
    cfg["r"] = 8
    (tmp_path / "r8" / "adapter_config.json").write_text(json.dumps(cfg))
    proc = peftckpt(["import-peft", str(tmp_path / "r8"), str(tmp_path / "out"), "--base", str(base)], check=False)
    assert proc.returncode == 1
    assert "layer 0 o_proj: lora_A [4, 64] / lora_B [64, 4], expected [8, 64] / [64, 8]" in proc.stderr
    proc = peftckpt(["import-peft", str(tmp_path / "r8"), str(tmp_path / "out")], check=False)
    assert proc.returncode == 2 and "--base" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_export_peft_refuses_a_checkpoint_without_lora(base: Path, tmp_path: Path) -> None:
    proc = peftckpt(["export-peft", str(base), str(tmp_path / "out")], check=False)
    assert proc.returncode == 1
    assert "was not trained with LoRA (its manifest has no adapter_config)" in proc.stderr


def test_exports_refuse_an_adapter_config_contradicting_the_tensors(lora_run: Path, tmp_path: Path) -> None:
    """Issue 13: a manifest whose adapter rank was altered (and re-checksummed) passes verify, which treats the
    adapter config as opaque, but no export writes a PEFT config or merge that contradicts the stored tensors."""
    import shutil

    ckpt, _ = resolve_checkpoint_dir(lora_run)
    copy = Path(shutil.copytree(ckpt, tmp_path / "save" / ckpt.name))
    manifest = json.loads((copy / "metadata.json").read_text())
    manifest.pop("manifest_sha256")
    manifest["adapter_config"]["rank"] = 8  # trained with --lora-rank 4
    (copy / "metadata.json").write_text(json.dumps(manifest))
    for command in ("export-peft", "export-hf"):
        out = tmp_path / command
        proc = peftckpt([command, str(copy), str(out)], check=False)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr
        # Issue 25: held to the stored tensors before anything is sized by it (the first adapter named).
        assert "metadata.json says adapter_config rank 8 but model.decoder.layers.0." in proc.stderr
        assert ".lora_A is [4, 64] in " in proc.stderr
        assert not out.exists()
