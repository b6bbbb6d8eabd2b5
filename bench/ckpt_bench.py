"""Checkpoint benchmark: one model, one run, every way of saving and loading its adapter side by side.

    python bench/ckpt_bench.py                   # ~953M-parameter Llama-style GPT, LoRA r=16 on 7 projections
    python bench/ckpt_bench.py --quick           # a small model, under a minute
    python bench/ckpt_bench.py --world-size 2 --tp 2  # our saves under torchrun (spawned by this script)

Prints a table and the performance targets (ratios from the same run) and writes everything to a JSON
file (``--output``). With ``--world-size N`` the multi-rank measurements (ours, plain DCP, the raw disk on rank
0, async, scaling) run in a worker mode of this script under ``torchrun``; the single-process peers
(``torch.save``, HF PEFT) then run afterwards in this process. See bench/README.md for what each row means
and how the page cache is handled.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

import _s3
from _peers import HFPeft, PlainDCP, TorchSave, hf_available
from _report import report
from _timing import RAW_BLOCK_BYTES, Ctx, Stat, dir_bytes, evict, machine_info, raw_read, raw_write, rmtree
from _train_loop import measure_train_loop
from peftckpt.checkpoint.api import Checkpointer, LoadOptions, SaveOptions
from peftckpt.checkpoint.location.store import cache_root
from peftckpt.checkpoint.state.fingerprint_sums import chunk_kernel
from peftckpt.checkpoint.state.sections import ensure_optimizer_state
from peftckpt.checkpoint.storage.checksums import checksum_files
from peftckpt.checkpoint.storage.formats import no_zip_crc32
from peftckpt.checkpoint.storage.planners import EntrySavePlanner
from peftckpt.model import GPTConfig, GPTModel, LoRAConfig, apply_lora
from peftckpt.parallel.dims import ParallelDims, stage_layer_numbers

CANONICAL_TARGETS = ("linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up",
                     "linear_fc2")
PROFILES: dict[str, dict[str, Any]] = {
    # The reference model: 953M parameters, 3.8 GB in fp32, 40 MB of adapter at r=16.
    "default": dict(hidden_size=2048, num_layers=16, num_attention_heads=16, num_query_groups=16,
                    ffn_hidden_size=5632, vocab_size=32000, repeats=5, scaling_layers=[4, 8, 16, 32, 64],
                    scaling_hidden_size=256),
    "quick": dict(hidden_size=512, num_layers=4, num_attention_heads=8, num_query_groups=8,
                  ffn_hidden_size=1408, vocab_size=8192, repeats=2, scaling_layers=[4, 16, 64],
                  scaling_hidden_size=64),
}
OBJECTS = {"iteration": 1}
Step = tuple[Callable[[int], Any], Callable[[int], Any] | None]
"""A timed step of :meth:`Ctx.rounds`: ``fn(i)`` and an untimed ``before(i)``."""


# -------------------------------------------------------------------------------------------- setup
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small model and fewer repeats (under a minute)")
    m = p.add_argument_group("model (defaults from the profile)")
    for name in ("hidden-size", "num-layers", "num-attention-heads", "num-query-groups", "ffn-hidden-size",
                 "vocab-size"):
        m.add_argument(f"--{name}", type=int, default=None)
    m.add_argument("--lora-rank", type=int, default=16)
    m.add_argument("--lora-alpha", type=float, default=32.0)
    m.add_argument("--lora-target-modules", nargs="+", default=list(CANONICAL_TARGETS),
                   help="default: the seven projections (q, k, v, o, gate, up, down), as HF PEFT adapts them")
    lay = p.add_argument_group("layout (spawns torchrun when --world-size > 1)")
    lay.add_argument("--world-size", type=int, default=1, help="ranks for our saves/loads, plain DCP, async and scaling")
    lay.add_argument("--tp", type=int, default=1)
    lay.add_argument("--pp", type=int, default=1)
    lay.add_argument("--vpp", type=int, default=1, help="virtual pipeline chunks per pipeline rank")
    r = p.add_argument_group("run")
    r.add_argument("--repeats", type=int, default=None, help="timed repeats of each measurement (median, min, max)")
    r.add_argument("--scaling-layers", type=int, nargs="+", default=None,
                   help="layer counts of the adapter-tensor scaling sweep")
    r.add_argument("--scaling-hidden-size", type=int, default=None)
    r.add_argument("--output", type=Path, default=Path("bench/ckpt_bench.json"), help="JSON results file")
    r.add_argument("--workdir", type=Path, default=None,
                   help="where checkpoints are written (default: a fresh directory under $TMPDIR)")
    r.add_argument("--cache", choices=["evict", "drop", "warm"], default="evict",
                   help="before each timed read: evict the files read from the page cache (default), drop "
                        "the whole page cache (root), or leave it warm")
    r.add_argument("--no-hf", action="store_true", help="skip the HF PEFT peer")
    r.add_argument("--no-s3", action="store_true", help="skip the S3 rows (a local moto S3 server; they need the "
                   "s3fs and moto packages, else they are skipped)")
    r.add_argument("--no-async-full", action="store_true", help="skip the async full save (needs 2x model RAM)")
    r.add_argument("--no-train-loop", action="store_true",
                   help="skip the training-loop rows (a LoRA run with a checkpoint every step vs none)")
    r.add_argument("--keep", action="store_true", help="keep the work directory")
    r.add_argument("--from-json", type=Path, default=None,
                   help="measure nothing: print the table and targets of an earlier run's JSON file and write "
                        "it, targets recomputed, to --output")
    r.add_argument("--worker-result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    profile = PROFILES["quick" if args.quick else "default"]
    for key, value in profile.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def model_config(args: argparse.Namespace, num_layers: int | None = None, hidden: int | None = None) -> GPTConfig:
    """The benchmark model, or (``hidden``) a narrow one of ``num_layers`` layers for the scaling sweep,
    whose save time is all per-tensor cost: head dim 32, FFN 2.75x, a 1024-token vocabulary."""
    if hidden is None:
        return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, num_query_groups=args.num_query_groups,
                         ffn_hidden_size=args.ffn_hidden_size, vocab_size=args.vocab_size,
                         max_position_embeddings=4096, untie_embeddings_and_output_weights=True)
    heads = max(args.tp, hidden // 32)
    return GPTConfig(num_layers=num_layers or args.num_layers, hidden_size=hidden, num_attention_heads=heads,
                     num_query_groups=heads, ffn_hidden_size=int(hidden * 2.75) // 64 * 64 or 64, vocab_size=1024,
                     max_position_embeddings=4096, untie_embeddings_and_output_weights=True)


@dataclass
class Bundle:
    """This rank's model chunks with LoRA, an AdamW over the adapters with state, and a Checkpointer."""

    config: GPTConfig
    lora: LoRAConfig
    chunks: list[GPTModel]
    optimizer: torch.optim.AdamW
    ckpt: Checkpointer

    @classmethod
    def build(cls, args: argparse.Namespace, ctx: Ctx, config: GPTConfig, single: bool = False) -> Bundle:
        """``single``: one process, no parallelism (the peers that only run single-process)."""
        dims = ParallelDims() if single else ParallelDims.from_world(ctx.world, args.tp, args.pp, args.vpp)
        meshes = dims.build("cpu")
        lora = LoRAConfig(rank=args.lora_rank, alpha=args.lora_alpha, target_modules=tuple(args.lora_target_modules))
        chunks = []
        for stage in meshes.stage_ids():
            layers = stage_layer_numbers(config.num_layers, dims.num_stages, stage)
            chunks.append(GPTModel(config, meshes.tp, layers, pre_process=stage == 0,
                                   post_process=stage == dims.num_stages - 1, seed=1234))
        apply_lora(chunks, lora, seed=1234)
        trainable = [p for c in chunks for p in c.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        # State as after some steps (random moments, step 10) and adapters away from their zero init, so
        # nothing on disk is a run of zeros; no real step is needed to time a save.
        ensure_optimizer_state(optimizer)
        gen = torch.Generator().manual_seed(ctx.rank)
        with torch.no_grad():
            for p in trainable:
                _local(p).normal_(0.0, 0.02, generator=gen)
                for v in optimizer.state[p].values():
                    if v.ndim == 0:
                        v.fill_(10.0)
                    else:
                        _local(v).normal_(0.0, 1e-3, generator=gen).abs_()
        ckpt = Checkpointer(chunks, optimizer, layout=dims.to_dict(),
                            coords={"tp": meshes.tp_rank, "pp": meshes.pp_rank, "dp": meshes.dp_rank},
                            model_config=config.to_dict(), adapter_config=lora.to_dict())
        return cls(config, lora, chunks, optimizer, ckpt)

    def numel(self, trainable: bool) -> int:
        return sum(_local(p).numel() for c in self.chunks for p in c.parameters() if p.requires_grad == trainable)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


# --------------------------------------------------------------------------------------- helpers
class Dirs:
    """Fresh checkpoint directories under the work directory (rank 0 creates and removes them)."""

    def __init__(self, root: Path, ctx: Ctx):
        self.root = root
        self.ctx = ctx

    def path(self, name: str, i: int | None = None) -> Path:
        return self.root / (name if i is None else f"{name}-{i}")

    def drop(self, path: Path) -> None:
        self.ctx.barrier()  # no rank may still be reading it (e.g. summing its size)
        if self.ctx.rank == 0:
            rmtree(path)
        self.ctx.barrier()

    def evict(self, path: Path, mode: str) -> None:
        if self.ctx.rank == 0:
            evict(path, mode)
        self.ctx.barrier()


def _quiet() -> None:
    warnings.filterwarnings("ignore")


def save_step(dirs: Dirs, name: str, save: Callable[[Path], Any]) -> Step:
    """A step saving into a fresh ``<name>-i`` per repeat; the previous repeat's directory is dropped
    untimed, the last one is kept (for loads)."""
    return (lambda i: save(dirs.path(name, i))), (lambda i: dirs.drop(dirs.path(name, i - 1)) if i else None)


def _committed(save_dir: Path) -> Path:
    """The iteration directory a Checkpointer save committed under ``save_dir``."""
    return save_dir / "iter_0000001"


# ---------------------------------------------------------------------------------- distributed part
def measure_distributed(args: argparse.Namespace, ctx: Ctx, work: Path, b: Bundle,
                        peers: SinglePeers | None = None) -> dict[str, Any]:
    """Ours (full, trainable-only, adapter only; save and load), bare DCP writes of our entries, plain DCP,
    the raw disk for the same byte counts (rank 0), async, fingerprint and checksums. Collective.

    Things compared with each other run in the same rounds (see :meth:`Ctx.rounds`), with the
    single-process ``peers`` when given (a one-process run)."""
    _quiet()
    dirs = Dirs(work, ctx)
    n = args.repeats
    ck = b.ckpt
    plain = PlainDCP(b.chunks, b.optimizer)
    options = {
        "full": SaveOptions(trainable_only=False),
        "trainable": SaveOptions(trainable_only=True),
        "model_only": SaveOptions(trainable_only=True, save_optim=False, save_rng=False),
    }
    block = memoryview(os.urandom(RAW_BLOCK_BYTES))
    rbuf = bytearray(RAW_BLOCK_BYTES)
    sizes: dict[str, int] = {}  # bytes of our checkpoints, for the raw writes

    def ours_save(kind: str) -> Step:
        return save_step(dirs, f"ours-{kind}", lambda d: ck.save(d, 1, OBJECTS, options[kind]))

    def ours_path(kind: str) -> Path:
        return _committed(dirs.path(f"ours-{kind}", n - 1))

    def bare_save(trainable_only: bool) -> Step:
        def save(d: Path) -> None:
            flat = ck.parts.build(trainable_only, True, OBJECTS, True).entries
            with no_zip_crc32():  # framed as our blocking save frames it
                dcp.save(flat, storage_writer=FileSystemWriter(d, sync_files=True, thread_count=1),
                         planner=EntrySavePlanner())
        return save_step(dirs, f"bare-{trainable_only}", save)

    def raw_file(kind: str, i: int) -> Path:
        return dirs.path(f"raw-{kind}-{i}.bin")

    def raw_step(kind: str) -> Step:
        """Rank 0 writes the byte count of our ``kind`` checkpoint of this round (+fsync); the others wait."""
        def before(i: int) -> None:
            if ctx.rank == 0:
                if i:
                    raw_file(kind, i - 1).unlink(missing_ok=True)
                sizes[kind] = dir_bytes(_committed(dirs.path(f"ours-{kind}", i)))
            ctx.barrier()
        return (lambda i: raw_write(raw_file(kind, i), sizes[kind], block) if ctx.rank == 0 else None), before

    def load(kind: str, verify: bool, while_reading: bool = True) -> Step:
        model_only = kind == "model_only"
        lo = LoadOptions(load_optim=not model_only, load_rng=not model_only, verify_checksums=verify,
                         verify_while_reading=while_reading)
        return (lambda i: ck.load(ours_path(kind), lo)), (lambda i: dirs.evict(ours_path(kind), args.cache))

    s3_base = os.environ.get(_s3.S3_ENV)

    def s3_url(i: int) -> str:
        return f"{s3_base}/trainable-{i}"

    def s3_save() -> Step:
        def before(i: int) -> None:
            ctx.barrier()
            if i and ctx.rank == 0:
                _s3.drop(s3_url(i - 1))
            ctx.barrier()
        return (lambda i: ck.save(s3_url(i), 1, OBJECTS, options["trainable"])), before

    plain_s3 = _s3.PlainTransfer(f"{s3_base}/plain") if s3_base and ctx.rank == 0 else None

    def trainable_files(i: int) -> tuple[list[Path], Path]:
        root = _committed(dirs.path("ours-trainable", i))
        return sorted(p for p in root.rglob("*") if p.is_file()), root

    def s3_plain_put() -> Step:
        """Rank 0 puts the files of this round's trainable-only checkpoint (the same bytes as ours)."""
        def before(i: int) -> None:
            if plain_s3 is not None:
                _s3.drop(f"{s3_base}/plain")
            ctx.barrier()
        return (lambda i: plain_s3.put(*trainable_files(i)) if plain_s3 is not None else None), before

    def s3_plain_get() -> Step:
        got = dirs.path("s3-plain-get")

        def before(i: int) -> None:
            if ctx.rank == 0:
                rmtree(got)
            ctx.barrier()
        return (lambda i: plain_s3.get(*trainable_files(n - 1), got) if plain_s3 is not None else None), before

    def raw_read_step(kind: str) -> Step:
        path = raw_file(kind, n - 1)
        return (lambda i: raw_read(path, rbuf) if ctx.rank == 0 else None), (lambda i: dirs.evict(path, args.cache))

    # The fingerprint first: computed once per run, cached for every later trainable-only save and load.
    out: dict[str, Any] = {"layout": ck.layout, "world": ctx.world,
                           "fingerprint": ctx.time(lambda i: (ck._fingerprints.clear(), ck.fingerprint()),
                                                   n).to_dict(),
                           "fingerprint_kernel": chunk_kernel()}
    small = ctx.rounds(n, {
        "ours_trainable": ours_save("trainable"),
        "bare_trainable": bare_save(True),
        "plain_dcp": save_step(dirs, "plain", plain.save),
        "raw_trainable": raw_step("trainable"),
        "ours_model_only": ours_save("model_only"),
        **({"s3_trainable": s3_save(), "s3_plain": s3_plain_put()} if s3_base else {}),
        **(peers.save_steps() if peers is not None else {}),
    })
    small_loads = ctx.rounds(n, {
        "ours_trainable": load("trainable", True),
        "ours_trainable_noverify": load("trainable", False),
        "plain_dcp": ((lambda i: plain.load(dirs.path("plain", n - 1))),
                      (lambda i: dirs.evict(dirs.path("plain", n - 1), args.cache))),
        "raw_trainable": raw_read_step("trainable"),
        "ours_model_only": load("model_only", True),
        "ours_model_only_noverify": load("model_only", False),
        **({"s3_trainable": ((lambda i: ck.load(s3_url(n - 1))), None), "s3_plain": s3_plain_get(),
            "s3_plain_ranged": ((lambda i: plain_s3.get_ranged(*trainable_files(n - 1))
                                 if plain_s3 is not None else None), None)}
           if s3_base else {}),
        **{f"peer_{k}": v for k, v in (peers.load_steps() if peers is not None else {}).items()},
    })
    full = ctx.rounds(n, {
        "ours_full": ours_save("full"),
        "bare_full": bare_save(False),
        "raw_full": raw_step("full"),
    })
    # What `_commit` hashes: each rank its own shard files, rank 0 also the shared ones (page cache warm:
    # the loads just read them).
    files = sorted(p for p in ours_path("full").rglob("*") if p.is_file() and (
        p.name.startswith(f"__{ctx.rank}_") or (ctx.rank == 0 and not p.name.startswith("__"))))
    full_loads = ctx.rounds(n, {
        "ours_full": load("full", True),
        "ours_full_verify_first": load("full", True, while_reading=False),
        "ours_full_noverify": load("full", False),
        "raw_full": raw_read_step("full"),
        "checksum": ((lambda i: checksum_files(files, ours_path("full"))), None),
    })
    rows: dict[str, Any] = {}
    for kind in options:
        loads = full_loads if kind == "full" else small_loads
        saves = full if kind == "full" else small
        rows[f"ours_{kind}"] = {"save": saves[f"ours_{kind}"].to_dict(), "bytes": dir_bytes(ours_path(kind)),
                                "load": loads[f"ours_{kind}"].to_dict(),
                                "load_noverify": loads[f"ours_{kind}_noverify"].to_dict()}
    rows["ours_full"]["checksum"] = full_loads["checksum"].to_dict()
    rows["ours_full"]["load_verify_first"] = full_loads["ours_full_verify_first"].to_dict()
    rows["bare_full"] = {"save": full["bare_full"].to_dict(), "bytes": dir_bytes(dirs.path("bare-False", n - 1))}
    rows["bare_trainable"] = {"save": small["bare_trainable"].to_dict(),
                              "bytes": dir_bytes(dirs.path("bare-True", n - 1))}
    rows["plain_dcp"] = {"save": small["plain_dcp"].to_dict(), "bytes": dir_bytes(dirs.path("plain", n - 1)),
                         "load": small_loads["plain_dcp"].to_dict()}
    if s3_base:  # the same checkpoint as ours_trainable, on the S3 server
        rows["s3_trainable"] = {"save": small["s3_trainable"].to_dict(), "bytes": rows["ours_trainable"]["bytes"],
                                "load": small_loads["s3_trainable"].to_dict()}
        rows["s3_plain"] = {"save": small["s3_plain"].to_dict(), "bytes": rows["ours_trainable"]["bytes"],
                            "load": small_loads["s3_plain"].to_dict()}
        out["s3_plain_ranged_load"] = small_loads["s3_plain_ranged"].to_dict()
        loaded: list[Any] = []
        out["s3_requests"] = s3_requests(ctx, lambda: ck.save(s3_url(n), 1, OBJECTS, options["trainable"]),
                                         lambda: loaded.append(ck.load(s3_url(n))))
        out["s3_load_bytes"] = {"fetched_per_rank": ctx.gather(loaded[0].bytes_fetched),
                                "checkpoint": rows["ours_trainable"]["bytes"]}
        if ctx.rank == 0:
            _s3.drop(s3_url(n - 1))
            _s3.drop(s3_url(n))
            _s3.drop(f"{s3_base}/plain")
        dirs.drop(dirs.path("s3-plain-get"))
    if peers is not None:
        rows.update(peers.rows(small, {k.removeprefix("peer_"): v for k, v in small_loads.items()
                                       if k.startswith("peer_")}))
        peers.close()
    out["rows"] = rows
    out["raw"] = {kind: {"bytes": sizes[kind], "write": (full if kind == "full" else small)[f"raw_{kind}"].to_dict(),
                         "read": (full_loads if kind == "full" else small_loads)[f"raw_{kind}"].to_dict()}
                  for kind in ("full", "trainable")} if ctx.rank == 0 else {}
    for name in ("ours-full", "ours-trainable", "ours-model_only", "bare-False", "bare-True", "plain"):
        dirs.drop(dirs.path(name, n - 1))
    for kind in ("full", "trainable"):
        dirs.drop(raw_file(kind, n - 1))
    out["async"] = measure_async(args, ctx, dirs, b)
    ck._host_buffers.clear()  # the async saves' host copies of the mutable state
    gc.collect()
    return out


def measure_async(args: argparse.Namespace, ctx: Ctx, dirs: Dirs, b: Bundle) -> dict[str, Any]:
    """Time training is blocked by an async save (the call) vs until it is committed (call + wait)."""
    out: dict[str, Any] = {}
    kinds = [("trainable", True)] + ([] if args.no_async_full else [("full", False)])
    for name, trainable_only in kinds:
        blocked, total = Stat(), Stat()
        for i in range(args.repeats):
            d = dirs.path(f"async-{name}", i)
            ctx.barrier()
            t0 = time.perf_counter()
            # as the trainer's --async-save: the copy to host memory overlaps what follows the call
            b.ckpt.save(d, 1, OBJECTS, SaveOptions(trainable_only=trainable_only, async_save=True,
                                                   defer_snapshot=True))
            t1 = time.perf_counter()
            b.ckpt.wait()
            t2 = time.perf_counter()
            blocked.samples.append(ctx.slowest(t1 - t0))
            total.samples.append(ctx.slowest(t2 - t0))
            dirs.drop(d)
        out[name] = {"blocked": blocked.to_dict(), "until_committed": total.to_dict()}
    return out


def s3_requests(ctx: Ctx, save: Callable[[], Any], load: Callable[[], Any]) -> dict[str, dict[str, int]]:
    """The requests by S3 operation of one trainable-only save to the S3 server and of one load of it (untimed;
    the server's recorder counts them)."""
    out: dict[str, dict[str, int]] = {}
    for name, fn in (("save", save), ("load", load)):
        ctx.barrier()
        if ctx.rank == 0:
            _s3.record()
        ctx.barrier()
        fn()
        ctx.barrier()
        if ctx.rank == 0:
            out[name] = _s3.requests()
    return out


def measure_base_from_store(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The base a fine-tuning run loads before its first step (``load_pretrained`` of a full checkpoint, one
    process), from local disk and from the S3 server: a host's first run (fetched whole into the host's base
    cache), a later run (read from the cache), and ``--no-base-cache`` (ranged reads of the objects). A smaller
    model than the bench's (4 layers x 1024; the bench's own when it is smaller), so the store's copy stays quick."""
    ctx = Ctx()
    dirs = Dirs(work, ctx)
    small = args.hidden_size < 1024
    config = model_config(args) if small else model_config(args, num_layers=4, hidden=1024)
    writer = Bundle.build(args, ctx, config, single=True)
    local, url = dirs.path("base-local"), f"{os.environ[_s3.S3_ENV]}/base"
    for where in (local, url):
        writer.ckpt.save(where, 1, OBJECTS, SaveOptions(trainable_only=False))
    writer.ckpt.close()
    del writer
    reader = Bundle.build(args, ctx, config, single=True).ckpt
    bases = cache_root() / "bases"
    results: dict[str, Any] = {}

    def load(name: str, where: str | Path, options: LoadOptions | None = None) -> Callable[[int], Any]:
        def run(i: int) -> None:
            results[name] = reader.load_pretrained(where, options)
        return run
    stats = ctx.rounds(args.repeats, {
        "local": (load("local", local), lambda i: dirs.evict(local, args.cache)),
        "store_first_run": (load("store_first_run", url), lambda i: rmtree(bases)),
        "store_cached": (load("store_cached", url), lambda i: evict(bases, args.cache)),
        "store_ranged": (load("store_ranged", url, LoadOptions(base_cache=False)), None),
    })
    out: dict[str, Any] = {"bytes": dir_bytes(local), "layers": config.num_layers, "hidden": config.hidden_size}
    for name, stat in stats.items():
        out[name] = {**stat.to_dict(), "cache_hit": results[name].cache_hit,
                     "bytes_fetched": results[name].bytes_fetched}
    reader.close()
    dirs.drop(local)
    _s3.drop(url)
    rmtree(bases)
    return out


