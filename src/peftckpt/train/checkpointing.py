"""Trainer <-> checkpoint library glue: restore at start, periodic saves, format conversion (the flags are in
:mod:`~peftckpt.train.checkpoint_flags`)."""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..checkpoint.api import Checkpointer, LoadOptions, SaveOptions
from ..checkpoint.checks.load_checks import QUANTIZATION_KEY
from ..checkpoint.checks.strictness import StrictHandling
from ..checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from ..checkpoint.location.locate import locate, manifest_at, tracker_at
from ..checkpoint.location.names import iteration_dirname
from ..checkpoint.options import LoadResult
from ..checkpoint.state.sections import DATA, ITERATION, MODEL, OPT_PARAM_SCHEDULER
from ..model.config import GPTConfig, LoRAConfig
from ..parallel.dims import ParallelDims, ParallelMeshes
from .data import GlobalBatchSampler
from .interrupts import Stop
from .metrics import MetricsLogger
from .schedule import OptimizerParamScheduler

__all__ = ["load_base", "TrainingRun", "TrainerCheckpointing"]


class TrainingRun(Protocol):
    """What the checkpoint glue reads from a trainer, and restores into it (the trainer implements it)."""

    iteration: int
    before_optimizer_step: Callable[[], None]
    """Called right before each optimizer step."""

    @property
    def args(self) -> argparse.Namespace: ...
    @property
    def chunks(self) -> Sequence[nn.Module]: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def dims(self) -> ParallelDims: ...
    @property
    def meshes(self) -> ParallelMeshes: ...
    @property
    def config(self) -> GPTConfig: ...
    @property
    def lora(self) -> LoRAConfig | None: ...
    @property
    def logger(self) -> MetricsLogger: ...
    @property
    def scheduler(self) -> OptimizerParamScheduler: ...
    @property
    def sampler(self) -> GlobalBatchSampler: ...
    def reseed(self, iteration: int) -> None: ...
    def checkpoint_config(self) -> dict[str, Any]: ...
    def quantize_base(self) -> int | None: ...
    def hold_base_in_nf4(self) -> None: ...
    def base_quantizer(self) -> Callable[[str], None] | None: ...


def load_base(ckpt: Checkpointer, path: str, options: LoadOptions, then: Callable[[str], None] | None = None) -> str:
    """Load ``--pretrained-checkpoint`` into the model (collective): a torch_dist checkpoint, or an HF Llama
    directory read per rank (each rank reads only the bytes of its own pieces); ``then(key)`` after each tensor,
    see :meth:`Checkpointer.load_base_tensors`. Returns what was loaded."""
    from ..interop import HFModelDir, InteropError, is_hf_dir
    from ..interop.hf_dir import hf_file

    if not is_hf_dir(path):
        return described(ckpt.load_pretrained(path, options, then))
    location = locate(path, "--pretrained-checkpoint")
    with location.foreign_files(ckpt.comm, hf_file, options.base_cache) as (held, cached):  # (a store: the copy)
        try:
            hf = HFModelDir(held, shown_as=location)
        except InteropError as e:
            raise CheckpointFormatError(f"--pretrained-checkpoint: {e}") from None
        shapes = {f"{MODEL}.{name}": shape for name, (shape, _) in hf.ours.items()}
        ckpt.load_base_tensors(f"--pretrained-checkpoint {path}", shapes,
                               lambda key, offsets, sizes: hf.read(key.removeprefix(f"{MODEL}."), offsets, sizes),
                               lambda key, offsets, out: hf.read_into(key.removeprefix(f"{MODEL}."), offsets, out),
                               then)
    fetched = hf.bytes_fetched
    how = "" if cached is None and fetched is None else \
        f"; {'read from' if cached else 'fetched whole into'} the host's base cache" if cached is not None else \
        f"; rank 0 fetched {fetched:,} bytes by ranged reads"
    return f"{path} (HF safetensors{how})"


def described(result: LoadResult) -> str:
    """The checkpoint a load read, and how it came from a store: the host's base cache, or ranged reads."""
    if result.cache_hit is not None:
        return f"{result.path} ({'read from' if result.cache_hit else 'fetched whole into'} the host's base cache)"
    if result.bytes_fetched is None:
        return str(result.path)
    return f"{result.path} ({fetched(result)})"


def fetched(result: LoadResult) -> str:
    """What a load fetched from a store, as the log says it ("" when it read a directory)."""
    return "" if result.bytes_fetched is None else \
        f"rank 0 fetched {result.bytes_fetched:,} bytes by ranged reads"


