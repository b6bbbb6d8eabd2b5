"""Trainer <-> checkpoint library glue: flags, restore at start, periodic saves, format conversion."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..checkpoint.api import Checkpointer, LoadOptions, SaveOptions
from ..checkpoint.errors import CheckpointError, CheckpointFormatError, CheckpointNotFoundError
from ..checkpoint.save_lock import SaveDirInUseError, SaveDirLock, acquire_save_lock
from ..checkpoint.sections import DATA, ITERATION, MODEL, OPT_PARAM_SCHEDULER
from ..checkpoint.strictness import StrictHandling
from ..checkpoint.trainable import TORCH, TORCH_DIST

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = ["add_checkpoint_args", "validate_checkpoint_args", "check_checkpoint_paths", "load_base",
           "TrainerCheckpointing"]


def add_checkpoint_args(p: argparse.ArgumentParser) -> None:
    """Checkpoint flags (Megatron-LM names)."""
    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="directory to save checkpoints to")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    g.add_argument("--load", default=None, help="resume from the newest committed checkpoint of this directory")
    g.add_argument("--pretrained-checkpoint", default=None,
                   help="the base weights, loaded (model only) before --load: a full torch_dist checkpoint or an "
                   "HF Llama directory (config.json + safetensors, read per rank without conversion)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model weights from --load and start at iteration 0")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the RNG state")
    g.add_argument("--no-save-optim", action="store_true", help="do not save the optimizer state")
    g.add_argument("--no-save-rng", action="store_true", help="do not save the RNG state")
    g.add_argument("--ckpt-format", choices=[TORCH_DIST, TORCH], default=TORCH_DIST)
    g.add_argument("--ckpt-convert-format", choices=[TORCH_DIST, TORCH], default=None,
                   help="load --load, save it in this format to --ckpt-convert-save, then exit")
    g.add_argument("--ckpt-convert-save", default=None)
    g.add_argument("--dist-ckpt-strictness", choices=[m.value for m in StrictHandling],
                   default=StrictHandling.ASSUME_OK_UNEXPECTED.value)
    g.add_argument("--save-trainable-params-only", action="store_true",
                   help="save only parameters with requires_grad (the adapters) and their optimizer state")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="fail if --load holds no checkpoint instead of starting from scratch")
    g.add_argument("--no-verify-base", action="store_true",
                   help="load an adapter even if the base fingerprint differs from the one it was trained on")
    g.add_argument("--no-verify-checksums", action="store_true",
                   help="skip re-reading every checkpoint file to check its checksum before loading")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, if --save is set) when the iteration is a multiple of N")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background: training waits only for the copy to host memory")
    g.add_argument("--keep-last-k", type=int, default=None, help="keep only the newest K checkpoints in --save")


def validate_checkpoint_args(args: argparse.Namespace) -> None:
    """Refuse checkpoint flag combinations that cannot work."""
    from .args import ArgumentError

    if args.save_trainable_params_only and args.ckpt_format != TORCH_DIST:
        raise ArgumentError("--save-trainable-params-only needs --ckpt-format torch_dist (the legacy torch format "
                            "detaches tensors, losing requires_grad)")
    if args.save_interval is not None and (args.save_interval < 1 or not args.save):
        raise ArgumentError("--save-interval needs --save and a value >= 1")
    if args.ckpt_convert_format and not (args.load and args.ckpt_convert_save):
        raise ArgumentError("--ckpt-convert-format needs --load and --ckpt-convert-save")
    if args.ckpt_convert_save and not args.ckpt_convert_format:
        raise ArgumentError("--ckpt-convert-save needs --ckpt-convert-format")
    if args.exit_on_missing_checkpoint and not args.load:
        raise ArgumentError("--exit-on-missing-checkpoint needs --load")
    if args.finetune and not args.load:
        raise ArgumentError("--finetune needs --load")
    if args.async_save and args.ckpt_format != TORCH_DIST:
        raise ArgumentError("--async-save needs --ckpt-format torch_dist")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise ArgumentError(f"--exit-interval must be >= 1, got {args.exit_interval}")
    if args.keep_last_k is not None and args.keep_last_k < 1:
        raise ArgumentError(f"--keep-last-k must be >= 1, got {args.keep_last_k}")


def load_base(ckpt: Checkpointer, path: str, options: LoadOptions) -> str:
    """Load ``--pretrained-checkpoint`` into the model (collective): a torch_dist checkpoint, or an HF Llama
    directory read per rank (each rank reads only the bytes of its own pieces). Returns what was loaded."""
    from ..interop import HFModelDir, InteropError, is_hf_dir

    if not is_hf_dir(path):
        return str(ckpt.load_pretrained(path, options).path)
    try:
        hf = HFModelDir(path)
    except InteropError as e:
        raise CheckpointFormatError(f"--pretrained-checkpoint: {e}") from None
    shapes = {f"{MODEL}.{name}": shape for name, (shape, _) in hf.ours.items()}
    ckpt.load_base_tensors(f"--pretrained-checkpoint {path}", shapes,
                           lambda key, offsets, sizes: hf.read(key.removeprefix(f"{MODEL}."), offsets, sizes))
    return f"{path} (HF safetensors)"


def _save_dir_problem(flag: str, value: str) -> str | None:
    """Why ``value`` cannot become a save directory, or ``None``: it is a writable directory, or its nearest
    existing ancestor is one (the run lock creates it). Nothing is left behind by the check."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        return f"{flag} {value} is a file, not a directory"
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{flag} {value} is not a writable directory ({probe} is a file)"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".peftckpt-write-test."):
            pass
    except OSError as e:
        return f"{flag} {value} is not a writable directory ({e.strerror or e})"
    return None


