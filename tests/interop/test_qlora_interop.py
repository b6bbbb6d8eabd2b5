"""QLoRA against real ``transformers`` + ``peft``: an adapter trained at TP=2 on an NF4-held HF base (read per rank
from the HF directory), exported with ``export-peft``, gives on an HF Llama holding the dequantized base the same
logits as our model, and ``eval`` with ``--base-quantization nf4`` the same loss."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import LlamaConfig, LlamaForCausalLM

from peftckpt.checkpoint.api import Checkpointer, LoadOptions
from peftckpt.checkpoint.storage.manifest import read_manifest
from peftckpt.interop.hf_llama import config_from_hf, hf_export_plan
from peftckpt.model import nf4
from peftckpt.model.config import LoRAConfig
from peftckpt.model.gpt import GPTModel
from peftckpt.model.linear import ParallelLinear
from peftckpt.model.lora import apply_lora
from peftckpt.train.checkpointing import load_base
from tests.integration.cli import peftckpt
from tests.interop.common import COORDS, SEQ, SINGLE, VOCAB, hf_loss, samples, tokens, write_data

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny HF Llama whose widths NF4 splits over 2 TP ranks, a QLoRA run on it at TP=2, its PEFT export."""
    root = tmp_path_factory.mktemp("qlora-interop")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(root / "hf")
    data = write_data(root / "data.jsonl", num_samples=16)
    peftckpt(["train", "--pretrained-checkpoint", str(root / "hf"), "--base-quantization", "nf4", "--data-path",
              str(data), "--seq-length", str(SEQ), "--tensor-model-parallel-size", "2", "--lora-rank", "4",
              "--lora-alpha", "8", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "4",
              "--lr", "2e-2", "--save", str(root / "lora"), "--save-interval", "4", "--save-trainable-params-only",
              "--log-interval", "100"], nproc=2)
    peftckpt(["export-peft", str(root / "lora"), str(root / "peft")])
    return {"hf": root / "hf", "lora": root / "lora", "peft": root / "peft", "data": data}


def _ours(runs: dict[str, Path], adapter: bool = True) -> GPTModel:
    """Our GPT in one process: the HF base read from its directory, quantized, the adapter loaded."""
    manifest = read_manifest(runs["lora"] / "iter_0000004")
    cfg = config_from_hf(json.loads((runs["hf"] / "config.json").read_text()))
    model = GPTModel(cfg)
    assert manifest.adapter_config is not None
    lora = LoRAConfig.from_dict(manifest.adapter_config)
    model.requires_grad_(False)
    apply_lora([model], lora, seed=0)
    ckpt = Checkpointer([model], None, layout=SINGLE, coords=COORDS,
                        model_config={**cfg.to_dict(), "base_quantization": nf4.record()},
                        adapter_config=lora.to_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_base(ckpt, str(runs["hf"]), LoadOptions())
        for module in model.modules():
            if isinstance(module, ParallelLinear):
                module.quantize_nf4()
        ckpt.base_changed()
        if adapter:
            ckpt.load(runs["lora"], LoadOptions(load_optim=False, load_rng=False))
    return model.eval()


def _dequantized_hf(runs: dict[str, Path], ours: GPTModel) -> LlamaForCausalLM:
    """The HF Llama of the directory with its projections replaced by our NF4 base's dequantized values."""
    hf = LlamaForCausalLM.from_pretrained(runs["hf"]).eval()
    params = dict(hf.named_parameters())
    linears = {name: m for name, m in ours.named_modules() if isinstance(m, ParallelLinear)}
    changed = 0
    with torch.no_grad():
        for our_name, split in hf_export_plan(ours.config):
            module = linears.get(our_name.removesuffix(".weight"))
            if module is None:
                continue  # embeddings and norms: not quantized
            assert module.nf4 is not None
            layout, _ = module.nf4
            q = nf4.NF4Weight(module.weight_nf4, module.weight_scales, module.weight_factors, *layout)
            for hf_name, values in split(nf4.dequantize(q, torch.float32)):
                assert not torch.equal(params[hf_name], values)  # the quantization changed it
                params[hf_name].copy_(values)
                changed += 1
    assert changed == 7 * ours.config.num_layers
    return hf


def test_the_peft_export_on_the_dequantized_base_gives_our_logits(runs: dict[str, Path]) -> None:
    ours = _ours(runs)
    toks = tokens(seed=5)
    with torch.no_grad():
        mine = ours(toks)
        plain = _ours(runs, adapter=False)(toks)
        theirs = PeftModel.from_pretrained(_dequantized_hf(runs, ours), runs["peft"]).eval()(toks).logits
    assert (mine - plain).abs().max() > 1e-3  # the trained adapter changes the function
    assert ((theirs - mine).norm() / mine.norm()).item() <= 1e-5


def test_eval_with_an_nf4_base_equals_peft_on_the_dequantized_base(runs: dict[str, Path]) -> None:
    proc = peftckpt(["eval", "--pretrained-checkpoint", str(runs["hf"]), "--base-quantization", "nf4", "--load",
                     str(runs["lora"]), "--data-path", str(runs["data"]), "--seq-length", str(SEQ),
                     "--tensor-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
                     "--json"], nproc=2)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    hf = PeftModel.from_pretrained(_dequantized_hf(runs, _ours(runs)), runs["peft"]).eval()
    assert report["loss"] == pytest.approx(hf_loss(hf, samples(runs["data"])), rel=1e-5)
    refused = peftckpt(["eval", "--pretrained-checkpoint", str(runs["hf"]), "--load", str(runs["lora"]),
                        "--data-path", str(runs["data"]), "--seq-length", str(SEQ), "--micro-batch-size", "2",
                        "--global-batch-size", "4"], check=False)
    assert refused.returncode == 1 and "pass the --base-quantization it was trained with" in refused.stderr


def test_export_hf_checks_the_quantized_base_and_merges_into_the_full_precision_one(runs: dict[str, Path],
                                                                                    tmp_path: Path) -> None:
    done = peftckpt(["export-hf", str(runs["lora"]), str(tmp_path / "merged"), "--base", str(runs["hf"]),
                     "--eval-data", str(runs["data"])])
    note, evaluated = done.stdout.strip().splitlines()[-2:]
    assert note.startswith("the adapter was trained on the base held in NF4 and is merged into its full-precision "
                           "weights, which differ from the NF4 values by ")
    assert 3.0 < float(note.split(" by ")[1].split(" %")[0]) < 15.0  # NF4's error on normal weights (~9 %)
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reference = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(runs["hf"]), runs["peft"]).eval()
    toks = tokens(seed=6)
    with torch.no_grad():
        torch.testing.assert_close(merged(toks).logits, reference.merge_and_unload()(toks).logits, rtol=0, atol=2e-5)
    # --eval-data: the loss of the model as trained (NF4 base + adapter, as `eval` computes it and as PEFT does on
    # the dequantized base) beside the merged model's (as HF computes it)
    assert evaluated.startswith(f"eval loss on {runs['data']} (")
    trained, after = (float(evaluated.split(label)[1].split()[0].rstrip(",")) for label in
                      ("the model as trained (base in NF4) ", ", merged "))
    as_trained = PeftModel.from_pretrained(_dequantized_hf(runs, _ours(runs)), runs["peft"]).eval()
    assert trained == pytest.approx(hf_loss(as_trained, samples(runs["data"])), rel=1e-5)
    assert after == pytest.approx(hf_loss(merged, samples(runs["data"])), rel=1e-5)
    assert trained != after  # the merge into the full-precision weights changed the model
    # the fingerprint is of the quantized base: another base, quantized here, is not it
    other = LlamaForCausalLM(LlamaConfig(**{**merged.config.to_dict(), "torch_dtype": None}))
    other.save_pretrained(tmp_path / "other")
    refused = peftckpt(["export-hf", str(runs["lora"]), str(tmp_path / "x"), "--base", str(tmp_path / "other")],
                       check=False)
    assert refused.returncode == 1 and "was trained on a different base" in refused.stderr, refused.stderr
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def _eval(runs: dict[str, Path], base: Path, *extra: str, check: bool = True):  # type: ignore[no-untyped-def]
    return peftckpt(["eval", "--pretrained-checkpoint", str(base), "--load", str(runs["lora"]), "--data-path",
                     str(runs["data"]), "--seq-length", str(SEQ), "--micro-batch-size", "2", "--global-batch-size",
                     "4", "--json", *extra], check=check)


