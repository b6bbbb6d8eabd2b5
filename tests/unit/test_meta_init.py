"""Meta-device construction (issue #12): a chunk built on the meta device and materialised holds exactly the
values of an eager build, a base that is loaded is never randomly initialised, and building a model whose
base comes from a checkpoint costs its share of bf16 storage, not a full fp32 model."""

from __future__ import annotations

import math
import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import peftckpt.model.gpt as gpt_module
from peftckpt.checkpoint.api import Checkpointer, LoadOptions
from peftckpt.checkpoint.errors import CheckpointMismatchError
from peftckpt.model.config import GPTConfig, LoRAConfig
from peftckpt.model.gpt import GPTModel, param_generator
from peftckpt.model.lora import apply_lora, cast_frozen
from peftckpt.parallel.tensor_parallel import TensorParallel, local_tensor
from peftckpt.train.args import parse_train_args
from peftckpt.train.trainer import Trainer

SEED = 77
LORA_SEED = 99
SWIGLU_GQA = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=64, vocab_size=64)
GELU_TIED = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=32, vocab_size=64,
                      swiglu=False, normalization="LayerNorm", position_embedding_type="learned_absolute",
                      untie_embeddings_and_output_weights=False, max_position_embeddings=16)
WHOLE = LoRAConfig(rank=4, train_params=("decoder.final_layernorm.weight",))
PARTS = LoRAConfig(rank=4, target_modules=("linear_q", "linear_v", "linear_fc1_gate", "linear_proj"))
TRAINER_TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--num-query-groups", "2",
                "--ffn-hidden-size", "64", "--vocab-size", "64", "--seq-length", "16", "--micro-batch-size", "2",
                "--global-batch-size", "4", "--mock-data", "--log-interval", "100"]


def reference_value(name: str, shape: tuple[int, ...], config: GPTConfig, seed: int, lora_seed: int) -> torch.Tensor:
    """The full initial value of parameter ``name``, written out independently of the model code: what the
    eager build generated before meta-device construction existed (one generator per full name)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("layernorm.weight"):
        return torch.ones(shape)
    if name.endswith("layernorm.bias"):
        return torch.zeros(shape)
    if leaf.startswith("lora_B"):
        return torch.zeros(shape)
    if leaf.startswith("lora_A"):
        bound = 1.0 / math.sqrt(shape[1])
        return torch.empty(shape).uniform_(-bound, bound, generator=param_generator(lora_seed, name))
    std = config.init_method_std
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std = std / math.sqrt(2.0 * config.num_layers)
    return torch.randn(shape, generator=param_generator(seed, name)) * std


def _chunks(config: GPTConfig) -> list[tuple[list[int] | None, bool, bool]]:
    tied = not config.untie_embeddings_and_output_weights
    whole = [(None, True, True)]
    return whole if tied else whole + [([0], True, False), ([1], False, True)]


def _build(config: GPTConfig, lora: LoRAConfig | None, layers: list[int] | None, pre: bool, post: bool,
           device: str | None) -> GPTModel:
    model = GPTModel(config, TensorParallel(), layers, pre, post, seed=SEED, device=device)
    if lora is not None:
        apply_lora([model], lora, LORA_SEED)
    return model


CASES = [("swiglu-gqa", SWIGLU_GQA, None), ("swiglu-gqa-lora", SWIGLU_GQA, WHOLE),
         ("swiglu-gqa-parts", SWIGLU_GQA, PARTS), ("gelu-layernorm-tied-lora", GELU_TIED, WHOLE)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_meta_build_is_bit_identical_to_eager_and_reference(case: tuple[str, GPTConfig, LoRAConfig | None]) -> None:
    _, config, lora = case
    for layers, pre, post in _chunks(config):
        eager = _build(config, lora, layers, pre, post, None)
        meta = _build(config, lora, layers, pre, post, "meta")
        assert all(p.is_meta for p in meta.parameters()), "a meta build must allocate nothing"
        filled = meta.materialize()
        params = dict(meta.named_parameters())
        assert sorted(filled) == sorted(params)
        assert list(params) == [n for n, _ in eager.named_parameters()]
        for name, p in eager.named_parameters():
            q = params[name]
            want = reference_value(name, tuple(p.shape), config, SEED, LORA_SEED)
            assert p.dtype == q.dtype == torch.float32 and p.requires_grad == q.requires_grad, name
            assert torch.equal(p.detach(), want), f"eager build of {name} differs from the reference"
            assert torch.equal(q.detach(), want), f"meta build of {name} differs from the reference"
        # the adapters' generator was copied: initialising again draws the same values
        before = {n: p.detach().clone() for n, p in params.items()}
        meta.init_weights()
        assert all(torch.equal(before[n], p) for n, p in meta.named_parameters())


def test_materialize_initialises_only_what_is_asked_and_casts_frozen() -> None:
    model = _build(SWIGLU_GQA, WHOLE, None, True, True, "meta")
    assert cast_frozen(model, torch.bfloat16), "nothing was frozen"
    filled = model.materialize(include=lambda _, p: p.requires_grad)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(filled) == trainable
    assert len([n for n in trainable if ".lora_" in n]) == 2 * 4 * 2 and "decoder.final_layernorm.weight" in trainable
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
        assert not p.is_meta
    with pytest.raises(RuntimeError, match="meta device"):
        model.materialize()  # it holds values now: to_empty would throw them away


class _GeneratorCalls:
    """Replaces ``param_generator`` where the GPT draws its initial weights; records the names drawn."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, seed: int, name: str) -> torch.Generator:
        self.names.append(name)
        return param_generator(seed, name)


