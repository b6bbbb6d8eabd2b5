"""The interop operations behind ``import-hf``, ``export-hf``, ``export-peft``, ``import-peft`` (one process, no
torchrun; their command lines are in :mod:`peftckpt.cli.interop`).

Each one validates everything before it writes: a refused input leaves nothing behind, exits 1 (2 for usage
errors) with one message naming the file, key or flag.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.api import Checkpointer, SaveOptions
from ..checkpoint.checks.load_checks import QUANTIZATION_KEY
from ..checkpoint.errors import CheckpointError, CheckpointMismatchError
from ..checkpoint.location.directory import Directory
from ..checkpoint.location.locate import locate, manifest_at
from ..checkpoint.location.urls import local_only_problem
from ..checkpoint.state.fingerprint import fingerprint_version, tensor_sums
from ..checkpoint.state.sections import MODEL, dcp_key
from ..checkpoint.tools.offline import (
    OfflineCheckpoint,
    TensorSource,
    lazy_entries,
    lazy_fingerprint,
    open_checkpoint,
)
from ..model import nf4
from ..model.config import GPTConfig, LoRAConfig
from ..model.gpt import GPTModel
from ..model.linear import ParallelLinear
from ..model.lora import apply_lora
from ..sharding.entries import GlobalTensor, LazyGlobalTensor, global_tensor_of
from .architecture import checked_manifest
from .hf_dir import HFModelDir, is_hf_dir
from .hf_llama import InteropError, config_to_hf, hf_export_plan, write_hf_dir
from .nf4_base import NF4Base, is_nf4
from .peft import adapter_to_peft, is_adapter_name, peft_to_adapter, read_peft_dir, write_peft_dir

__all__ = ["import_hf", "export_hf", "export_peft", "import_peft"]

_SINGLE = {"tp": 1, "pp": 1, "dp": 1, "vpp": 1}
_COORDS = {"tp": 0, "pp": 0, "dp": 0}


def _fresh_output(path: str | os.PathLike[str], flag: str) -> Path:
    """A new (or empty) local output directory ``path`` (refused, naming ``flag``, otherwise)."""
    problem = local_only_problem(path)
    if problem is None:
        problem = Directory(path).new_output_problem(flag)
    if problem is not None:
        raise InteropError(f"{problem if problem.startswith(flag) else f'{flag} {path} {problem}'}; nothing was written")
    return Path(path)


# ----------------------------------------------------------------------------------------- import-hf
class _StreamedChunk(nn.Module):
    """A model chunk made of prebuilt entries, lazy ones produced tensor by tensor while they are written or
    fingerprinted (see :class:`~peftckpt.sharding.entries.LazyGlobalTensor`): it never holds the base."""

    def __init__(self, entries: Mapping[str, GlobalTensor]):
        super().__init__()
        self._entries = dict(entries)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return dict(self._entries)


@contextlib.contextmanager
def _output_dir(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A new (or empty) local output directory ``OUT`` that is removed again if the command fails: nothing
    half-written is left behind."""
    _fresh_output(path, "OUT")
    with Directory(path).as_new_output("OUT") as out:
        yield Path(out)


@contextlib.contextmanager
def _checkpoint_output(path: str | os.PathLike[str]) -> Iterator[Path | str]:
    """An import's save location ``OUT``: a new or empty local directory, or a location on an object store that
    holds nothing yet; what the import wrote is deleted again if it fails."""
    with locate(path, "OUT").as_new_output("OUT") as out:
        yield out


def import_hf(hf_dir: str | os.PathLike[str], out: str | os.PathLike[str], dtype: torch.dtype | None = None,
              base_quantization: str = "none") -> Path | str:
    """HF Llama directory -> a full ``torch_dist`` base checkpoint (iteration 0) in the save directory ``out``.

    Streams: the directory is validated from its headers first, then each of our tensors is assembled from
    the HF bytes as it is written, in the HF files' dtype (or ``dtype``); peak memory is a few tensors.
    ``base_quantization="nf4"``: the linear weights are stored as their NF4 parts (each quantized, after the cast
    to ``dtype``, as it is written), exactly what a QLoRA run quantizing the full-precision base holds
    (:mod:`~peftckpt.model.nf4` does not depend on the layout), for ``train --base-quantization nf4``."""
    hf = HFModelDir(hf_dir)
    model_config = hf.config.to_dict()
    source: HFModelDir | NF4Base = hf
    if base_quantization == "nf4":
        source = NF4Base(hf, _nf4_linears(hf), dtype)
        model_config[QUANTIZATION_KEY] = nf4.record()
    with _checkpoint_output(out) as out_dir:
        sums: dict[str, list[int]] = {}  # each tensor's fingerprint sums, taken as it is written
        entries = {name: LazyGlobalTensor(shape, held if NF4Base.is_part(name) else dtype or held,
                                          functools.partial(_read_summed, source, name, dtype, sums))
                   for name, (shape, held) in source.model_shapes().items()}
        args = {"source": "import-hf", "hf_dir": str(Path(hf_dir).absolute())}
        ckpt = Checkpointer([_StreamedChunk(entries)], None, layout=_SINGLE, coords=_COORDS, model_config=model_config)
        ckpt.parts.base_sums = sums  # recorded by the save: a load of the base verifies its bytes, not sums them
        try:
            return ckpt.save(out_dir, 0, {}, SaveOptions(save_optim=False, save_rng=False), args=args)
        finally:
            ckpt.close()


