"""The reference trainer: GPT (+ LoRA) under TP x PP x DP, driven by ``peftckpt train`` flags.

One :class:`Trainer` per rank. It owns no process-group state beyond the meshes it builds from the
layout, and it talks to checkpoints only through :mod:`peftckpt.train.checkpointing`.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..model import nf4
from ..model.config import GPTConfig, LoRAConfig
from ..model.gpt import GPTModel, TransformerLayer, gpt_loss
from ..model.linear import ParallelLinear
from ..model.lora import apply_lora, cast_frozen
from ..parallel.data_parallel import allreduce_gradients, clip_grad_norm, shard_for_distributed_optimizer
from ..parallel.device import resolve_device
from ..parallel.dims import ParallelDims, stage_layer_numbers
from ..parallel.pipeline import PipelineRunner
from .args import ArgumentError, lora_config, model_config, parallel_dims
from .checkpointing import TrainerCheckpointing
from .data import GlobalBatchSampler, TokenDataset, build_datasets, dp_slice
from .interrupts import RunStopped, StopSignals
from .metrics import MetricsLogger, open_writers
from .schedule import OptimizerParamScheduler

__all__ = ["Trainer", "build_optimizer", "seed_everything"]


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and, if present, CUDA) RNGs."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def build_optimizer(params: list[tuple[str, nn.Parameter]], args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights and other vectors are not decayed)."""
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps)