def save_base(root: Path, seed: int, model_flags: list[str] = TRAINER_TINY) -> Path:
    """A full fp32 checkpoint (iteration 0) of a freshly initialised model, saved by a one-process trainer."""
    Trainer(parse_train_args(model_flags + ["--seed", str(seed), "--train-iters", "0", "--save", str(root)], 1),
            1, 0).run()
    return root / "iter_0000000"


def test_base_to_load_is_never_randomly_initialised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = save_base(tmp_path / "base", seed=11)
    calls = _GeneratorCalls()
    monkeypatch.setattr(gpt_module, "param_generator", calls)
    scratch = Trainer(parse_train_args(TRAINER_TINY + ["--lora-rank", "4"], 1), 1, 0)
    frozen = {n for c in scratch.chunks for n, p in c.named_parameters() if not p.requires_grad}
    assert set(calls.names) == {n for n in frozen if n.endswith("weight") and "layernorm" not in n}, \
        "without a base every weight is drawn (the patch sees the model's draws)"
    calls.names.clear()
    argv = TRAINER_TINY + ["--lora-rank", "4", "--seed", "5", "--pretrained-checkpoint", str(base),
                           "--lora-train-params", "output_layer.weight", "--train-iters", "0"]
    t = Trainer(parse_train_args(argv, 1), 1, 0)
    assert calls.names == ["output_layer.weight"], "only the trainable base parameter is initialised"
    assert sorted(t.initialised) == sorted(n for c in t.chunks for n, p in c.named_parameters() if p.requires_grad)
    t.run()  # loads the base
    want = Trainer(parse_train_args(TRAINER_TINY + ["--seed", "11"], 1), 1, 0).chunks[0].state_dict()
    got = t.chunks[0].state_dict()
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} does not hold the base's value"


def test_frozen_tensor_missing_from_the_base_is_still_an_error(tmp_path: Path) -> None:
    layout, coords = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, {"tp": 0, "pp": 0, "dp": 0}
    headless = GPTModel(SWIGLU_GQA, seed=SEED, post_process=False)  # no final norm, no output layer
    Checkpointer([headless], None, layout=layout, coords=coords, model_config=SWIGLU_GQA.to_dict()).save(
        tmp_path / "base", 1)
    model = _build(SWIGLU_GQA, WHOLE, None, True, True, "meta")
    model.materialize(include=lambda _, p: p.requires_grad)
    ckpt = Checkpointer([model], None, layout=layout, coords=coords, model_config=SWIGLU_GQA.to_dict())
    with pytest.raises(CheckpointMismatchError, match="1 frozen base tensor") as e:
        ckpt.load_pretrained(tmp_path / "base", LoadOptions())
    assert "output_layer.weight" in str(e.value)


# ----------------------------------------------------------------------------------------------- memory
MEM_CONFIG = GPTConfig(num_layers=4, hidden_size=512, num_attention_heads=8, ffn_hidden_size=1024, vocab_size=8192)
MEM_LORA = LoRAConfig(rank=8)


def _full_fp32_bytes(config: GPTConfig) -> int:
    return sum(p.numel() * 4 for p in GPTModel(config, device="meta").parameters())


def _rss_bytes(field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak since the last reset) of this process, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/self/status")