def _read_dir_problem(flag: str, value: str, must_exist: bool) -> str | None:
    """Why ``value`` cannot be read as a checkpoint or save directory, or ``None``."""
    path = Path(value)
    if not path.exists():
        return f"{flag} {value} does not exist" if must_exist else None
    if not path.is_dir():
        return f"{flag} {value} is a file, not a checkpoint or save directory"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{flag} {value} is not readable"
    return None


def check_checkpoint_paths(args: argparse.Namespace, rank: int) -> SaveDirLock | None:
    """Before any model is built or any iteration runs (collective): every rank checks that ``--load`` and
    ``--pretrained-checkpoint`` are readable and that ``--save`` (and ``--ckpt-convert-save``) is, or can be
    created as, a writable directory; rank 0 then locks the save directory for the run's life (creating it; a
    run that ends without saving anything leaves no trace of it, see ``SaveDirLock.release``).

    Returns the lock (rank 0, with ``--save``), to release when the run ends.

    Raises (on every rank, with the same message):
        ArgumentError: a path flag that cannot work, naming the flag, the path and the rank(s).
        SaveDirInUseError: another live run holds the save directory.
    """
    from .args import ArgumentError

    problems = [p for p in (
        _read_dir_problem("--load", args.load, must_exist=False) if args.load else None,
        _read_dir_problem("--pretrained-checkpoint", args.pretrained_checkpoint, must_exist=True)
        if args.pretrained_checkpoint else None,
    ) if p is not None]
    if not problems:
        problems = [p for flag, v in (("--save", args.save), ("--ckpt-convert-save", args.ckpt_convert_save))
                    if v and (p := _save_dir_problem(flag, v)) is not None]
    found = _gather(problems)
    if any(found):
        lines = dict.fromkeys(p for ps in found for p in ps)
        ranks = [r for r, ps in enumerate(found) if ps]
        where = "" if len(found) == 1 else f" (seen by rank(s) {', '.join(map(str, ranks))})"
        raise ArgumentError("; ".join(lines) + where)
    lock: SaveDirLock | None = None
    error: tuple[bool, str] | None = None
    target = args.ckpt_convert_save if args.ckpt_convert_format else args.save
    if rank == 0 and target:
        try:
            lock = acquire_save_lock(target)
        except SaveDirInUseError as e:
            error = (True, str(e))
        except OSError as e:
            error = (False, f"cannot lock save directory {target}: {e.strerror or e}")
    errors = [e for e in _gather(error) if e]
    if errors:
        in_use, message = errors[0]
        refused = SaveDirInUseError(message) if in_use else CheckpointError(message)
        refused.every_rank = True
        raise refused
    return lock