class Trainer:
    """Builds the model chunks, optimizer, schedule and data of this rank, then trains.

    Steps of :meth:`__init__`:
        1. Layout -> meshes (``ParallelDims``), per-rank seeds.
        2. Model chunks for this rank's pipeline stages (global layer numbers) on the meta device, LoRA,
           ``--bf16`` (frozen parameters to bf16), then this rank's storage: every parameter is initialised,
           except the frozen ones when ``--pretrained-checkpoint`` is to fill them (:meth:`run` loads it;
           until then they hold no meaningful values). FSDP2 if requested.
        3. Optimizer over the trainable parameters only, LR schedule.
        4. Data: datasets, the deterministic global-batch sampler, the pipeline runner.
    """

    def __init__(self, args: argparse.Namespace, world_size: int = 1, rank: int = 0,
                 stop: StopSignals | None = None):
        self.args = args
        self.rank = rank
        self.distributed = world_size > 1
        self.stop = stop or StopSignals()
        """Signals asking the run to stop between iterations (``peftckpt train`` installs them)."""
        try:
            self.device = resolve_device(getattr(args, "device", "cpu"))
        except ValueError as e:
            raise ArgumentError(str(e)) from None
        if getattr(args, "deterministic", False):
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS needs
            torch.use_deterministic_algorithms(True)
        # 1. layout
        self.dims: ParallelDims = parallel_dims(args, world_size)
        self.meshes = self.dims.build(self.device.type)
        self.config: GPTConfig = model_config(args)
        self.lora: LoRAConfig | None = lora_config(args)
        self.reseed(0)
        # 2. model
        self.stage_ids = self.meshes.stage_ids()
        self.chunks: list[GPTModel] = [self._build_chunk(sid) for sid in self.stage_ids]
        if self.lora is not None:
            apply_lora(self.chunks, self.lora, args.seed)
            self._check_train_params()
        self.base_dtype = torch.bfloat16 if args.bf16 else torch.float32
        """dtype of the frozen parameters (trainable ones are fp32)."""
        self.base_quantization = getattr(args, "base_quantization", "none")
        """``nf4``: the frozen linear weights are held in NF4 once the base is in place (:meth:`quantize_base`)."""
        self.initialised = self._materialize()
        """Names of the parameters given their deterministic initial values (per chunk, concatenated)."""
        self.named_trainable = [(n, p) for c in self.chunks for n, p in c.named_parameters() if p.requires_grad]
        self.fsdp = args.use_distributed_optimizer and self.dims.dp > 1
        if self.fsdp:
            assert self.meshes.dp_mesh is not None
            # an NF4 base is held per TP shard on every DP rank (FSDP shards adapters, Adam and the rest)
            quantized = ({m.weight for m in self._linears().values() if not m.weight.requires_grad}
                         if self.base_quantization == "nf4" else None)
            shard_for_distributed_optimizer(self.chunks, self.meshes.dp_mesh, TransformerLayer, quantized)
            # FSDP2 replaced the parameters by sharded ones: look them up again.
            self.named_trainable = [(n, p) for c in self.chunks for n, p in c.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_trainable]
        # Tied embeddings with PP > 1: the first and the last stage each hold the table; their gradients are
        # summed over the two, and the last stage's copy is left out of the gradient norm (counted once).
        self.shared = [p for c in self.chunks if (p := c.shared_embedding()) is not None and p.requires_grad]
        tied = not self.config.untie_embeddings_and_output_weights
        self.embedding_group = self.meshes.embedding_group() if tied else None  # the same choice on every rank
        self.norm_skips = [p for c in self.chunks if not c.pre_process and (p := c.shared_embedding()) is not None]
        # 3. optimizer + schedule
        self.optimizer = build_optimizer(self.named_trainable, args)
        self.scheduler = OptimizerParamScheduler(self.optimizer, args.lr, args.min_lr, args.lr_warmup_iters,
                                                 args.lr_decay_iters, args.lr_decay_style)
        # 4. data + pipeline
        self.loss_fn = functools.partial(gpt_loss, tp=self.meshes.tp, vocab_size=self.config.vocab_size)
        """The mean loss of a last stage's logits (this rank's vocabulary rows with TP)."""
        self.train_data, self.eval_data = self._build_data()
        self.sampler = GlobalBatchSampler(self.train_data, args.global_batch_size, args.seed)
        self.num_microbatches = args.global_batch_size // (args.micro_batch_size * self.dims.dp)
        self.runner: PipelineRunner | None = None
        if self.dims.pp > 1:
            pp_group = self.meshes.group("pp")
            assert pp_group is not None
            self.runner = PipelineRunner(self.chunks, self.stage_ids, self.dims.num_stages, pp_group,
                                         self.num_microbatches, self.loss_fn, self.device)
        self.iteration = 0
        self.logger = MetricsLogger(args.metrics_file, args.log_interval, args.train_iters,
                                    progress=args.progress, enabled=rank == 0)
        self.losses: list[float] = []
        self.before_optimizer_step: Callable[[], None] = lambda: None
        """Called right before each optimizer step (the checkpointing sets it to its async snapshot's fence)."""

    # ----------------------------------------------------------------------------------------- setup
    def checkpoint_config(self) -> dict[str, Any]:
        """The model configuration checkpoints record: the architecture, and how the base is held when it is
        quantized (``base_quantization``, checked by every load of an adapter trained on it)."""
        config = self.config.to_dict()
        if self.base_quantization == "nf4":
            config["base_quantization"] = nf4.record()
        return config

    def _linears(self) -> dict[str, ParallelLinear]:
        """This rank's linear layers by the storage key of their weight (``model.<name>.weight``)."""
        return {f"model.{name}.weight": m for chunk in self.chunks for name, m in chunk.named_modules()
                if isinstance(m, ParallelLinear)}

    def quantize_base(self) -> int | None:
        """``--base-quantization nf4``: hold every frozen linear weight of this rank's chunks in NF4 from now on
        (collective over TP; call once the base is in place; those already quantized stay). Returns how many it
        quantized now (``None`` without ``--base-quantization``)."""
        if self.base_quantization != "nf4":
            return None
        todo = [m for m in self._linears().values() if m.nf4 is None]
        for module in todo:
            module.quantize_nf4()
        return len(todo)

    def hold_base_in_nf4(self) -> None:
        """For a base stored in NF4 (``import-hf --base-quantization nf4``): hold the frozen linear weights as
        their (uninitialised) NF4 parts, which the base's load then fills."""
        for module in self._linears().values():
            if not module.weight.requires_grad:
                module.hold_nf4()

    def base_quantizer(self) -> Callable[[str], None] | None:
        """For a base load that reads tensor by tensor: quantize each linear weight as soon as it is in place
        (its full-precision memory released before the next is read), so the full-precision base is never held
        whole; ``None`` without ``--base-quantization``."""
        if self.base_quantization != "nf4":
            return None
        linears = self._linears()

        def quantize(key: str) -> None:
            module = linears.get(key)
            if module is not None:
                module.quantize_nf4()

        return quantize

    def summary(self) -> str:
        """The run at a glance (printed at start): world and layout, model, and parameters -- total,
        trainable, frozen -- of the whole model, counted on a meta-device copy (nothing allocated), so every
        layout reports the same numbers."""
        c, d = self.config, self.dims
        whole = GPTModel(c, None, device="meta")
        if self.lora is not None:
            apply_lora([whole], self.lora, self.args.seed)
        total = sum(p.numel() for p in whole.parameters())
        trainable = sum(p.numel() for p in whole.parameters() if p.requires_grad)
        layout = f"TP {d.tp} x PP {d.pp}" + (f" (x {d.vpp} virtual)" if d.vpp > 1 else "") + f" x DP {d.dp}"
        if self.fsdp:
            layout += ", distributed optimizer"
        lora = ("full fine-tuning" if self.lora is None else
                f"LoRA rank {self.lora.rank} alpha {self.lora.alpha:g} on {' '.join(self.lora.target_modules)}")
        kv = f" ({c.groups} KV groups)" if c.groups != c.num_attention_heads else ""
        frozen_dtype = "bf16" if self.base_dtype == torch.bfloat16 else "fp32"
        if self.base_quantization == "nf4":
            frozen_dtype = f"linear weights NF4, the rest {frozen_dtype}"
        return (f"world {d.world_size}: {layout} on {self.device.type}; model: {c.num_layers} layers, hidden "
                f"{c.hidden_size}, {c.num_attention_heads} heads{kv}, vocab {c.vocab_size}, seq "
                f"{self.args.seq_length}; {lora}\n"
                f"parameters: {total:,} total, {trainable:,} trainable ({100 * trainable / max(1, total):.4f} %), "
                f"{total - trainable:,} frozen ({frozen_dtype})")

    def reseed(self, iteration: int) -> None:
        """Deterministic per-rank RNG seeds, equal across TP ranks: an activation every TP rank holds whole gets
        the same dropout mask on each, a sharded one each rank's slice of one shared draw
        (:func:`~peftckpt.model.linear.sharded_dropout`)."""
        seed_everything(self.args.seed + 100 * self.meshes.pp_rank + 10_000 * self.meshes.dp_rank
                        + 1_000_003 * iteration)

    def _build_chunk(self, stage: int) -> GPTModel:
        """One pipeline chunk on the meta device: shapes only, nothing allocated or drawn yet."""
        layers = stage_layer_numbers(self.config.num_layers, self.dims.num_stages, stage)
        return GPTModel(self.config, self.meshes.tp, layers, pre_process=stage == 0,
                        post_process=stage == self.dims.num_stages - 1, seed=self.args.seed, device="meta")

    def _materialize(self) -> list[str]:
        """Step 2's storage: frozen parameters in ``base_dtype`` (cast while still on the meta device, so the
        values are written once, in that dtype), then this rank's shards, then the initial values.

        With ``--pretrained-checkpoint`` the frozen parameters are left uninitialised: the load fills them,
        and it fails naming any frozen tensor the checkpoint lacks. Trainable parameters (adapters, and base
        parameters unfrozen by ``--lora-train-params`` or ``--lora-rank 0``) are always initialised; those the
        checkpoint holds are then overwritten by it, the others keep their initial values."""
        base_from_checkpoint = bool(self.args.pretrained_checkpoint)
        names: list[str] = []
        for chunk in self.chunks:
            if self.base_dtype != torch.float32:
                cast_frozen(chunk, self.base_dtype)
            names += chunk.materialize(self.device, lambda _, p: p.requires_grad or not base_from_checkpoint)
        return names

    def _check_train_params(self) -> None:
        assert self.lora is not None
        if not self.lora.train_params:
            return
        names = {n for c in self.chunks for n, _ in c.named_parameters()}
        found = torch.tensor([1 if n in names else 0 for n in self.lora.train_params])
        if self.distributed:
            dist.all_reduce(found)
        missing = [n for n, f in zip(self.lora.train_params, found.tolist()) if f == 0]
        if missing:
            raise ArgumentError(f"--lora-train-params: no parameter named {missing} in the model")

    def _build_data(self) -> tuple[TokenDataset, TokenDataset | None]:
        a = self.args
        try:
            return build_datasets(Path(a.data_path) if a.data_path else None, a.mock_data, a.seq_length,
                                  a.vocab_size, a.seed, a.eval_fraction)
        except ValueError as e:
            raise ArgumentError(str(e)) from None

    # ------------------------------------------------------------------------------------- one step
    def _reduce_loss(self, loss: torch.Tensor | None) -> float:
        """Mean loss over DP, from the last pipeline stage, on every rank."""
        # On the CPU (gloo), whatever the device: every rank takes part in the same all-reduce.
        value = torch.zeros((), dtype=torch.float64) if loss is None else loss.detach().double().cpu()
        if self.distributed:
            dist.all_reduce(value)
            value /= self.dims.tp * self.dims.dp
        return float(value)

    def forward_backward(self, batch: torch.Tensor) -> float:
        """Gradients of the mean loss over this rank's share of the global batch; returns the global loss."""
        local = dp_slice(batch, self.meshes.dp_rank, self.dims.dp).to(self.device)
        tokens, targets = local[:, :-1].contiguous(), local[:, 1:].contiguous()
        # No autocast: each layer computes in its weights' dtype (see peftckpt.model.linear); the loss is fp32.
        if self.runner is not None:
            loss = self.runner.train_step(tokens, targets)
        else:
            (model,) = self.chunks
            total = torch.zeros((), device=self.device)
            for tok, tgt in zip(tokens.chunk(self.num_microbatches), targets.chunk(self.num_microbatches)):
                mb_loss = self.loss_fn(model(tok), tgt) / self.num_microbatches
                mb_loss.backward()
                total += mb_loss.detach()
            loss = total
        if self.dims.dp > 1 and not self.fsdp:
            group = self.meshes.group("dp")
            assert group is not None
            allreduce_gradients(self.params, group, self.dims.dp)
        if self.shared:
            assert self.embedding_group is not None
            allreduce_gradients(self.shared, self.embedding_group, 1)  # a sum: each stage has its part
        return self._reduce_loss(loss)

    def train_step(self) -> tuple[float, float, float]:
        """One optimizer step on the next global batch: (loss, lr, grad norm before clipping)."""
        lr = self.scheduler.apply()
        batch = self.sampler.next_global_batch()
        loss = self.forward_backward(batch)
        grad_norm = clip_grad_norm(self.params, self.args.clip_grad, self.dims.tp * self.dims.dp,
                                   self.distributed, self.device, counted_elsewhere=self.norm_skips)
        self.before_optimizer_step()  # an async save's snapshot of the weights must be taken before they change
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.iteration += 1
        return loss, lr, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over ``--eval-iters`` fixed batches of the held-out split (``None`` without one)."""
        if self.eval_data is None or len(self.eval_data) == 0:
            return None
        sampler = GlobalBatchSampler(self.eval_data, self.args.global_batch_size, self.args.seed)
        return float(np.mean([self.eval_batch(sampler.next_global_batch()) for _ in range(self.args.eval_iters)]))

    @torch.no_grad()
    def eval_batch(self, batch: torch.Tensor) -> float:
        """Mean next-token loss of one global batch ``[global_batch, seq + 1]`` (forward only, in eval mode:
        no dropout, no random number drawn), on every rank."""
        for chunk in self.chunks:
            chunk.eval()
        try:
            return self._eval_batch(batch)
        finally:
            for chunk in self.chunks:
                chunk.train()

    def _eval_batch(self, batch: torch.Tensor) -> float:
        local = dp_slice(batch, self.meshes.dp_rank, self.dims.dp).to(self.device)
        tokens, targets = local[:, :-1].contiguous(), local[:, 1:].contiguous()
        if self.runner is not None:
            loss = self.runner.eval_step(tokens, targets)
        else:
            (model,) = self.chunks
            loss = torch.stack([self.loss_fn(model(t), g) for t, g in
                                zip(tokens.chunk(self.num_microbatches),
                                    targets.chunk(self.num_microbatches))]).mean()
        return self._reduce_loss(loss)

    # ----------------------------------------------------------------------------------------- loop
    def iterations(self) -> Iterator[tuple[int, float]]:
        """Train until ``--train-iters``, or until the ranks agree a signal stops the run (checked before
        every step: :attr:`stop`), yielding ``(iteration, loss)`` after each step."""
        a = self.args
        tokens_per_step = a.global_batch_size * a.seq_length
        while self.iteration < a.train_iters and self.stop.agreed() is None:
            t0 = time.perf_counter()
            loss, lr, grad_norm = self.train_step()
            dt = time.perf_counter() - t0
            self.losses.append(loss)
            self.logger.train(self.iteration, loss, lr, grad_norm, tokens_per_step / max(dt, 1e-9))
            if a.eval_interval and self.iteration % a.eval_interval == 0:
                eval_loss = self.evaluate()
                if eval_loss is not None:
                    self.logger.eval(self.iteration, eval_loss)
            yield self.iteration, loss

    def run(self) -> list[float]:
        """:meth:`_run`, the metrics also written to TensorBoard and W&B when asked (rank 0 opens them here),
        flushed and closed however the run ends: finished, stopped by a signal, or failed."""
        with self.logger.writing_to(open_writers(self.args) if self.rank == 0 else ()):
            return self._run()

    def _run(self) -> list[float]:
        """Restore (``--pretrained-checkpoint``, ``--load``), train with periodic saves, save at the end;
        or only convert a checkpoint (``--ckpt-convert-format``). Returns this run's per-iteration losses."""
        for note in getattr(self.args, "checkpoint_defaults", []):
            self.logger.info(note)
        if self.rank == 0:
            self.logger.info(self.summary())
        ckpt = TrainerCheckpointing(self)
        ckpt.restore()
        if self.args.ckpt_convert_format:
            ckpt.convert()
            ckpt.close()
            return []
        for iteration, _ in self.iterations():
            ckpt.maybe_save()
            if self.args.exit_interval and iteration % self.args.exit_interval == 0:
                break
        stop = self.stop.agreed()
        if stop is not None:
            message = ckpt.stop(stop)
            ckpt.close()
            raise RunStopped(message, stop.exit_code)
        ckpt.finish()
        if self.iteration < self.args.train_iters and self.rank == 0:  # --exit-interval ended the run
            self.logger.info(ckpt.where_to_resume(
                f"--exit-interval {self.args.exit_interval}: stopped at iteration {self.iteration} of "
                f"{self.args.train_iters}"))
        ckpt.close()
        return self.losses
