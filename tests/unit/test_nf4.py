"""NF4 (QLoRA's 4-bit NormalFloat) defined on the global tensor: every TP split of a weight quantizes to the same
codes and dequantizes to the same values, bit for bit; the error is NF4's; a quantized linear layer computes with
the dequantized weight forward and backward, and its weight never trains."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peftckpt.model import nf4
from peftckpt.model.config import GPTConfig, LoRAConfig
from peftckpt.model.gpt import GPTModel
from peftckpt.model.linear import ParallelLinear
from peftckpt.model.lora import apply_lora


def _split(w: torch.Tensor, ranks: int) -> torch.Tensor:
    """``w`` quantized as ``ranks`` column shards would be (the all-reduce of the group maxima done here), then
    dequantized and put back together; also returns the shards' codes side by side."""
    columns = w.shape[1]
    width = columns // ranks
    groups, per = nf4.groups_of(columns)
    maxima = torch.zeros(w.shape[0], groups)
    for r in range(ranks):  # what each rank contributes to the all-reduce of the maxima
        def keep(local: torch.Tensor, r: int = r) -> torch.Tensor:
            first = r * width // nf4.BLOCK // per
            maxima[:, first:first + local.shape[1]] = torch.maximum(maxima[:, first:first + local.shape[1]], local)
            return local
        nf4.quantize(w[:, r * width:(r + 1) * width], columns, r * width, keep)
    shards = []
    for r in range(ranks):
        first = r * width // nf4.BLOCK // per
        shards.append(nf4.quantize(w[:, r * width:(r + 1) * width], columns, r * width,
                                   lambda local, first=first: maxima[:, first:first + local.shape[1]].clone()))
    return torch.cat([nf4.dequantize(q, torch.float32) for q in shards], 1), torch.cat([q.codes for q in shards], 1)


@pytest.mark.parametrize("columns, ranks", [(256, 2), (256, 4), (4096, 2), (64 * 300, 2), (64 * 300, 4),
                                            (64 * 448, 2), (64 * 448, 8)])
def test_every_column_split_gives_the_same_codes_and_values(columns: int, ranks: int) -> None:
    w = torch.randn(6, columns, generator=torch.Generator().manual_seed(columns)) * 0.02
    whole = nf4.quantize(w, columns)
    values, codes = _split(w, ranks)
    assert torch.equal(codes, whole.codes)
    assert torch.equal(values, nf4.dequantize(whole, torch.float32))
    rows = torch.cat([nf4.dequantize(nf4.quantize(w[i:i + 2], columns), torch.float32) for i in range(0, 6, 2)])
    assert torch.equal(rows, nf4.dequantize(whole, torch.float32))  # row splits (column-parallel layers) too


def test_the_format_and_its_error() -> None:
    w = torch.randn(32, 4096, generator=torch.Generator().manual_seed(1))
    q = nf4.quantize(w, 4096)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (32, 2048)
    assert q.scales.shape == (32, 64) and q.factors.shape == (32, 1)
    assert nf4.stored_shapes((32, 4096)) == {"weight_nf4": (32, 2048), "weight_scales": (32, 64),
                                             "weight_factors": (32, 1)}
    back = nf4.dequantize(q, torch.float32)
    assert 0.05 < ((back - w).norm() / w.norm()).item() < 0.12  # 4 bits of a normal distribution
    values = torch.tensor(nf4.NF4_VALUES)
    # every value is an NF4 value times its block's scale, each block's largest magnitude kept to half a step of
    # its row's 255 (one group per row here)
    blocks, kept = back.reshape(32, 64, 64), w.reshape(32, 64, 64)
    scale = blocks.abs().amax(-1, keepdim=True)
    assert ((blocks / scale).unsqueeze(-1) - values).abs().amin(-1).max() < 1e-6
    kept_max = kept.abs().amax(-1)
    assert ((scale.squeeze(-1) - kept_max).abs() <= kept_max.amax(-1, keepdim=True) / 510 + 1e-6).all()
    zeros = torch.zeros(2, 128)
    zeros[0, 64:] = 1.0
    assert torch.equal(nf4.dequantize(nf4.quantize(zeros, 128), torch.float32), zeros)  # zero blocks, exact ones


