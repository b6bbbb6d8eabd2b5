"""Issue #12 on real ranks: meta-device construction and the bf16 frozen base at TP x PP in {1,2}^2.

One spawn of 4 ranks runs every layout in turn (data parallel fills the rest). For each layout:

* the eager build (the reference every rank used to do) and the trainer's meta-device build without a base
  hold, bit for bit, the values of an independent full-tensor reference;
* the trainer's build with ``--pretrained-checkpoint`` draws no initial value for the frozen base, and after
  the load gives logits identical to the eager fp32 build of the base; the base fingerprint the load took
  piece by piece while reading equals one computed afterwards;
* with ``--bf16`` the logits are within bf16 rounding of those, frozen parameters are bf16, trainable ones and
  the Adam state fp32, training leaves the base untouched; a full save stores each tensor in its own dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import peftckpt.model.gpt as gpt_module
from peftckpt.checkpoint.state.fingerprint import FINGERPRINT_VERSION
from peftckpt.model.config import LoRAConfig
from peftckpt.model.gpt import GPTModel
from peftckpt.model.lora import apply_lora
from peftckpt.parallel.dims import ParallelMeshes, stage_layer_numbers
from peftckpt.train.args import lora_config, parse_train_args
from peftckpt.train.checkpointing import TrainerCheckpointing
from peftckpt.train.trainer import Trainer

from ..unit.test_meta_init import reference_value, save_base
from .common import TINY, global_tensor
from .harness import run_distributed

pytestmark = pytest.mark.slow

BASE_SEED = 11
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
LORA = ["--lora-rank", "4", "--lora-target-modules", "linear_q", "linear_v", "linear_proj", "linear_fc1",
        "linear_fc2"]


def _layout(tp: int, pp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


def _logits(chunks: list[GPTModel], meshes: ParallelMeshes, tokens: torch.Tensor,
            dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """Forward through the pipeline stages in order (one chunk per rank; activations between stages in
    ``dtype``, the embedding's); the logits on the last stage, ``None`` elsewhere."""
    (chunk,) = chunks
    with torch.no_grad():
        if meshes.dims.pp == 1:
            return chunk(tokens)
        group = meshes.group("pp")
        assert group is not None
        stage = meshes.pp_rank
        x = tokens
        if stage > 0:
            x = torch.empty(*tokens.shape, chunk.config.hidden_size, dtype=dtype)
            dist.recv(x, group_src=stage - 1, group=group)
        y = chunk(x)
        if stage < meshes.dims.pp - 1:
            dist.send(y.contiguous(), group_dst=stage + 1, group=group)
            return None
        return y


def _mismatches(chunks: list[GPTModel], tp: int, seed: int, lora_seed: int) -> list[str]:
    """Names whose global canonical value differs from the full-tensor reference (collective over TP)."""
    bad = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            value = global_tensor(p.detach(), name, chunk, tp)
            if not torch.equal(value, reference_value(name, tuple(value.shape), chunk.config, seed, lora_seed)):
                bad.append(name)
    return bad


def _frozen_local(t: Trainer) -> dict[str, torch.Tensor]:
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for c in t.chunks for n, p in c.named_parameters() if not p.requires_grad}