def _nf4_linears(hf: HFModelDir) -> list[str]:
    """The weights a QLoRA run holds in NF4 (every linear layer's; not the embeddings, norms or output layer), each
    checked to be whole NF4 blocks (refused, naming the flag, before anything is written)."""
    model = GPTModel(hf.config, None, device="meta")
    linears = [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, ParallelLinear)]
    for name in linears:
        columns = hf.ours[name][0][1]
        problem = nf4.shard_problem(columns, 0, columns)
        if problem is not None:
            raise InteropError(f"--base-quantization nf4: {hf.path} {name}: {problem}; nothing was written")
    return linears


def _read_summed(source: HFModelDir | NF4Base, name: str, dtype: torch.dtype | None, sums: dict[str, list[int]]
                 ) -> torch.Tensor:
    """:func:`_read_as`, its fingerprint sums put in ``sums`` under its checkpoint key."""
    tensor = _read_as(source, name, dtype)
    sums[dcp_key(MODEL, name)] = tensor_sums(tensor)
    return tensor


def _read_as(source: HFModelDir | NF4Base, name: str, dtype: torch.dtype | None) -> torch.Tensor:
    t = source.model_tensors([name])[name]
    return t if dtype is None or NF4Base.is_part(name) else t.to(dtype)


# ---------------------------------------------------------------------------------------- import-peft
def _open_base(path: str | os.PathLike[str], verify_checksums: bool) -> HFModelDir | OfflineCheckpoint:
    """``--base``: an HF Llama directory, or a full torch_dist checkpoint (an adapter-only one is refused)."""
    if is_hf_dir(path):
        return HFModelDir(path)
    base = open_checkpoint(path, verify_checksums, what="--base")
    if not base.manifest.holds_every_weight:
        raise InteropError(f"--base {base.where} is an adapter-only checkpoint; pass the full base "
                           "(an HF directory, or a checkpoint made by import-hf)")
    return base


def _where(base: HFModelDir | OfflineCheckpoint) -> str:
    return base.where if isinstance(base, OfflineCheckpoint) else base.shown


def _config_of(base: HFModelDir | OfflineCheckpoint) -> GPTConfig:
    return base.config if isinstance(base, HFModelDir) else checked_config(base)


def checked_config(ckpt: OfflineCheckpoint) -> GPTConfig:
    """The architecture of a checkpoint's manifest, once it is held to the tensors the checkpoint stores (a
    manifest claiming a bigger model is refused before anything is sized by it)."""
    checked_manifest(ckpt.path if ckpt.files is None else ckpt.where)  # (a store's data objects stay there)
    try:
        return GPTConfig.from_dict(ckpt.manifest.model_config)
    except (TypeError, ValueError) as e:
        raise InteropError(f"checkpoint {ckpt.where}: the manifest's model_config is invalid: {e}") from None