def measure_scaling(args: argparse.Namespace, ctx: Ctx, work: Path) -> dict[str, Any]:
    """Trainable-only save time (ours, plain DCP, and a raw write + fsync of our checkpoint's byte count) as the
    number of adapter tensors grows; fitted as ``fixed + per_tensor * stored_tensors`` (stored = adapter tensors +
    their two Adam moments). The bytes grow with the tensors, so the raw write's slope is what the disk costs
    per stored tensor, and ours less it what the framing, checksums and commit cost."""
    _quiet()
    dirs = Dirs(work, ctx)
    block = memoryview(os.urandom(RAW_BLOCK_BYTES))
    points = []
    for layers in args.scaling_layers:
        b = Bundle.build(args, ctx, model_config(args, num_layers=layers, hidden=args.scaling_hidden_size))
        adapters = sum(1 for c in b.chunks for p in c.parameters() if p.requires_grad)
        counts = torch.tensor([adapters])
        if ctx.distributed:  # pipeline ranks hold different layers; TP/DP ranks hold copies/shards
            dist.all_reduce(counts)
            counts //= ctx.world // args.pp
        adapters = int(counts)
        plain = PlainDCP(b.chunks, b.optimizer)
        ours_name, plain_name = f"scale-ours-{layers}", f"scale-plain-{layers}"
        stats = ctx.rounds(args.repeats, {
            "ours": save_step(dirs, ours_name, lambda d, b=b: b.ckpt.save(d, 1, OBJECTS, SaveOptions(trainable_only=True))),
            "plain": save_step(dirs, plain_name, plain.save),
        })
        ours, peer = stats["ours"], stats["plain"]
        nbytes = dir_bytes(_committed(dirs.path(ours_name, args.repeats - 1)))
        dirs.drop(dirs.path(ours_name, args.repeats - 1))
        dirs.drop(dirs.path(plain_name, args.repeats - 1))
        raw = dirs.path(f"scale-raw-{layers}")
        written = ctx.rounds(args.repeats, {  # the same bytes, one file (+ fsync)
            "raw": ((lambda i, raw=raw, nbytes=nbytes: raw_write(raw, nbytes, block) if ctx.rank == 0 else None), None)
        })["raw"]
        if ctx.rank == 0:
            raw.unlink(missing_ok=True)
        points.append({"layers": layers, "adapter_tensors": adapters, "stored_tensors": 3 * adapters,
                       "bytes": nbytes, "ours": ours.to_dict(), "plain_dcp": peer.to_dict(),
                       "raw_write": written.to_dict()})
        del b, plain
        gc.collect()
    fits = {}
    x = np.array([p["stored_tensors"] for p in points], dtype=float)
    for who in ("ours", "plain_dcp", "raw_write"):
        y = np.array([p[who]["median_s"] for p in points])
        per, fixed = np.polyfit(x, y, 1) if len(points) > 1 else (float("nan"), float(y[0]))
        fits[who] = {"fixed_s": float(fixed), "per_tensor_s": float(per)}
    return {"points": points, "fit": fits}