def _measure(mode: str, base: str, queue: Any) -> None:
    """In a fresh process: growth of the peak RSS while building (and then loading the base into) a model.
    ``eager``: the fp32 build every rank did before; ``meta-bf16``: meta build, bf16 frozen base left empty."""
    torch.set_num_threads(1)
    layout, coords = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}, {"tp": 0, "pp": 0, "dp": 0}
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
    start = _rss_bytes("VmRSS")
    if mode == "eager":
        model = GPTModel(MEM_CONFIG, seed=2)
        apply_lora([model], MEM_LORA, 3)
    else:
        model = GPTModel(MEM_CONFIG, seed=2, device="meta")
        apply_lora([model], MEM_LORA, 3)
        cast_frozen(model, torch.bfloat16)
        model.materialize(include=lambda _, p: p.requires_grad)
    built = _rss_bytes("VmHWM")
    ckpt = Checkpointer([model], None, layout=layout, coords=coords, model_config=MEM_CONFIG.to_dict())
    ckpt.load_pretrained(base, LoadOptions(verify_checksums=False))
    queue.put((built - start, _rss_bytes("VmHWM") - start))


def test_building_with_a_base_to_load_costs_its_bf16_share(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    full = _full_fp32_bytes(MEM_CONFIG)
    # 1. Counted: bytes of the materialised parameters, and the largest full tensor generated on the way.
    generated: list[int] = []
    fill: Callable[..., None] = TensorParallel.fill_param

    def counting_fill(self: TensorParallel, param: torch.Tensor, full_t: torch.Tensor, *a: Any) -> None:
        generated.append(full_t.nbytes)
        fill(self, param, full_t, *a)

    monkeypatch.setattr(TensorParallel, "fill_param", counting_fill)
    model = GPTModel(MEM_CONFIG, seed=2, device="meta")
    apply_lora([model], MEM_LORA, 3)
    cast_frozen(model, torch.bfloat16)
    model.materialize(include=lambda _, p: p.requires_grad)
    held = sum(local_tensor(p).nbytes for p in model.parameters())
    adapters = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    assert held == full // 2 + adapters, (held, full, adapters)  # bf16 base + fp32 adapters
    assert held / full < 0.52 and max(generated) <= max(p.nbytes for p in model.parameters() if p.requires_grad)
    generated.clear()
    GPTModel(MEM_CONFIG, seed=2)  # eager: every weight drawn, the largest being a full embedding
    assert max(generated) == MEM_CONFIG.vocab_size * MEM_CONFIG.hidden_size * 4 and sum(generated) == full
    monkeypatch.undo()
    # 2. Measured: peak RSS growth of build (+ load of an fp32 base) in fresh processes.
    base = tmp_path / "base"
    Checkpointer([GPTModel(MEM_CONFIG, seed=1)], None, layout={"tp": 1, "pp": 1, "dp": 1, "vpp": 1},
                 coords={"tp": 0, "pp": 0, "dp": 0}, model_config=MEM_CONFIG.to_dict()).save(base, 1)
    ctx = mp.get_context("spawn")
    peaks = {}
    for mode in ("eager", "meta-bf16"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_measure, args=(mode, str(base), queue))
        proc.start()
        peaks[mode] = queue.get(timeout=300)
        proc.join(timeout=60)
        assert proc.exitcode == 0, mode
    (eager_build, eager_total), (meta_build, meta_total) = peaks["eager"], peaks["meta-bf16"]
    print(f"model {full / 2**20:.1f} MiB fp32; peak RSS growth: eager build {eager_build / 2**20:.1f} MiB, "
          f"+load {eager_total / 2**20:.1f} MiB; meta-bf16 build {meta_build / 2**20:.1f} MiB, "
          f"+load {meta_total / 2**20:.1f} MiB")
    assert eager_build > 0.9 * full, "the eager build holds the whole fp32 model"
    assert meta_build < 0.1 * full, "a meta build with a base to load touches (almost) no memory"
    # at this size the load's fixed costs (read threads and buffers, the fingerprint's 4 MiB tile) are ~45 MiB of
    # the meta build's ~80: a second copy of the bf16 model (+36 MiB) or an fp32 one (+72 MiB) crosses this line
    assert meta_total < 0.85 * eager_total, (meta_total, eager_total)


def test_frozen_bf16_linear_backward_is_the_fp32_product() -> None:
    """base_linear's CPU backward for a frozen bf16 weight (blocks of rows upcast to fp32, avoiding torch's
    slow bf16 layout) gives the input gradient of the same product; the frozen weight gets none."""
    from peftckpt.model.linear import base_linear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2500, 64, generator=gen).bfloat16()  # more rows than one backward block
    x = torch.randn(3, 5, 64, generator=gen, requires_grad=True)
    g = torch.randn(3, 5, 2500, generator=gen)
    y = base_linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), (x.bfloat16().float() @ w.float().T), rtol=1e-2, atol=1e-2)
    y.backward(g.bfloat16())
    expected = (g.bfloat16().float() @ w.float()).bfloat16().float()
    torch.testing.assert_close(x.grad, expected, rtol=1e-2, atol=1e-2)
    assert w.grad is None
