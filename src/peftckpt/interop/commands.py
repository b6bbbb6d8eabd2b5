"""The interop commands: ``import-hf``, ``export-hf``, ``export-peft``, ``import-peft`` (one process, no torchrun).

Each one validates everything before it writes: a refused input leaves nothing behind, exits 1 (2 for usage
errors) with one message naming the file, key or flag.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.api import Checkpointer, LoadOptions, SaveOptions
from ..checkpoint.errors import CheckpointError, CheckpointMismatchError
from ..checkpoint.fingerprint import fingerprint_version
from ..checkpoint.offline import OfflineCheckpoint, open_checkpoint
from ..model.config import GPTConfig, LoRAConfig
from ..model.gpt import GPTModel
from ..model.lora import apply_lora
from ..sharding.entries import LazyGlobalTensor
from .hf_dir import HFModelDir
from .hf_llama import InteropError, config_to_hf, hf_export_plan, write_hf_dir
from .peft import adapter_to_peft, is_adapter_name, peft_to_adapter, read_peft_dir, write_peft_dir

__all__ = ["import_hf_main", "export_hf_main", "export_peft_main", "import_peft_main", "import_hf", "export_hf",
           "export_peft", "import_peft"]

_SINGLE = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
_COORDS = {"tp": 0, "pp": 0, "dp": 0}


def _fresh_output(path: str | os.PathLike[str], flag: str) -> Path:
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InteropError(f"{flag} {out} already exists and is not an empty directory; nothing was written")
    return out


def _checkpointer(model: GPTModel, cfg: GPTConfig, lora: LoRAConfig | None) -> Checkpointer:
    return Checkpointer([model], None, layout=_SINGLE, coords=_COORDS, model_config=cfg.to_dict(),
                        adapter_config=None if lora is None else lora.to_dict())


# ----------------------------------------------------------------------------------------- import-hf
class _StreamedChunk(nn.Module):
    """A model chunk whose entries are produced tensor by tensor while they are written (see
    :class:`~peftckpt.sharding.entries.LazyGlobalTensor`): a save through it holds one tensor at a time."""

    def __init__(self, entries: dict[str, LazyGlobalTensor]):
        super().__init__()
        self._entries = entries

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return dict(self._entries)


@contextlib.contextmanager
def _output_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A new (or empty) output directory ``OUT`` that is removed again if the command fails: nothing
    half-written is left behind."""
    out = _fresh_output(path, "OUT")
    existed = out.exists()
    try:
        yield out
    except BaseException:
        if existed:
            for child in out.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        else:
            shutil.rmtree(out, ignore_errors=True)
        raise


def import_hf(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], dtype: torch.dtype | None = None) -> Path:
    """HF Llama directory -> a full ``torch_dist`` base checkpoint (iteration 0) in the save directory ``out``.

    Streams: the directory is validated from its headers first, then each of our tensors is assembled from
    the HF bytes as it is written, in the HF files' dtype (or ``dtype``); peak memory is a few tensors."""
    hf = HFModelDir(hf_dir)
    with _output_dir(out) as out_dir:
        entries = {name: LazyGlobalTensor(shape, dtype or src, functools.partial(_read_as, hf, name, dtype))
                   for name, (shape, src) in hf.ours.items()}
        args = {"source": "import-hf", "hf_dir": str(Path(hf_dir).absolute())}
        ckpt = Checkpointer([_StreamedChunk(entries)], None, layout=_SINGLE, coords=_COORDS,
                            model_config=hf.config.to_dict())
        try:
            return ckpt.save(out_dir, 0, {}, SaveOptions(save_optim=False, save_rng=False), args=args)
        finally:
            ckpt.close()