def test_a_base_imported_in_nf4_is_the_base_the_run_quantized(runs: dict[str, Path], tmp_path: Path) -> None:
    """``import-hf --base-quantization nf4`` stores what a run quantizing the HF base holds: a quarter-size
    torch_dist base that gives the same fingerprint (the adapter's load checks it) and the same loss; a run without
    the flag is refused naming it; export-hf merges into the HF directory the base was imported from."""
    stored, plain = tmp_path / "nf4", tmp_path / "plain"
    peftckpt(["import-hf", str(runs["hf"]), str(stored), "--base-quantization", "nf4"])
    peftckpt(["import-hf", str(runs["hf"]), str(plain)])
    data = {d: sum(f.stat().st_size for f in (d / "iter_0000000").glob("*.distcp")) for d in (stored, plain)}
    assert data[stored] < 0.5 * data[plain], data  # 4-bit linear weights; embeddings and norms as they were
    assert read_manifest(stored / "iter_0000000").model_config["base_quantization"] == nf4.record()
    # the adapter trained on the HF base, quantized while read, evaluates identically on the stored NF4 base
    losses = [json.loads(_eval(runs, base, "--base-quantization", "nf4").stdout.strip().splitlines()[-1])["loss"]
              for base in (runs["hf"], stored)]
    assert losses[0] == losses[1], losses
    refused = _eval(runs, stored, check=False)
    said = [line for line in refused.stderr.splitlines() if "error:" in line]
    assert refused.returncode == 1 and len(said) == 1 and "pass --base-quantization nf4" in said[0], refused.stderr
    # export-hf merges into full-precision weights: those of the HF directory the NF4 base came from
    for base, out in ((runs["hf"], "from-hf"), (stored, "from-nf4")):
        done = peftckpt(["export-hf", str(runs["lora"]), str(tmp_path / out), "--base", str(base)])
    assert "holds its linear weights in NF4: merging into the full-precision weights of" in done.stdout
    merged = [(tmp_path / out / "model.safetensors").read_bytes() for out in ("from-hf", "from-nf4")]
    assert merged[0] == merged[1]
    # a geometry NF4 cannot hold is refused before anything is written
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "odd")
    refused = peftckpt(["import-hf", str(tmp_path / "odd"), str(tmp_path / "odd-nf4"), "--base-quantization", "nf4"],
                       check=False)
    assert refused.returncode == 1 and "--base-quantization nf4:" in refused.stderr and "whole blocks of 64" \
        in refused.stderr, refused.stderr
    assert not (tmp_path / "odd-nf4").exists() or not any((tmp_path / "odd-nf4").iterdir())
