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
    with pytest.raises(ValueError, match=r"--lora-target-modules: unknown target\(s\) \['linear_x'\]"):
        LoRAConfig(target_modules=("linear_qkv", "linear_x"))
    with pytest.raises(ValueError, match="linear_q is a part of linear_qkv; adapt the whole layer or its parts"):
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


# ------------------------------------------------------------------ per-part ("canonical") adapters
PARTS = ("linear_q", "linear_k", "linear_v", "linear_fc1_gate", "linear_fc1_up")


def _random_b(model: GPTModel, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_part_adapters_equal_the_fused_adapter_they_split() -> None:
    """Parts with the fused adapter's A and the matching rows of its B compute exactly the fused adapter:
    pins the per-group QKV interleave of the forward and the split helpers interop relies on."""
    from peftckpt.model.fused import split_gate_up, split_qkv

    cfg = _config(swiglu=True)
    fused = GPTModel(cfg, seed=SEED)
    apply_lora([fused], LoRAConfig(rank=4, target_modules=("linear_qkv", "linear_fc1")), SEED)
    _random_b(fused, 1)
    parts = GPTModel(cfg, seed=SEED)
    apply_lora([parts], LoRAConfig(rank=4, target_modules=PARTS), SEED)
    for n in _layers(fused):
        qkv_f, qkv_p = target_linear(_layers(fused)[n], "linear_qkv"), target_linear(_layers(parts)[n], "linear_qkv")
        fc1_f, fc1_p = target_linear(_layers(fused)[n], "linear_fc1"), target_linear(_layers(parts)[n], "linear_fc1")
        assert qkv_f.lora_B is not None and fc1_f.lora_B is not None
        assert [p for p, _, _ in qkv_p.adapter_pairs()] == ["q", "k", "v"]
        with torch.no_grad():
            for (_, a, b), b_rows in zip(qkv_p.adapter_pairs(), split_qkv(qkv_f.lora_B, cfg)):
                a.copy_(qkv_f.lora_A)  # type: ignore[arg-type]
                b.copy_(b_rows)
            for (_, a, b), b_rows in zip(fc1_p.adapter_pairs(), split_gate_up(fc1_f.lora_B, cfg)):
                a.copy_(fc1_f.lora_A)  # type: ignore[arg-type]
                b.copy_(b_rows)
    tokens = _tokens()[:, :-1]
    base = GPTModel(cfg, seed=SEED)(tokens)
    out_f, out_p = fused(tokens), parts(tokens)
    assert (out_f - base).abs().max() > 1e-3  # the adapters do something
    torch.testing.assert_close(out_p, out_f, rtol=1e-5, atol=1e-6)


def test_part_adapters_merge_train_and_partial_targets() -> None:
    cfg = _config(swiglu=True)
    model = GPTModel(cfg, seed=SEED)
    apply_lora([model], LoRAConfig(rank=4, target_modules=("linear_q", "linear_v", "linear_fc1_up")), SEED)
    names = trainable_names(model)
    assert sorted({n.rsplit(".", 1)[-1] for n in names}) == ["lora_A_q", "lora_A_up", "lora_A_v", "lora_B_q",
                                                             "lora_B_up", "lora_B_v"]
    shapes = {n.split(".", 3)[-1]: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad
              and n.startswith("decoder.layers.0.")}
    assert shapes["self_attention.linear_qkv.lora_B_q"] == (32, 4)  # 4 heads x 8
    assert shapes["self_attention.linear_qkv.lora_B_v"] == (16, 4)  # 2 groups x 8
    assert shapes["mlp.linear_fc1.lora_B_up"] == (128, 4)
    _random_b(model, 2)
    tokens = _tokens()[:, :-1]
    before = model(tokens)
    merge_lora(model)
    torch.testing.assert_close(model(tokens), before, rtol=1e-5, atol=1e-5)
    unmerge_lora(model)
    torch.testing.assert_close(model(tokens), before, rtol=1e-5, atol=1e-5)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    _train(model, steps=2)
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], v) for n, v in frozen.items())
    assert all(not torch.equal(params[n], v) for n, v in adapters.items())
    # The k part (no adapter) stayed exactly the base: only q and v rows of the merged delta are non-zero.
    qkv = target_linear(_layers(model)[0], "linear_qkv")
    from peftckpt.model.fused import split_qkv

    dq, dk, dv = split_qkv(qkv._delta_weight(), cfg)
    assert dk.abs().max() == 0 and dq.abs().max() > 0 and dv.abs().max() > 0