def _read_as(hf: HFModelDir, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    t = hf.read(name)
    return t if dtype is None else t.to(dtype)


# ---------------------------------------------------------------------------------------- import-peft
def import_peft(peft_dir: str | os.PathLike[str], out: str | os.PathLike[str], base: str | os.PathLike[str],
                verify_checksums: bool = True) -> Path:
    """PEFT LoRA adapter -> an adapter-only checkpoint (iteration 0, no optimizer state) for ``base``."""
    out_dir = _fresh_output(out, "OUT")
    base_ckpt = open_checkpoint(base, verify_checksums, what="--base")
    if base_ckpt.manifest.trainable_only:
        raise InteropError(f"--base {base_ckpt.path} is an adapter-only checkpoint; pass the full base "
                           "(e.g. made by import-hf)")
    cfg = GPTConfig.from_dict(base_ckpt.manifest.model_config)
    peft_config, peft_tensors = read_peft_dir(peft_dir)
    lora, adapter = peft_to_adapter(peft_tensors, peft_config, cfg, str(peft_dir))
    model = GPTModel(cfg)
    apply_lora([model], lora, seed=0)
    ckpt = _checkpointer(model, cfg, lora)
    ckpt.load_pretrained(base_ckpt.path, LoadOptions(verify_checksums=False))  # verified above
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in adapter.items():
            params[name].copy_(value)
    args = {"source": "import-peft", "peft_dir": str(Path(peft_dir).absolute()),
            "pretrained_checkpoint": str(base_ckpt.path)}
    return ckpt.save(out_dir, 0, {}, SaveOptions(trainable_only=True, save_optim=False, save_rng=False), args=args)


# --------------------------------------------------------------------------------------- exports
def _adapter_tensors(ckpt: OfflineCheckpoint) -> dict[str, torch.Tensor]:
    """The trainable model tensors of a checkpoint (all of an adapter-only one)."""
    trainable = [k.removeprefix("model.") for k, r in ckpt.manifest.saved_keys.items()
                 if k.startswith("model.") and r.get("requires_grad")]
    return ckpt.model_tensors(sorted(trainable))


def _lora_of(ckpt: OfflineCheckpoint, adapters: dict[str, torch.Tensor]) -> LoRAConfig:
    """The manifest's LoRA config, trusted only where it agrees with the stored ``adapters``' shapes."""
    if not ckpt.manifest.adapter_config:
        raise InteropError(f"checkpoint {ckpt.path} was not trained with LoRA (its manifest has no adapter_config)")
    try:
        lora = LoRAConfig.from_dict(ckpt.manifest.adapter_config)
    except (TypeError, ValueError) as e:
        raise InteropError(f"checkpoint {ckpt.path}: the manifest's adapter_config is invalid: {e}") from None
    wrong = [f"{k}: shape {list(v.shape)}" for k, v in sorted(adapters.items()) if is_adapter_name(k)
             and (v.ndim != 2 or v.shape[0 if k.rsplit(".", 1)[-1].startswith("lora_A") else 1] != lora.rank)]
    if wrong:
        raise InteropError(f"checkpoint {ckpt.path}: the manifest's adapter_config says rank {lora.rank}, but the "
                           "stored adapter tensors disagree:\n  " + "\n  ".join(wrong[:10])
                           + "\nthe manifest was altered or the checkpoint mixes two runs; nothing was written")
    return lora


def export_peft(ckpt_path: str | os.PathLike[str], out: str | os.PathLike[str],
                base_model_name_or_path: str | None = None, verify_checksums: bool = True) -> Path:
    """An adapter checkpoint (any layout; adapter-only or full) -> a PEFT LoRA adapter directory."""
    out_dir = _fresh_output(out, "OUT")
    ckpt = open_checkpoint(ckpt_path, verify_checksums)
    cfg = GPTConfig.from_dict(ckpt.manifest.model_config)
    adapters = _adapter_tensors(ckpt)
    tensors, config = adapter_to_peft(adapters, cfg, _lora_of(ckpt, adapters), base_model_name_or_path)
    write_peft_dir(out_dir, config, tensors)
    return out_dir


def _base_path(ckpt: OfflineCheckpoint, base: str | os.PathLike[str] | None) -> str:
    if base is not None:
        return str(base)
    recorded = ckpt.manifest.args.get("pretrained_checkpoint") if ckpt.manifest.args else None
    if not recorded or not Path(recorded).exists():
        where = f" (it was trained on {recorded}, which is not there)" if recorded else ""
        raise InteropError(f"checkpoint {ckpt.path} is adapter-only: pass the base it was trained on with "
                           f"--base{where}")
    return str(recorded)


def export_hf(ckpt_path: str | os.PathLike[str], out: str | os.PathLike[str], base: str | os.PathLike[str] | None = None,
              verify_base: bool = True, verify_checksums: bool = True,
              dtype: torch.dtype = torch.float32) -> Path:
    """A checkpoint (full, or adapter-only + its base) -> an HF Llama directory with the adapters merged.

    Streams: the adapters (small) are read first; then each base tensor is read, split into its HF
    projections, merged with its adapter delta (in float64) and written, one at a time."""
    ckpt = open_checkpoint(ckpt_path, verify_checksums)
    cfg = GPTConfig.from_dict(ckpt.manifest.model_config)
    hf_config = config_to_hf(cfg, dtype)
    sources = {k.removeprefix("model."): ckpt for k in ckpt.manifest.saved_keys if k.startswith("model.")}
    if ckpt.manifest.trainable_only:
        base_ckpt = open_checkpoint(_base_path(ckpt, base), verify_checksums, what="--base")
        if verify_base and ckpt.manifest.base_fingerprint:
            frozen = [k.removeprefix("model.") for k in ckpt.manifest.excluded_keys]
            have = {k.removeprefix("model.") for k in base_ckpt.manifest.saved_keys}
            version = fingerprint_version(ckpt.manifest.base_fingerprint)
            mine = base_ckpt.fingerprint(frozen, version) if have.issuperset(frozen) else "incomplete"
            if mine != ckpt.manifest.base_fingerprint:
                raise CheckpointMismatchError(
                    f"adapter checkpoint {ckpt.path} was trained on a different base than --base {base_ckpt.path}"
                    f" (fingerprint {ckpt.manifest.base_fingerprint} vs {mine}); --no-verify-base overrides")
        sources = {k.removeprefix("model."): base_ckpt for k in base_ckpt.manifest.saved_keys
                   if k.startswith("model.")} | sources
    adapter_names = sorted(k for k in sources if is_adapter_name(k))
    adapters = ckpt.model_tensors(adapter_names) if adapter_names else {}
    deltas: dict[str, torch.Tensor] = {}
    if adapters:
        lora = _lora_of(ckpt, adapters)
        peft_tensors, _ = adapter_to_peft(adapters, cfg, lora)
        for key, a in peft_tensors.items():
            if ".lora_A." in key:
                b = peft_tensors[key.replace(".lora_A.", ".lora_B.")]
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                deltas[f"{module}.weight"] = lora.scaling * (b.double() @ a.double())
    plan = hf_export_plan(cfg)
    missing = sorted(ours for ours, _ in plan if ours not in sources)
    if missing:
        raise InteropError(f"checkpoint {ckpt.path} lacks model tensor(s) {missing[:5]} that an HF Llama needs")
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for ours, split in plan:
        shape = sources[ours].manifest.saved_keys[f"model.{ours}"]["shape"]
        for name, part in split(torch.empty(shape, device="meta")):
            specs[name] = (dtype, tuple(part.shape))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for ours, split in plan:
            for name, w in split(sources[ours].model_tensors([ours])[ours]):
                if name in deltas:
                    w = (w.double() + deltas[name]).to(w.dtype)
                yield name, w.to(dtype)

    with _output_dir(out) as out_dir:
        write_hf_dir(out_dir, hf_config, specs, tensors())
    return out_dir


# ----------------------------------------------------------------------------------------------- CLI
def _run(prog: str, parser: argparse.ArgumentParser, argv: Sequence[str], action: Any) -> int:
    args = parser.parse_args(list(argv))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # DCP's single-process notices
            result = action(args)
    except (InteropError, CheckpointError) as e:
        print(f"peftckpt {prog}: error: {e}", file=sys.stderr)
        return 1
    print(result)
    return 0


def import_hf_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="peftckpt import-hf", description=(
        "Convert an HF Llama model directory (config.json + safetensors, sharded or not) into a full torch_dist "
        "base checkpoint, usable as --pretrained-checkpoint at any TP/PP. `train` reads the architecture from it."))
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("out", metavar="OUT", help="new save directory (must not exist or be empty)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="store the base in this dtype (default: each tensor's dtype in the HF files)")
    return _run("import-hf", p, argv, lambda a: (
        f"imported {a.hf_dir} -> {import_hf(a.hf_dir, a.out, getattr(torch, a.dtype) if a.dtype else None)}"))


def import_peft_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="peftckpt import-peft", description=(
        "Convert an HF PEFT LoRA adapter (targets among q/k/v/o/gate/up/down_proj) into an adapter-only "
        "checkpoint (iteration 0, per-projection adapters) that `train --load` resumes from."))
    p.add_argument("peft_dir", metavar="PEFT_DIR")
    p.add_argument("out", metavar="OUT", help="new save directory (must not exist or be empty)")
    p.add_argument("--base", required=True, help="the full base checkpoint the adapter belongs to (see import-hf)")
    p.add_argument("--no-verify-checksums", action="store_true")
    return _run("import-peft", p, argv, lambda a: (
        f"imported {a.peft_dir} -> {import_peft(a.peft_dir, a.out, a.base, not a.no_verify_checksums)}"))


def export_peft_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="peftckpt export-peft", description=(
        "Export the LoRA adapter of a checkpoint (saved at any layout) as an HF PEFT adapter directory "
        "(adapter_model.safetensors + adapter_config.json) for peft.PeftModel.from_pretrained."))
    p.add_argument("ckpt", metavar="CKPT", help="save directory or checkpoint directory")
    p.add_argument("out", metavar="OUT", help="new directory (must not exist or be empty)")
    p.add_argument("--base-model-name-or-path", default=None, help="recorded in adapter_config.json")
    p.add_argument("--no-verify-checksums", action="store_true")
    return _run("export-peft", p, argv, lambda a: (
        f"exported {export_peft(a.ckpt, a.out, a.base_model_name_or_path, not a.no_verify_checksums)}"))


def export_hf_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="peftckpt export-hf", description=(
        "Export a checkpoint as an HF Llama model directory, LoRA adapters merged into the weights. An "
        "adapter-only checkpoint needs its base (--base, default: the --pretrained-checkpoint it was trained on)."))
    p.add_argument("ckpt", metavar="CKPT", help="save directory or checkpoint directory")
    p.add_argument("out", metavar="OUT", help="new directory (must not exist or be empty)")
    p.add_argument("--base", default=None, help="full base checkpoint of an adapter-only CKPT")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--no-verify-base", action="store_true", help="merge even if the base fingerprint differs")
    p.add_argument("--no-verify-checksums", action="store_true")
    return _run("export-hf", p, argv, lambda a: (
        "exported " + str(export_hf(a.ckpt, a.out, a.base, not a.no_verify_base, not a.no_verify_checksums,
                                    getattr(torch, a.dtype)))))
