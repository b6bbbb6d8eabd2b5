"""Shared pieces of the HF interop tests: a tiny HF Llama, data files, and our model's logits."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from peftckpt.checkpoint.api import Checkpointer, LoadOptions
from peftckpt.checkpoint.location.directory import resolve_checkpoint_dir
from peftckpt.checkpoint.storage.manifest import read_manifest
from peftckpt.model.config import GPTConfig, LoRAConfig
from peftckpt.model.gpt import GPTModel
from peftckpt.model.lora import apply_lora

VOCAB = 96
SEQ = 16
SINGLE = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
COORDS = {"tp": 0, "pp": 0, "dp": 0}
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def llama_config(tied: bool = False):  # type: ignore[no-untyped-def]
    """A tiny Llama with GQA (4 query heads, 2 KV heads), non-default RoPE base and eps."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=tied, max_position_embeddings=64)


def make_llama(path: Path, seed: int = 0, tied: bool = False, max_shard_size: str | None = None):  # type: ignore[no-untyped-def]
    """Random-initialised tiny ``LlamaForCausalLM`` saved to ``path`` (safetensors); returns it in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(tied)).eval()
    with torch.no_grad():  # HF zero-initialises nothing that matters here, but make the norms non-trivial
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return model


def tokens(seed: int = 1, batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def write_data(path: Path, num_samples: int, seed: int = 3) -> Path:
    """A ``.jsonl`` of token ids: ``num_samples`` samples of ``SEQ + 1`` tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (num_samples * (SEQ + 1),), generator=g).tolist()
    path.write_text(json.dumps({"input_ids": ids}) + "\n")
    return path


def samples(path: Path) -> torch.Tensor:
    ids = json.loads(path.read_text())["input_ids"]
    return torch.tensor(ids).view(-1, SEQ + 1)


def our_model(base: Path, adapter: Path | None = None) -> GPTModel:
    """Our GPT at TP = PP = 1 with the base (and the adapter) loaded, architecture from the manifests."""
    manifest = read_manifest(resolve_checkpoint_dir(base)[0])
    cfg = GPTConfig.from_dict(manifest.model_config)
    model = GPTModel(cfg)
    lora = None
    if adapter is not None:
        adapter_manifest = read_manifest(resolve_checkpoint_dir(adapter)[0])
        assert adapter_manifest.adapter_config is not None
        lora = LoRAConfig.from_dict(adapter_manifest.adapter_config)
        apply_lora([model], lora, seed=0)
    ckpt = Checkpointer([model], None, layout=SINGLE, coords=COORDS, model_config=cfg.to_dict(),
                        adapter_config=None if lora is None else lora.to_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ckpt.load_pretrained(base)
        if adapter is not None:
            ckpt.load(adapter, LoadOptions(load_optim=False, load_rng=False))
    return model.eval()


def hf_loss(model, data: torch.Tensor) -> float:  # type: ignore[no-untyped-def]
    """Mean next-token loss of an HF causal LM over samples ``[n, SEQ + 1]``."""
    with torch.no_grad():
        logits = model(data[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                   data[:, 1:].reshape(-1)))
