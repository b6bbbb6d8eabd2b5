"""Unit tests for peftckpt.model.lora: structural freezing, B = 0 at step 0, training, merge/unmerge."""

from __future__ import annotations

import pytest
import torch

from peftckpt.model.config import LORA_TARGETS, GPTConfig, LoRAConfig
from peftckpt.model.gpt import GPTModel, TransformerLayer, gpt_loss
from peftckpt.model.linear import ParallelLinear
from peftckpt.model.lora import apply_lora, merge_lora, target_linear, trainable_names, unmerge_lora

SEED = 7
VOCAB = 64


def _config(swiglu: bool) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
                     swiglu=swiglu)


def _tokens(seed: int = 0, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq + 1), generator=torch.Generator().manual_seed(seed))


def _layers(model: GPTModel) -> dict[int, TransformerLayer]:
    return {m.layer_number: m for m in model.modules() if isinstance(m, TransformerLayer)}


def _adapter_params(model: GPTModel) -> list[torch.nn.Parameter]:
    """Every lora_A / lora_B, found through the modules (not through parameter names)."""
    out = []
    for m in model.modules():
        if isinstance(m, ParallelLinear) and m.lora_A is not None:
            assert m.lora_B is not None
            out += [m.lora_A, m.lora_B]
    return out


def _train(model: GPTModel, steps: int = 4, lr: float = 1e-2) -> list[float]:
    # Every parameter goes to the optimizer (with weight decay): only freezing keeps the base unchanged.
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for step in range(steps):
        batch = _tokens(seed=100 + step)
        loss = gpt_loss(model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(params=[True, False], ids=["swiglu", "gelu"])
def swiglu(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_only_new_parameters_are_trainable(swiglu: bool) -> None:
    model = GPTModel(_config(swiglu), seed=SEED)
    base = list(model.parameters())
    assert all(p.requires_grad for p in base)
    adapted = apply_lora([model], LoRAConfig(rank=4), SEED)

    base_ids = {id(p) for p in base}
    trainable = [p for p in model.parameters() if p.requires_grad]
    new = [p for p in model.parameters() if id(p) not in base_ids]
    assert {id(p) for p in trainable} == {id(p) for p in new} == {id(p) for p in _adapter_params(model)}
    assert len(new) == 2 * len(LORA_TARGETS) * 2  # A and B, 4 targets, 2 layers
    assert not any(p.requires_grad for p in base)
    assert len(adapted) == 8
    assert "decoder.layers.1.mlp.linear_fc2" in adapted
    assert all(n.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for n in trainable_names(model))

    # A [r, in], B [out, r]; SwiGLU fc1 has 2 x ffn output rows.
    fc1 = target_linear(_layers(model)[0], "linear_fc1")
    assert fc1.lora_A is not None and fc1.lora_B is not None
    assert tuple(fc1.lora_A.shape) == (4, 32)
    assert tuple(fc1.lora_B.shape) == ((2 if swiglu else 1) * 128, 4)


def test_train_params_reenables_named_base_parameter(swiglu: bool) -> None:
    model = GPTModel(_config(swiglu), seed=SEED)
    base_ids = {id(p) for p in model.parameters()}
    norm = model.decoder.final_layernorm
    assert norm is not None
    apply_lora([model], LoRAConfig(rank=4, train_params=("decoder.final_layernorm.weight",)), SEED)
    trainable_base = [p for p in model.parameters() if p.requires_grad and id(p) in base_ids]
    assert len(trainable_base) == 1 and trainable_base[0] is norm.weight
    assert len([p for p in model.parameters() if p.requires_grad]) == 16 + 1


def test_step0_output_equals_base_exactly(swiglu: bool) -> None:
    base = GPTModel(_config(swiglu), seed=SEED)
    model = GPTModel(_config(swiglu), seed=SEED)
    apply_lora([model], LoRAConfig(rank=4), SEED)
    assert all(torch.count_nonzero(p) > 0 for p in _adapter_params(model)[0::2])  # A is random ...
    assert all(torch.count_nonzero(p) == 0 for p in _adapter_params(model)[1::2])  # ... B is zero
    tokens = _tokens()[:, :-1]
    with torch.no_grad():
        assert torch.equal(model(tokens), base(tokens))


def test_adapter_init_depends_only_on_seed() -> None:
    a, b, c = (GPTModel(_config(True), seed=SEED) for _ in range(3))
    apply_lora([a], LoRAConfig(rank=4), SEED)
    apply_lora([b], LoRAConfig(rank=4), SEED)
    apply_lora([c], LoRAConfig(rank=4), SEED + 1)
    for pa, pb, pc in zip(_adapter_params(a)[0::2], _adapter_params(b)[0::2], _adapter_params(c)[0::2]):
        assert torch.equal(pa, pb)
        assert not torch.equal(pa, pc)


def test_training_changes_adapters_only(swiglu: bool) -> None:
    model = GPTModel(_config(swiglu), seed=SEED)
    base_before = [(p, p.detach().clone()) for p in model.parameters()]
    apply_lora([model], LoRAConfig(rank=4), SEED)
    adapters_before = [(p, p.detach().clone()) for p in _adapter_params(model)]

    losses = _train(model, steps=4)

    for p, before in base_before:
        assert p.grad is None
        assert torch.equal(p, before)
    for p, before in adapters_before:
        assert not torch.equal(p, before), "every adapter matrix (A and B) should have moved"
    assert all(torch.count_nonzero(p) > 0 for p in _adapter_params(model)[1::2])
    assert all(torch.isfinite(torch.tensor(losses)))


def test_merge_equals_unmerged_and_unmerge_restores(swiglu: bool) -> None:
    model = GPTModel(_config(swiglu), seed=SEED)
    apply_lora([model], LoRAConfig(rank=4, alpha=8.0), SEED)
    _train(model, steps=3)
    linears = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    weights = [(m.weight, m.weight.detach().clone()) for m in linears]
    tokens = _tokens(seed=5)[:, :-1]
    with torch.no_grad():
        base_out = GPTModel(_config(swiglu), seed=SEED)(tokens)
        unmerged = model(tokens)
        assert (unmerged - base_out).abs().max() > 1e-4, "trained adapters should change the output"

        merge_lora(model)
        assert all(m.merged for m in linears)
        for m, (w, before) in zip(linears, weights):
            assert m.lora_A is not None and m.lora_B is not None
            torch.testing.assert_close(w, before + m.lora_scaling * (m.lora_B @ m.lora_A), rtol=1e-6, atol=1e-7)
            assert not torch.equal(w, before)
        merged = model(tokens)
        torch.testing.assert_close(merged, unmerged, rtol=1e-5, atol=1e-5)

        merge_lora(model)  # idempotent: merging twice must not fold the adapter in again
        torch.testing.assert_close(model(tokens), unmerged, rtol=1e-5, atol=1e-5)

        unmerge_lora(model)
        assert not any(m.merged for m in linears)
        for w, before in weights:
            torch.testing.assert_close(w, before, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(model(tokens), unmerged, rtol=1e-5, atol=1e-5)


def test_layers_and_targets_restrict_adapters() -> None:
    model = GPTModel(_config(True), seed=SEED)
    adapted = apply_lora([model], LoRAConfig(rank=4, layers=(0,)), SEED)
    assert adapted == [f"decoder.layers.0.{o}.{t}" for o, t in
                       (("self_attention", "linear_qkv"), ("self_attention", "linear_proj"),
                        ("mlp", "linear_fc1"), ("mlp", "linear_fc2"))]
    layers = _layers(model)
    for target in LORA_TARGETS:
        assert target_linear(layers[0], target).lora_A is not None
        assert target_linear(layers[1], target).lora_A is None
        assert target_linear(layers[1], target).lora_B is None
    assert len([p for p in model.parameters() if p.requires_grad]) == 8

    model = GPTModel(_config(True), seed=SEED)
    apply_lora([model], LoRAConfig(rank=2, target_modules=("linear_qkv", "linear_fc2")), SEED)
    for layer in _layers(model).values():
        assert {t for t in LORA_TARGETS if target_linear(layer, t).lora_A is not None} == {"linear_qkv",
                                                                                          "linear_fc2"}


def test_lora_config_errors_name_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--lora-target-modules: unknown target\(s\) \['linear_q'\]"):
        LoRAConfig(target_modules=("linear_qkv", "linear_q"))
    with pytest.raises(ValueError, match="--lora-target-modules must name at least one module"):
        LoRAConfig(target_modules=())
    with pytest.raises(ValueError, match="--lora-rank must be positive, got 0"):
        LoRAConfig(rank=0)
    with pytest.raises(ValueError, match=r"--lora-dropout must be in \[0, 1\), got 1.0"):
        LoRAConfig(dropout=1.0)


def test_applying_twice_is_refused() -> None:
    model = GPTModel(_config(True), seed=SEED)
    apply_lora([model], LoRAConfig(rank=4), SEED)
    with pytest.raises(RuntimeError, match="already has a LoRA adapter"):
        apply_lora([model], LoRAConfig(rank=4), SEED)