def import_peft(peft_dir: str | os.PathLike[str], out: str | os.PathLike[str], base: str | os.PathLike[str],
                verify_checksums: bool = True) -> Path | str:
    """PEFT LoRA adapter -> an adapter-only checkpoint (iteration 0, no optimizer state) for ``base``.

    Streams: the checkpoint holds the adapter; the base (an HF directory or a full checkpoint) is only read,
    one tensor at a time, for the fingerprint the checkpoint records."""
    base_src = _open_base(base, verify_checksums)
    cfg = _config_of(base_src)
    peft_config, peft_tensors = read_peft_dir(peft_dir)
    lora, adapter = peft_to_adapter(peft_tensors, peft_config, cfg, str(peft_dir))
    model = GPTModel(cfg, device="meta")  # names and shapes only: what training with this adapter holds
    apply_lora([model], lora, seed=0)
    expected = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    got = {n: tuple(t.shape) for n, t in adapter.items()}
    if got != expected:
        raise InteropError(f"{peft_dir}: the adapter's tensors {sorted(set(got) ^ set(expected))[:5]} do not match "
                           "the LoRA layers its config describes on this base")
    frozen = sorted(n for n, _ in model.named_parameters() if n not in expected)
    entries: dict[str, GlobalTensor] = {k.removeprefix("model."): v for k, v in lazy_entries(base_src, frozen).items()}
    entries |= {n: global_tensor_of(t, requires_grad=True) for n, t in adapter.items()}
    args = {"source": "import-peft", "peft_dir": str(Path(peft_dir).absolute()),
            "pretrained_checkpoint": _where(base_src)}
    with _checkpoint_output(out) as out_dir:
        ckpt = Checkpointer([_StreamedChunk(entries)], None, layout=_SINGLE, coords=_COORDS,
                            model_config=cfg.to_dict(), adapter_config=lora.to_dict())
        try:
            return ckpt.save(out_dir, 0, {}, SaveOptions(trainable_only=True, save_optim=False, save_rng=False),
                             args=args)
        finally:
            ckpt.close()


# --------------------------------------------------------------------------------------- exports
def _adapter_tensors(ckpt: OfflineCheckpoint) -> dict[str, torch.Tensor]:
    """The trainable model tensors of a checkpoint (all of an adapter-only one)."""
    trainable = [k.removeprefix("model.") for k, r in ckpt.manifest.saved_keys.items()
                 if k.startswith("model.") and r.get("requires_grad")]
    return ckpt.model_tensors(sorted(trainable))


def _lora_of(ckpt: OfflineCheckpoint, adapters: dict[str, torch.Tensor]) -> LoRAConfig:
    """The manifest's LoRA config, trusted only where it agrees with the stored ``adapters``' shapes."""
    if not ckpt.manifest.adapter_config:
        raise InteropError(f"checkpoint {ckpt.where} was not trained with LoRA (its manifest has no adapter_config)")
    try:
        lora = LoRAConfig.from_dict(ckpt.manifest.adapter_config)
    except (TypeError, ValueError) as e:
        raise InteropError(f"checkpoint {ckpt.where}: the manifest's adapter_config is invalid: {e}") from None
    wrong = [f"{k}: shape {list(v.shape)}" for k, v in sorted(adapters.items()) if is_adapter_name(k)
             and (v.ndim != 2 or v.shape[0 if k.rsplit(".", 1)[-1].startswith("lora_A") else 1] != lora.rank)]
    if wrong:
        raise InteropError(f"checkpoint {ckpt.where}: the manifest's adapter_config says rank {lora.rank}, but the "
                           "stored adapter tensors disagree:\n  " + "\n  ".join(wrong[:10])
                           + "\nthe manifest was altered or the checkpoint mixes two runs; nothing was written")
    return lora


def export_peft(ckpt_path: str | os.PathLike[str], out: str | os.PathLike[str],
                base_model_name_or_path: str | None = None, verify_checksums: bool = True) -> Path:
    """An adapter checkpoint (any layout; adapter-only or full) -> a PEFT LoRA adapter directory."""
    out_dir = _fresh_output(out, "OUT")
    ckpt = open_checkpoint(ckpt_path, verify_checksums)
    cfg = checked_config(ckpt)
    adapters = _adapter_tensors(ckpt)
    tensors, config = adapter_to_peft(adapters, cfg, _lora_of(ckpt, adapters),
                                      base_model_name_or_path or base_name_of(ckpt))
    write_peft_dir(out_dir, config, tensors)
    return out_dir


def base_name_of(ckpt: OfflineCheckpoint) -> str | None:
    """The HF name or path of the base an adapter checkpoint was trained on, where its records say: the
    trainer's ``--pretrained-checkpoint`` when that is an HF directory, or the HF directory that base was
    imported from (``import-hf`` records it)."""
    pretrained = ckpt.manifest.args.get("pretrained_checkpoint")
    if not isinstance(pretrained, str) or not pretrained:
        return None
    if is_hf_dir(pretrained):
        return str(Path(pretrained).absolute())
    try:
        base_args = manifest_at(pretrained).args
    except (CheckpointError, OSError):
        return None
    hf_dir = base_args.get("hf_dir")
    return hf_dir if base_args.get("source") == "import-hf" and isinstance(hf_dir, str) else None