# -------------------------------------------------------------------------------- single-process part
class SinglePeers:
    """``torch.save`` of the filtered state dict and HF PEFT, as steps for :meth:`Ctx.rounds` (one
    process only): each as is and + fsync of what it wrote; loads of the fsync'd copy."""

    def __init__(self, args: argparse.Namespace, dirs: Dirs, b: Bundle):
        self.args = args
        self.dirs = dirs
        self.torch_save = TorchSave(b.chunks[0], b.optimizer)
        self.hf = HFPeft(b.config.to_dict(), b.lora.to_dict()) if hf_available() and not args.no_hf else None
        self._held: list[Any] = []  # the HF base of the next load / the model it loaded

    def _fresh(self, name: str) -> Callable[[int], None]:
        return lambda i: rmtree(self.dirs.path(name, i - 1)) if i else None

    def save_steps(self) -> dict[str, Step]:
        d, ts = self.dirs, self.torch_save
        steps: dict[str, Step] = {
            "torch_save": (lambda i: ts.save(d.path("torch_save", i), fsync=False), self._fresh("torch_save")),
            "torch_save_fsync": (lambda i: ts.save(d.path("torch_save_fsync", i), fsync=True),
                                 self._fresh("torch_save_fsync")),
        }
        if self.hf is not None:
            hf = self.hf
            steps["hf_peft"] = (lambda i: hf.save(d.path("hf_peft", i), fsync=False), self._fresh("hf_peft"))
            steps["hf_peft_fsync"] = (lambda i: hf.save(d.path("hf_peft_fsync", i), fsync=True),
                                      self._fresh("hf_peft_fsync"))
        return steps

    def load_steps(self) -> dict[str, Step]:
        n, d, cache = self.args.repeats, self.dirs, self.args.cache
        ts_file, hf_dir = d.path("torch_save_fsync", n - 1), d.path("hf_peft_fsync", n - 1)
        steps: dict[str, Step] = {
            "torch_save_fsync": (lambda i: self.torch_save.load(ts_file), lambda i: evict(ts_file, cache)),
        }
        if self.hf is not None:
            hf = self.hf

            def before(i: int) -> None:
                self._held.clear()
                gc.collect()
                self._held.append(hf.base())  # a fresh base each time: PEFT injects the adapter into it
                evict(hf_dir, cache)

            steps["hf_peft_fsync"] = (lambda i: self._held.append(hf.load(hf_dir, self._held.pop())), before)
        return steps

    def rows(self, saves: dict[str, Stat], loads: dict[str, Stat]) -> dict[str, Any]:
        last = {name: self.dirs.path(name, self.args.repeats - 1) for name in self.save_steps()}
        out: dict[str, Any] = {}
        for name, path in last.items():
            out[name] = {"save": saves[name].to_dict(),
                         "bytes": dir_bytes(path) if path.is_dir() else path.stat().st_size}
            if name in loads:
                out[name]["load"] = loads[name].to_dict()
            if name.startswith("hf") and self.hf is not None:
                out[name].update(same_adapter=self.hf.same_adapter, adapter_numel=self.hf.adapter_numel)
        return out

    def close(self) -> None:
        for name in self.save_steps():
            rmtree(self.dirs.path(name, self.args.repeats - 1))
        self._held.clear()
        self.hf = None
        gc.collect()