def _worker(rank: int, world: int, base: str, save_root: str) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)
    tokens = _tokens()
    out: dict[str, Any] = {}
    for tp, pp in LAYOUTS:
        key = f"tp{tp}pp{pp}"
        argv = TINY + _layout(tp, pp) + LORA
        # 1. the trainer's meta build without a base == eager build == the reference
        scratch = Trainer(parse_train_args(argv + ["--seed", str(BASE_SEED)], world), world, rank)
        meshes = scratch.meshes
        lora = lora_config(scratch.args)
        assert isinstance(lora, LoRAConfig)
        eager = []
        for sid in meshes.stage_ids():
            layers = stage_layer_numbers(scratch.config.num_layers, meshes.dims.num_stages, sid)
            eager.append(GPTModel(scratch.config, meshes.tp, layers, pre_process=sid == 0,
                                  post_process=sid == meshes.dims.num_stages - 1, seed=BASE_SEED))
        apply_lora(eager, lora, BASE_SEED)
        bad = _mismatches(scratch.chunks, tp, BASE_SEED, BASE_SEED) + _mismatches(eager, tp, BASE_SEED, BASE_SEED)
        # 2. with a base: no draw for frozen parameters, then the base's logits exactly
        drawn: list[str] = []
        original = gpt_module.param_generator

        def recording(seed: int, name: str, _o: Any = original, _d: list[str] = drawn) -> torch.Generator:
            _d.append(name)
            return _o(seed, name)

        gpt_module.param_generator = recording  # type: ignore[assignment]
        try:
            loaded = Trainer(parse_train_args(argv + ["--seed", "5", "--pretrained-checkpoint", base,
                                                      "--train-iters", "0"], world), world, rank)
        finally:
            gpt_module.param_generator = original
        loading = TrainerCheckpointing(loaded)
        loading.restore()  # loads the base, and fingerprints it piece by piece as it reads
        computed_while_reading = loading.ckpt._fingerprints.copy()
        loading.ckpt._fingerprints.clear()
        fingerprints_agree = computed_while_reading == {FINGERPRINT_VERSION: loading.ckpt.fingerprint()}
        ref_logits = _logits(eager, meshes, tokens)
        fp32_logits = _logits(loaded.chunks, loaded.meshes, tokens)
        # 3. --bf16: the same fp32 base, loaded into bf16 frozen parameters; then 2 training steps
        bf16 = Trainer(parse_train_args(argv + ["--seed", "5", "--pretrained-checkpoint", base, "--bf16",
                                                "--train-iters", "0"], world), world, rank)
        bf16.run()
        bf16_logits = _logits(bf16.chunks, bf16.meshes, tokens, torch.bfloat16)
        base_before = _frozen_local(bf16)
        losses = [bf16.train_step()[0] for _ in range(2)]
        base_after = _frozen_local(bf16)
        params = [(n, p) for c in bf16.chunks for n, p in c.named_parameters()]
        states = [v for s in bf16.optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.ndim > 0]
        result = {
            "bad": bad, "drawn": drawn, "fingerprints_agree": fingerprints_agree,
            "frozen_dtypes": sorted({str(p.dtype) for _, p in params if not p.requires_grad}),
            "trainable_dtypes": sorted({str(p.dtype) for _, p in params if p.requires_grad}),
            "num_trainable": sum(1 for _, p in params if p.requires_grad),
            "state_dtypes": sorted({str(v.dtype) for v in states}), "num_states": len(states),
            "base_unchanged": list(base_before) == list(base_after) and all(
                torch.equal(base_before[n], base_after[n]) for n in base_before),
            "losses": losses,
            # the frozen base: this rank's bytes vs the stage's, in fp32 and unsharded
            "base_held": sum(v.nbytes for v in base_after.values()),
            "base_fp32": sum(p.numel() * 4 for _, p in params if not p.requires_grad),
        }
        if ref_logits is not None:
            result.update(ref=ref_logits, fp32=fp32_logits, bf16=bf16_logits)
        if (tp, pp) == (2, 2):
            TrainerCheckpointing(bf16).save(str(Path(save_root) / "full"))
        out[key] = result
    return out


def test_meta_build_base_load_and_bf16_at_every_layout(tmp_path: Path) -> None:
    base = save_base(tmp_path / "base", BASE_SEED, TINY)
    results = run_distributed(_worker, 4, str(base), str(tmp_path))
    for tp, pp in LAYOUTS:
        key = f"tp{tp}pp{pp}"
        per_rank = [r[key] for r in results]
        with_logits = [r for r in per_rank if "ref" in r]
        assert len(with_logits) == 4 // pp, key  # every rank of the last stage
        for r in per_rank:
            assert r["bad"] == [], f"{key}: values differ from the reference: {r['bad'][:5]}"
            assert r["drawn"] == [], f"{key}: the base to load was drawn: {r['drawn'][:5]}"
            assert r["fingerprints_agree"], f"{key}: the fingerprint taken while loading differs from a fresh one"
            assert r["frozen_dtypes"] == ["torch.bfloat16"] and r["trainable_dtypes"] == ["torch.float32"], key
            assert r["num_trainable"] > 0 and r["num_states"] == 2 * r["num_trainable"], key
            assert r["state_dtypes"] == ["torch.float32"], key
            assert r["base_unchanged"], f"{key}: training or the dtype changed the frozen bf16 base"
            assert len(r["losses"]) == 2 and all(torch.isfinite(torch.tensor(r["losses"]))), key
            # bf16 halves the base; TP=2 shards the layers (the embeddings are replicated: 0.297 here)
            if tp == 1:
                assert r["base_held"] * 2 == r["base_fp32"], key
            else:
                assert r["base_held"] < 0.3 * r["base_fp32"], (key, r["base_held"], r["base_fp32"])
        for r in with_logits:
            assert r["ref"].dtype == r["fp32"].dtype == torch.float32 and r["bf16"].dtype == torch.bfloat16
            assert torch.equal(r["fp32"], r["ref"]), f"{key}: meta build + base load changed the logits"
            scale = r["ref"].abs().max()
            err = (r["bf16"].float() - r["ref"]).abs().max()
            assert 0 < err <= 0.03 * scale, f"{key}: bf16 logits off by {err} (max |logit| {scale})"
    # the bf16 full save (TP=2 x PP=2): each tensor on disk in its own dtype
    md = FileSystemReader(str(tmp_path / "full" / "iter_0000002")).read_metadata()
    dtypes = {k: m.properties.dtype for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    model = {k: v for k, v in dtypes.items() if k.startswith("model.")}
    assert {v for k, v in model.items() if ".lora_" in k} == {torch.float32}
    assert {v for k, v in model.items() if ".lora_" not in k} == {torch.bfloat16}
    assert {v for k, v in dtypes.items() if k.startswith("optimizer.")} == {torch.float32}
    assert len(model) == len(dtypes) - sum(1 for k in dtypes if k.startswith("optimizer.")) > 0