def test_splits_that_cut_blocks_or_groups_are_named() -> None:
    assert nf4.shard_problem(4096, 0, 2048) is None
    assert "whole blocks of 64" in str(nf4.shard_problem(4096, 0, 96))
    assert nf4.shard_problem(64 * 448, 64 * 112, 64 * 112) is None  # inside one group: shares its factor
    problem = nf4.shard_problem(64 * 300, 64 * 100, 64 * 100)  # groups of 150 blocks: touches both, cuts one
    assert problem is not None and "cuts a double-quantization group" in problem
    with pytest.raises(ValueError, match="whole blocks"):
        nf4.quantize(torch.zeros(2, 96), 96)


def test_a_quantized_layer_computes_with_the_dequantized_weight_forward_and_backward() -> None:
    cfg = GPTConfig(num_layers=1, hidden_size=128, num_attention_heads=4, ffn_hidden_size=256, vocab_size=64)
    model = GPTModel(cfg)
    model.requires_grad_(False)
    apply_lora([model], LoRAConfig(rank=4, alpha=8), seed=0)
    layer = model.decoder.layers["0"].mlp.linear_fc2
    assert isinstance(layer, ParallelLinear)
    full = layer.weight.detach().clone()
    with torch.no_grad():
        layer.lora_B.normal_()  # type: ignore[union-attr]
    layer.quantize_nf4()
    assert "weight" not in dict(layer.named_parameters())
    held = {n: p for n, p in layer.named_parameters() if n.startswith("weight_")}
    assert sorted(held) == ["weight_factors", "weight_nf4", "weight_scales"]
    assert not any(p.requires_grad for p in held.values())
    w = nf4.dequantize(nf4.quantize(full, 256), torch.float32)
    x = torch.randn(3, 5, 256, requires_grad=True)
    y = layer(x)
    x_ref = x.detach().clone().requires_grad_(True)
    a, b = layer.lora_A, layer.lora_B
    assert a is not None and b is not None
    y_ref = F.linear(x_ref, w) + layer.lora_scaling * F.linear(F.linear(x_ref, a), b)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    y.square().sum().backward()
    y_ref.square().sum().backward()
    assert x.grad is not None and x_ref.grad is not None
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert a.grad is not None  # the adapter trains through the quantized base
    with pytest.raises(RuntimeError, match="cannot be merged into an NF4 base"):
        layer.merge_lora()
    with pytest.raises(ValueError, match="only a frozen"):
        model.decoder.layers["0"].mlp.linear_fc1.requires_grad_(True)
        model.decoder.layers["0"].mlp.linear_fc1.quantize_nf4()


def test_geometries_nf4_cannot_split_are_flag_errors() -> None:
    from peftckpt.train.args import ArgumentError, parse_train_args

    tiny = ["--num-layers", "1", "--num-attention-heads", "4", "--vocab-size", "64", "--mock-data", "--lora-rank", "4",
            "--base-quantization", "nf4", "--seq-length", "16", "--global-batch-size", "2", "--micro-batch-size", "1"]
    parse_train_args([*tiny, "--hidden-size", "128", "--ffn-hidden-size", "256", "--tensor-model-parallel-size", "2"],
                     2)
    with pytest.raises(ArgumentError, match=r"linear_proj input .* 32 per --tensor-model-parallel-size 2 rank"):
        parse_train_args([*tiny, "--hidden-size", "64", "--ffn-hidden-size", "256", "--tensor-model-parallel-size",
                          "2"], 2)
    with pytest.raises(ArgumentError, match="2 double-quantization groups per row cannot be split over 4 ranks"):
        parse_train_args([*tiny, "--hidden-size", "256", "--ffn-hidden-size", str(64 * 300),
                          "--tensor-model-parallel-size", "4"], 4)
    with pytest.raises(ArgumentError, match="with --lora-rank 0 nothing is frozen"):
        parse_train_args([*tiny, "--hidden-size", "128", "--lora-rank", "0"], 1)