def measure_single(args: argparse.Namespace, work: Path, b: Bundle) -> dict[str, Any]:
    """The single-process peers on their own (when our saves ran under torchrun)."""
    _quiet()
    ctx = Ctx()
    peers = SinglePeers(args, Dirs(work, ctx), b)
    saves = ctx.rounds(args.repeats, peers.save_steps())
    loads = ctx.rounds(args.repeats, peers.load_steps())
    rows = peers.rows(saves, loads)
    peers.close()
    return {"rows": rows}


# ------------------------------------------------------------------------------------------- driver
def run_worker(args: argparse.Namespace) -> None:
    """Under torchrun: the multi-rank measurements; rank 0 writes them to ``--worker-result``."""
    _quiet()
    dist.init_process_group("gloo")
    try:
        ctx = Ctx()
        assert args.workdir is not None and args.worker_result is not None
        b = Bundle.build(args, ctx, model_config(args))
        result = measure_distributed(args, ctx, args.workdir, b)
        result["numel"] = {"frozen": _sum(ctx, b.numel(False)), "trainable": _sum(ctx, b.numel(True))}
        del b
        gc.collect()
        result["scaling"] = measure_scaling(args, ctx, args.workdir)
        if ctx.rank == 0:
            args.worker_result.write_text(json.dumps(result))
        ctx.barrier()
    finally:
        gc.collect()  # while the group exists (see examples/dtensor_tp_lora.py)
        dist.destroy_process_group()