class TrainerCheckpointing:
    """Restores a trainer at start and saves it during training, per the checkpoint flags."""

    def __init__(self, trainer: TrainingRun):
        self.trainer = trainer
        self.args = trainer.args
        m = trainer.meshes
        self.ckpt = Checkpointer(
            trainer.chunks, trainer.optimizer, layout=trainer.dims.to_dict(),
            coords={"tp": m.tp_rank, "pp": m.pp_rank, "dp": m.dp_rank}, model_config=trainer.checkpoint_config(),
            adapter_config=None if trainer.lora is None else trainer.lora.to_dict(),
        )
        self.last_saved: int | None = None
        self.base_stored_in_nf4 = False
        """Whether ``--pretrained-checkpoint`` holds its linear weights in NF4 (read as stored, not quantized)."""
        # An async save copies what training updates during the next forward/backward; the optimizer step
        # waits for that copy (at once when it is done, or when no save is in flight).
        trainer.before_optimizer_step = self.ckpt.snapshot_fence

    def _load_options(self, model_only: bool = False) -> LoadOptions:
        a = self.args
        return LoadOptions(load_optim=not (a.no_load_optim or a.finetune or model_only),
                           load_rng=not (a.no_load_rng or a.finetune or model_only),
                           strictness=StrictHandling(a.dist_ckpt_strictness),
                           verify_checksums=not a.no_verify_checksums, verify_base=not a.no_verify_base,
                           base_cache=not a.no_base_cache, objects=() if model_only else (ITERATION, OPT_PARAM_SCHEDULER, DATA))

    def _refuse_a_base_as_load(self) -> None:
        """A LoRA run given a checkpoint without adapters as ``--load`` (the base, or a run without LoRA) would
        "resume" at that checkpoint's iteration, schedule and data position with fresh adapters: refused on every
        rank, naming ``--pretrained-checkpoint`` (``--finetune`` takes only its weights, and is left alone)."""
        a = self.args
        if self.trainer.lora is None or a.finetune:
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                manifest = manifest_at(a.load)
        except CheckpointError:
            return  # the load itself says what is wrong with it
        if manifest.adapter_config is None and not manifest.trainable_only:
            refused = CheckpointMismatchError(
                f"--load {a.load} is a checkpoint without adapters (a base, or a run without LoRA; iteration "
                f"{manifest.iteration}): a LoRA run resumed from it would restart at its iteration, learning-rate "
                f"schedule and data position. Pass it as --pretrained-checkpoint {a.load}, and give --load the "
                "LoRA run's own --save (or --finetune to start from its weights at iteration 0)")
            refused.every_rank = True
            raise refused

    def load_base(self, path: str, options: LoadOptions) -> str:
        """Load ``--pretrained-checkpoint`` ``path`` (collective; :func:`load_base`) held as ``--base-quantization``
        says: a full-precision base (an HF directory or a torch_dist checkpoint) quantized tensor by tensor as it
        is read, one stored in NF4 read as it is stored. Returns what was loaded."""
        t = self.trainer
        self.base_stored_in_nf4 = self._base_stored_in_nf4(path)
        if self.base_stored_in_nf4:
            t.hold_base_in_nf4()  # the load fills the NF4 parts
        return load_base(self.ckpt, path, options, None if self.base_stored_in_nf4 else t.base_quantizer())

    def _base_stored_in_nf4(self, path: str) -> bool:
        """Whether ``--pretrained-checkpoint`` is a torch_dist base that holds its linear weights in NF4 (made by
        ``import-hf --base-quantization nf4``); refused, on every rank, unless this run holds its base that way."""
        from ..interop import is_hf_dir
        from ..interop.nf4_base import is_nf4

        if is_hf_dir(path):
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                stored = manifest_at(path).model_config
        except CheckpointError:
            return False  # the load itself says what is wrong with it
        if not is_nf4(stored):
            return False
        held = self.trainer.checkpoint_config().get(QUANTIZATION_KEY)
        if held != stored[QUANTIZATION_KEY]:
            refused = CheckpointMismatchError(
                f"--pretrained-checkpoint {path} holds its linear weights in NF4 ({stored[QUANTIZATION_KEY]}, made "
                f"by import-hf --base-quantization nf4); this run holds them "
                f"{'in full precision' if held is None else held}: pass --base-quantization nf4, or use the "
                "full-precision base")
            refused.every_rank = True
            raise refused
        return True

    def restore(self) -> None:
        """``--pretrained-checkpoint`` (model only), then ``--load`` (everything the flags allow)."""
        a, t = self.args, self.trainer
        if a.pretrained_checkpoint:
            start = time.perf_counter()
            where = self.load_base(a.pretrained_checkpoint, self._load_options(model_only=True))
            t.logger.info(f"loaded base weights from {where} in {time.perf_counter() - start:.2f} s (trainable "
                          "tensors it does not hold, such as adapters, keep their initialisation)")
            if self.ckpt.base_fingerprint_wait_s is not None:
                t.logger.info(f"base fingerprint taken while reading the base; it added "
                              f"{self.ckpt.base_fingerprint_wait_s:.2f} s after the last read")
        self.quantize_base()
        if not a.load:
            return
        self._refuse_a_base_as_load()
        try:
            res = self.ckpt.load(a.load, self._load_options(), model_only=a.finetune)
        except CheckpointNotFoundError as e:
            if a.exit_on_missing_checkpoint:
                missing = CheckpointError(f"--exit-on-missing-checkpoint: {e}")
                missing.every_rank = e.every_rank  # an agreed error stays agreed: said once
                raise missing from None
            said = "does not exist" if locate(a.load, "--load").known_missing() else "holds no committed checkpoint"
            t.logger.info(f"--load {a.load} {said}; starting from scratch (--exit-on-missing-checkpoint makes "
                          "this an error)")
            return
        if a.finetune:
            t.logger.info(f"--finetune: loaded model weights from {described(res)}; starting at iteration 0")
            return
        objs = res.objects
        t.iteration = int(objs.get(ITERATION, res.iteration))
        if OPT_PARAM_SCHEDULER in objs:
            t.scheduler.load_state_dict(objs[OPT_PARAM_SCHEDULER])
        else:
            t.scheduler.num_steps = t.iteration
        if DATA in objs:
            t.sampler.load_state_dict(objs[DATA])
        else:
            t.sampler.consumed_samples = t.iteration * a.global_batch_size
        if not res.rng_restored:
            t.reseed(t.iteration)
        t.logger.info(f"resumed from {res.path} at iteration {t.iteration}"
                      + (f" ({fetched(res)})" if res.bytes_fetched is not None else ""))

    def quantize_base(self) -> None:
        """``--base-quantization nf4``: the base, now in place (loaded or initialised), held in NF4 from here on;
        checkpoints fingerprint the quantized base they train on."""
        start = time.perf_counter()
        now = self.trainer.quantize_base()
        if now is None:
            return
        if now:
            self.ckpt.base_changed()
        said = (f"{now} linear weights quantized to NF4 in {time.perf_counter() - start:.2f} s" if now else
                "base linear weights read in NF4, as stored" if self.base_stored_in_nf4 else
                "base linear weights quantized to NF4 as they were read")
        self.trainer.logger.info(said)

    def objects(self) -> dict[str, Any]:
        t = self.trainer
        return {ITERATION: t.iteration, OPT_PARAM_SCHEDULER: t.scheduler.state_dict(), DATA: t.sampler.state_dict()}

    def save(self, save_dir: str | None = None, ckpt_format: str | None = None) -> None:
        a, t = self.args, self.trainer
        target = save_dir or a.save
        assert target is not None
        options = SaveOptions(ckpt_format=ckpt_format or a.ckpt_format, trainable_only=a.save_trainable_params_only,
                              save_optim=not a.no_save_optim, save_rng=not a.no_save_rng, keep_last_k=a.keep_last_k,
                              async_save=a.async_save and save_dir is None,
                              defer_snapshot=a.async_save and save_dir is None)
        start = time.perf_counter()
        path = self.ckpt.save(target, t.iteration, self.objects(), options, args=_json_args(a))
        blocked = time.perf_counter() - start
        self.last_saved = t.iteration
        if self.ckpt.save_in_flight:
            t.logger.info(f"saving checkpoint {path} in the background (training blocked {blocked:.3f} s)")
        else:
            t.logger.info(f"saved checkpoint {path} ({blocked:.3f} s)")

    def maybe_save(self) -> None:
        a = self.args
        if self.ckpt.save_in_flight and self.ckpt.poll():
            self.trainer.logger.info("background checkpoint committed")
        if a.save and a.save_interval and self.trainer.iteration % a.save_interval == 0:
            self.save()

    def finish(self) -> None:
        """Save the final state (if not just saved) and wait for any background save to commit."""
        if self.args.save and self.last_saved != self.trainer.iteration:
            self.save()
        self.ckpt.wait()

    def stop(self, stop: Stop) -> str:
        """After the ranks agreed to stop on a signal: save first if the signal asks for it (and this iteration
        is not saved yet), let a save in flight commit, and say where the run can resume from."""
        t = self.trainer
        if stop.save:
            self.finish()  # --exit-signal-handler requires --save
        else:
            self.ckpt.wait()
        return self.where_to_resume(
            f"{'stopped by' if stop.save else 'interrupted by'} {stop.name} at iteration {t.iteration}")

    def where_to_resume(self, said: str) -> str:
        """``said`` (why the run ended early), then what is committed to resume from and how."""
        a = self.args
        if not a.save:
            return f"{said}; nothing was saved (no --save)"
        last = tracker_at(a.save)
        if last is None:
            return f"{said}; no checkpoint is committed in --save {a.save} yet"
        where = locate(a.save, "--save").describe(iteration_dirname(last))
        return (f"{said}; last committed checkpoint: {where}; "
                "rerun the same command to resume")

    def close(self) -> None:
        """Commit a save still in flight and drop the checkpointer's references to the run lock (collective;
        on an object store the last reference deletes the lease object, see ``store_lease``)."""
        self.ckpt.close()

    def convert(self) -> None:
        """``--ckpt-convert-format``: re-save what ``--load`` restored in the other format."""
        self.save(self.args.ckpt_convert_save, self.args.ckpt_convert_format)


def _json_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | list | type(None))}