def _base_path(ckpt: OfflineCheckpoint, base: str | os.PathLike[str] | None) -> str:
    if base is not None:
        return str(base)
    recorded = ckpt.manifest.args.get("pretrained_checkpoint") if ckpt.manifest.args else None
    if not recorded or locate(recorded, "--base").known_missing():
        where = f" (it was trained on {recorded}, which is not there)" if recorded else ""
        raise InteropError(f"checkpoint {ckpt.where} is adapter-only: pass the base it was trained on with "
                           f"--base{where}")
    return str(recorded)


def _full_precision(base: HFModelDir | OfflineCheckpoint, report: list[str] | None) -> HFModelDir | OfflineCheckpoint:
    """``--base`` with its linear weights in full precision, to merge into: a base stored in NF4 (``import-hf
    --base-quantization nf4``) is replaced by the HF directory it was imported from (which the fingerprint check
    then quantizes), or refused."""
    if isinstance(base, HFModelDir) or not is_nf4(base.manifest.model_config):
        return base
    args = base.manifest.args or {}
    hf_dir = args.get("hf_dir") if args.get("source") == "import-hf" else None
    if not isinstance(hf_dir, str) or not is_hf_dir(hf_dir):
        raise InteropError(f"--base {base.where} holds its linear weights in NF4 only, and export-hf merges the "
                           "adapter into full-precision weights: pass the HF directory it was imported from as --base")
    if report is not None:
        report.append(f"--base {base.where} holds its linear weights in NF4: merging into the full-precision weights "
                      f"of {hf_dir}, which it was imported from")
    return HFModelDir(hf_dir)


def export_hf(ckpt_path: str | os.PathLike[str], out: str | os.PathLike[str], base: str | os.PathLike[str] | None = None,
              verify_base: bool = True, verify_checksums: bool = True,
              dtype: torch.dtype = torch.float32, report: list[str] | None = None) -> Path:
    """A checkpoint (full, or adapter-only + its base) -> an HF Llama directory with the adapters merged.

    Streams: the adapters (small) are read first; then each base tensor is read, split into its HF
    projections, merged with its adapter delta (in float64) and written, one at a time. A QLoRA adapter (trained
    on the base held in NF4) is checked against the base quantized here (:mod:`~peftckpt.interop.nf4_base`) and
    merged into its full-precision weights; ``report`` (if given) then gets a line saying how far those are from
    the NF4 values the adapter was trained on (measured by that check: none with ``verify_base=False``)."""
    ckpt = open_checkpoint(ckpt_path, verify_checksums)
    cfg = checked_config(ckpt)
    hf_config = config_to_hf(cfg, dtype)
    sources: dict[str, HFModelDir | OfflineCheckpoint] = dict.fromkeys(ckpt.model_shapes(), ckpt)
    qlora = is_nf4(ckpt.manifest.model_config)
    quantized: NF4Base | None = None  # the base as the adapter saw it, once its fingerprint was checked
    if not ckpt.manifest.holds_every_weight:
        base_src = _full_precision(_open_base(_base_path(ckpt, base), verify_checksums), report)
        if verify_base and ckpt.manifest.base_fingerprint:
            frozen = [k.removeprefix("model.") for k in ckpt.manifest.excluded_keys]
            version = fingerprint_version(ckpt.manifest.base_fingerprint)
            held: TensorSource = base_src
            if qlora:  # the fingerprint is of the NF4 base: quantize the given one to compare
                held = quantized = NF4Base(base_src, [k.removesuffix("_nf4") for k in frozen
                                                      if k.endswith(".weight_nf4")])
            mine = lazy_fingerprint(held, frozen, version) if set(held.model_shapes()).issuperset(frozen) \
                else "incomplete"
            if mine != ckpt.manifest.base_fingerprint:
                raise CheckpointMismatchError(
                    f"adapter checkpoint {ckpt.where} was trained on a different base than --base {_where(base_src)}"
                    f" (fingerprint {ckpt.manifest.base_fingerprint} vs {mine}); --no-verify-base overrides")
        sources = dict.fromkeys(base_src.model_shapes(), base_src) | sources
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
        raise InteropError(f"checkpoint {ckpt.where} lacks model tensor(s) {missing[:5]} that an HF Llama needs")
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for ours, split in plan:
        shape = sources[ours].model_shapes()[ours][0]
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
    if quantized is not None and report is not None:
        report.append(f"the adapter was trained on the base held in NF4 and is merged into its full-precision "
                      f"weights, which differ from the NF4 values by {100 * quantized.relative_error():.2f} % "
                      "(relative norm over the linear layers): evaluate the merged model before relying on it")
    return out_dir