def _sum(ctx: Ctx, value: int) -> int:
    if not ctx.distributed:
        return value
    t = torch.tensor([value])
    dist.all_reduce(t)
    return int(t)


def spawn_worker(args: argparse.Namespace, argv: list[str], work: Path) -> dict[str, Any]:
    result = work / "worker-result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world_size),
           str(Path(__file__).resolve()), *argv, "--workdir", str(work), "--worker-result", str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                                                      // args.world_size)))}
    print(f"[bench] spawning: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True, env=env)
    out: dict[str, Any] = json.loads(result.read_text())
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker_result is not None:
        run_worker(args)
        return 0
    if args.from_json is not None:
        earlier = json.loads(args.from_json.read_text())
        text, earlier["targets"] = report(earlier)
        print(text)
        # Re-rendered targets go back into the file read, unless --output names another (never over the last run's
        # results by default).
        output = args.output if any(a == "--output" or a.startswith("--output=") for a in argv) else args.from_json
        output.write_text(json.dumps(earlier, indent=2, default=str) + "\n")
        return 0
    _quiet()
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="peftckpt-bench-", dir=args.workdir))
    results: dict[str, Any] = {"command": " ".join(["python", "bench/ckpt_bench.py", *argv]),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine_info(work),
                               "workdir": str(work), "cache": args.cache, "repeats": args.repeats,
                               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    s3 = contextlib.ExitStack()
    if not args.no_s3 and _s3.available():
        print(f"[bench] S3 rows against {s3.enter_context(_s3.s3_for_bench(work))} (moto server)", flush=True)
    try:
        config = model_config(args)
        results["model"] = config.to_dict()
        print(f"[bench] work directory {work}; model {config.num_layers} layers x {config.hidden_size}", flush=True)
        if args.world_size > 1:
            dist_part = spawn_worker(args, argv, work)
            single = Bundle.build(args, Ctx(), config, single=True)
        else:
            ctx = Ctx()
            single = Bundle.build(args, ctx, config)
            dist_part = measure_distributed(args, ctx, work, single, SinglePeers(args, Dirs(work, ctx), single))
            dist_part["numel"] = {"frozen": single.numel(False), "trainable": single.numel(True)}
        single_part = measure_single(args, work, single) if args.world_size > 1 else {"rows": {}}
        del single
        gc.collect()
        if args.world_size == 1:
            dist_part["scaling"] = measure_scaling(args, Ctx(), work)
        if os.environ.get(_s3.S3_ENV):
            print("[bench] a base loaded from local disk and from the S3 server", flush=True)
            dist_part["base_from_store"] = measure_base_from_store(args, work)
        if not args.no_train_loop:
            print("[bench] training loop: every-step async saves vs none", flush=True)
            small = args.quick or args.hidden_size < 512  # a small bench model: the small loop model too
            dist_part["train_loop"] = measure_train_loop(work, small, 12 if small else 25, 2)
        results.update(dist_part)
        results["rows"] = {**dist_part["rows"], **single_part["rows"]}
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["peak_rss_gib"] = {
            "this_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "largest_worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}
        results["wall_s"] = time.time() - started
        text, targets = report(results)
        results["targets"] = targets
        print(text)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2, default=str) + "\n")
        print(f"[bench] wrote {args.output} ({results['wall_s']:.0f} s)")
    finally:
        s3.close()
        if not args.keep:
            rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