def _gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class TrainerCheckpointing:
    """Restores a trainer at start and saves it during training, per the checkpoint flags."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.args = trainer.args
        m = trainer.meshes
        self.ckpt = Checkpointer(
            trainer.chunks, trainer.optimizer, layout=trainer.dims.to_dict(),
            coords={"tp": m.tp_rank, "pp": m.pp_rank, "dp": m.dp_rank}, model_config=trainer.config.to_dict(),
            adapter_config=None if trainer.lora is None else trainer.lora.to_dict(),
        )
        self.last_saved: int | None = None

    def _load_options(self, model_only: bool = False) -> LoadOptions:
        a = self.args
        return LoadOptions(load_optim=not (a.no_load_optim or a.finetune or model_only),
                           load_rng=not (a.no_load_rng or a.finetune or model_only),
                           strictness=StrictHandling(a.dist_ckpt_strictness),
                           verify_checksums=not a.no_verify_checksums, verify_base=not a.no_verify_base,
                           objects=() if model_only else (ITERATION, OPT_PARAM_SCHEDULER, DATA))

    def restore(self) -> None:
        """``--pretrained-checkpoint`` (model only), then ``--load`` (everything the flags allow)."""
        a, t = self.args, self.trainer
        if a.pretrained_checkpoint:
            start = time.perf_counter()
            where = load_base(self.ckpt, a.pretrained_checkpoint, self._load_options(model_only=True))
            t.logger.info(f"loaded base weights from {where} in {time.perf_counter() - start:.2f} s (trainable "
                          "tensors it does not hold, such as adapters, keep their initialisation)")
            if self.ckpt.base_fingerprint_wait_s is not None:
                t.logger.info(f"base fingerprint taken while reading the base; it added "
                              f"{self.ckpt.base_fingerprint_wait_s:.2f} s after the last read")
        if not a.load:
            return
        try:
            res = self.ckpt.load(a.load, self._load_options(), model_only=a.finetune)
        except CheckpointNotFoundError as e:
            if a.exit_on_missing_checkpoint:
                raise CheckpointError(f"--exit-on-missing-checkpoint: {e}") from None
            t.logger.info(f"no checkpoint in --load {a.load}; starting from scratch")
            return
        if a.finetune:
            t.logger.info(f"--finetune: loaded model weights from {res.path}; starting at iteration 0")
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
        t.logger.info(f"resumed from {res.path} at iteration {t.iteration}")

    def objects(self) -> dict[str, Any]:
        t = self.trainer
        return {ITERATION: t.iteration, OPT_PARAM_SCHEDULER: t.scheduler.state_dict(), DATA: t.sampler.state_dict()}

    def save(self, save_dir: str | None = None, ckpt_format: str | None = None) -> None:
        a, t = self.args, self.trainer
        target = save_dir or a.save
        assert target is not None
        options = SaveOptions(ckpt_format=ckpt_format or a.ckpt_format, trainable_only=a.save_trainable_params_only,
                              save_optim=not a.no_save_optim, save_rng=not a.no_save_rng, keep_last_k=a.keep_last_k,
                              async_save=a.async_save and save_dir is None)
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

    def convert(self) -> None:
        """``--ckpt-convert-format``: re-save what ``--load`` restored in the other format."""
        self.save(self.args.ckpt_convert_save, self.args.ckpt_convert_format)


def _json_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if isinstance(v, str | int | float | bool | list | type(None))}
