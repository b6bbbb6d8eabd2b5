"""Real-size bench (``make bench-scale``): a Llama-2-7B-shaped base on this machine, end to end.

Steps (each a real command, timed from outside; per-process peak RSS from /proc):
    1. Write a 7B-shaped HF directory (hidden 4096, 32 layers, ffn 11008, 32 heads, vocab 32000, untied; random
       bf16 values; 3 safetensors shards + index), tensor by tensor. Kept between runs (``--workdir``).
    2. ``peftckpt import-hf`` of it: wall time, peak RSS, bytes written.
    3. The raw read of the HF files and of the imported base (page cache evicted, 2 readers with equal byte
       shares, as the 2 ranks split the base): into a reused buffer (the disk's speed), and into fresh memory
       (the floor of any load that fills newly allocated tensors: on a virtual machine first touches cost).
    4. LoRA r=16 on all seven projections at TP=2 (2 processes, ``--bf16``, seq 16, 2 iterations) with
       ``--pretrained-checkpoint HF_DIR``: peak RSS per rank, launch -> first step, base load time (the
       trainer's own log) vs the raw read, the time the fingerprint (taken while reading) added after the
       last read; an adapter-only save at the end; then a resume (1 more iteration) and ``export-peft``.
    5. The same run from the imported torch_dist base.
    6. The fingerprint's CPU rate per version on one core, and the CPU's int8 dot-product instructions (version 4
       is int8 matrix products: their speed differs by an order of magnitude between CPUs).
    7. QLoRA: LoRA in one process (TP=1) on the base held in NF4 (``--base-quantization nf4 --bf16``, quantized
       tensor by tensor as the HF directory is read), 1 iteration and an adapter-only save: peak RSS against the
       NF4 base's size, base load + quantization time, adapter checkpoint size.
    8. The same on a Llama-2-13B-shaped HF directory (hidden 5120, 40 layers, ffn 13824, 40 heads; 24.2 GiB of
       bf16, kept in WORKDIR/hf13b; --layers scales its depth too) at TP=2: peak RSS per rank against its share
       of the NF4 base.
The targets are checked as ratios from this run; nothing here is asserted by the test suite.

    python bench/scale_bench.py [--workdir DIR] [--layers N] [--keep] [--output FILE] [--only-qlora]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import balanced_read, dir_bytes, evict, int8_dot_flags, machine_info, rmtree  # noqa: E402
from peftckpt.checkpoint.state.fingerprint_sums import chunk_kernel  # noqa: E402
from peftckpt.interop.safetensors_io import write_safetensors  # noqa: E402

GIB = 2**30
SHAPE = {"hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008, "num_attention_heads": 32,
         "num_key_value_heads": 32, "vocab_size": 32000}
SHAPE_13B = {"hidden_size": 5120, "num_hidden_layers": 40, "intermediate_size": 13824, "num_attention_heads": 40,
             "num_key_value_heads": 40, "vocab_size": 32000}
LORA = ["--lora-rank", "16", "--lora-alpha", "32", "--lora-target-modules", "linear_q", "linear_k", "linear_v",
        "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"]


# ------------------------------------------------------------------------------------------ 1. the base
def hf_tensors(cfg: dict[str, int]) -> dict[str, tuple[int, ...]]:
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        out |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}.self_attn.{proj}.weight"] = (h, h)
        out |= {f"{p}.mlp.gate_proj.weight": (f, h), f"{p}.mlp.up_proj.weight": (f, h), f"{p}.mlp.down_proj.weight": (h, f)}
    out |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return out


def write_base(path: Path, cfg: dict[str, int], num_shards: int = 3) -> None:
    """The HF directory, one tensor in memory at a time; skipped when a complete one is there."""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", **cfg}
    if (path / "model.safetensors.index.json").is_file() and json.loads((path / "config.json").read_text()) == config:
        return
    rmtree(path)
    path.mkdir(parents=True)
    shapes = hf_tensors(cfg)
    total = sum(math.prod(s) * 2 for s in shapes.values())
    shards: list[dict[str, tuple[int, ...]]] = [{} for _ in range(num_shards)]
    acc = 0
    for name, shape in shapes.items():
        shards[min(num_shards - 1, acc * num_shards // total)][name] = shape
        acc += math.prod(shape) * 2
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        weight_map |= {name: fname for name in shard}

        def tensors(shard: dict[str, tuple[int, ...]] = shard):
            for name, shape in shard.items():
                t = torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * 0.02
                yield name, t.to(torch.bfloat16)

        write_safetensors(path / fname, {n: (torch.bfloat16, s) for n, s in shard.items()}, tensors(),
                          metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config))


# ------------------------------------------------------------------------------------- process tools
class PeakRSS:
    """Peak resident memory (VmHWM) of a process and its descendants, sampled until they exit."""

    def __init__(self, root: int):
        self.root = root
        self.peaks: dict[int, int] = {}
        self.read_bytes: dict[int, int] = {}
        """``read_bytes`` of ``/proc/<pid>/io``: what each process had fetched from storage (page-cache hits
        are not counted, so two ranks reading the same pages count them once)."""
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in self._tree():
                try:
                    status = Path(f"/proc/{pid}/status").read_text()
                    hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                except (OSError, AttributeError):
                    continue
                self.peaks[pid] = max(self.peaks.get(pid, 0), hwm)
                self.names[pid] = cmd
                try:
                    io = Path(f"/proc/{pid}/io").read_text()
                    got = int(re.search(r"read_bytes:\s+(\d+)", io).group(1))  # type: ignore[union-attr]
                    self.read_bytes[pid] = max(self.read_bytes.get(pid, 0), got)
                except (OSError, AttributeError):
                    pass
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _is_worker(self, pid: int) -> bool:
        return "torch.distributed.run" not in self.names[pid] and "-m peftckpt" in self.names[pid]

    def workers(self) -> list[int]:
        """Peak RSS of the trainer processes (torchrun's workers; the process itself without torchrun)."""
        return sorted((v for p, v in self.peaks.items() if self._is_worker(p)), reverse=True)

    def workers_read(self) -> list[int]:
        """Bytes the trainer processes read from storage (last sample; ``/proc/<pid>/io``)."""
        return [self.read_bytes.get(p, 0) for p in sorted(self.peaks) if self._is_worker(p)]


def run(cmd: list[str], log: Path, first_line_of: Path | None = None) -> dict[str, Any]:
    """Run ``cmd`` (output to ``log``); wall time, peak RSS per process, time until ``first_line_of`` exists."""
    env = {**os.environ, "OMP_NUM_THREADS": "1" if "--nproc-per-node" in cmd else str(os.cpu_count() or 1)}
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        peaks = PeakRSS(proc.pid)
        first = None
        while proc.poll() is None:
            if first is None and first_line_of is not None and first_line_of.exists() and first_line_of.stat().st_size:
                first = time.perf_counter() - start
            time.sleep(0.05)
        peaks.stop()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    text = log.read_text()
    found = {k: float(m.group(1)) for k, pat in (("base_load_s", r"loaded base weights from .* in ([\d.]+) s"),
                                                 ("fingerprint_s", r"base fingerprint taken while reading the base; it added ([\d.]+) s"))
             if (m := re.search(pat, text))}
    return {"wall_s": wall, "first_step_s": first, "peak_rss": peaks.workers(), "read_bytes": peaks.workers_read(),
            **found}


# ------------------------------------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("bench_scale_out"))
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"], help="fewer for a quick look")
    p.add_argument("--keep", action="store_true", help="keep the imported base and the runs (the HF base is kept)")
    p.add_argument("--output", type=Path, default=None, help="JSON results (default WORKDIR/scale_results.json)")
    p.add_argument("--only-qlora", action="store_true", help="steps 7 and 8 only (after writing the bases if needed)")
    p.add_argument("--skip-qlora", action="store_true", help="steps 1-6 only (no 13B base is written)")
    a = p.parse_args()
    cfg = dict(SHAPE, num_hidden_layers=a.layers)
    work = a.workdir.absolute()
    work.mkdir(parents=True, exist_ok=True)
    hf, base = work / "hf", work / "base"
    py = [sys.executable, "-m", "peftckpt"]
    tr = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "peftckpt"]
    r: dict[str, Any] = {"machine": machine_info(work), "config": cfg}

    t0 = time.perf_counter()
    write_base(hf, cfg)
    r["hf_bytes"] = dir_bytes(hf)
    r["write_base_s"] = time.perf_counter() - t0
    print(f"HF base: {r['hf_bytes'] / GIB:.2f} GiB in {hf}", flush=True)
    if a.only_qlora:
        qlora_rows(r, a.layers, cfg, hf, work, py, tr)
        r["targets"] = qlora_targets(r)
        (a.output or work / "scale_results_qlora.json").write_text(json.dumps(r, indent=2, default=str))
        print("\n".join(render_qlora(r)))
        return

    rmtree(base)
    evict(hf, "evict")
    r["import_hf"] = run([*py, "import-hf", str(hf), str(base)], work / "import.log")
    r["import_hf"]["bytes_written"] = dir_bytes(base)
    print(f"import-hf: {r['import_hf']}", flush=True)

    # 3. the physical limit: the files read by 2 readers with equal byte shares, as the 2 ranks split the base
    for name, files in (("hf", sorted(hf.glob("*.safetensors"))), ("import", sorted(base.rglob("*.distcp")))):
        r[f"raw_read_{name}_s"] = balanced_read(files)
        r[f"raw_read_{name}_fresh_s"] = balanced_read(files, fresh=True)
        print(f"balanced raw read of the {name} base: {r[f'raw_read_{name}_s']:.1f} s into a reused buffer, "
              f"{r[f'raw_read_{name}_fresh_s']:.1f} s into fresh memory", flush=True)

    common = ["--tensor-model-parallel-size", "2", "--bf16", "--seq-length", "16", "--micro-batch-size", "1",
              "--global-batch-size", "1", "--mock-data", "--lr", "1e-4", "--log-interval", "1", "--no-progress",
              *LORA, "--save-trainable-params-only"]
    for name, source in (("from_hf", hf), ("from_import", base)):
        save, metrics = work / f"lora_{name}", work / f"metrics_{name}.jsonl"
        rmtree(save)
        rmtree(metrics)
        evict(source, "evict")
        row = run([*tr, "train", *common, "--pretrained-checkpoint", str(source), "--train-iters", "2", "--save", str(save),
                   "--metrics-file", str(metrics)], work / f"train_{name}.log", first_line_of=metrics)
        row["adapter_bytes"] = dir_bytes(save)
        evict(source, "evict")
        row["resume"] = run([*tr, "train", *common, "--pretrained-checkpoint", str(source), "--load", str(save),
                             "--train-iters", "3", "--save", str(save)], work / f"resume_{name}.log")
        rmtree(work / f"peft_{name}")
        row["export_peft"] = run([*py, "export-peft", str(save), str(work / f"peft_{name}")],
                                 work / f"export_{name}.log")
        r[name] = row
        print(f"{name}: {row}", flush=True)

    r["fingerprint_rates"] = fingerprint_rates(cfg)
    r["cpu_int8_dot"] = int8_dot_flags()
    r["fingerprint_kernel"] = chunk_kernel()
    if not a.skip_qlora:
        qlora_rows(r, a.layers, cfg, hf, work, py, tr)
    r["targets"] = targets(r) + (qlora_targets(r) if "qlora" in r else [])
    out = a.output or work / "scale_results.json"
    out.write_text(json.dumps(r, indent=2, default=str))
    print(render(r))
    print(f"results: {out}")
    if not a.keep:
        for path in [base, *work.glob("lora_*"), *work.glob("peft_*")]:
            rmtree(path)


def nf4_bytes(cfg: dict[str, int]) -> int:
    """Bytes of the base held as a QLoRA run holds it: linear weights in NF4 (codes, scales, factors), the rest
    (embeddings, norms, output layer) in bf16."""
    from peftckpt.model import nf4

    total = 0
    for name, shape in hf_tensors(cfg).items():
        if len(shape) == 2 and ".layers." in name:
            held = nf4.stored_shapes(shape)
            total += math.prod(held["weight_nf4"]) + math.prod(held["weight_scales"]) + 4 * math.prod(held["weight_factors"])
        else:
            total += 2 * math.prod(shape)
    return total


def qlora_rows(r: dict[str, Any], layers: int, cfg: dict[str, int], hf: Path, work: Path, py: list[str],
               tr: list[str]) -> None:
    """Steps 7 (the 7B-shaped base at TP=1) and 8 (a 13B-shaped one, written if needed, at TP=2)."""
    r["qlora"] = qlora_row(cfg, hf, work, py, 1, "qlora")
    # --layers scales both bases alike (the default: each its own full depth)
    depth = max(1, round(SHAPE_13B["num_hidden_layers"] * layers / SHAPE["num_hidden_layers"]))
    cfg13 = dict(SHAPE_13B, num_hidden_layers=depth)
    hf13 = work / "hf13b"
    write_base(hf13, cfg13)
    r["qlora_13b"] = qlora_row(cfg13, hf13, work, tr, 2, "qlora_13b")
    r["qlora_13b"]["bf16_bytes"] = dir_bytes(hf13)


def qlora_row(cfg: dict[str, int], hf: Path, work: Path, launcher: list[str], tp: int, name: str) -> dict[str, Any]:
    """One process per TP rank, the HF base quantized to NF4 as it is read, 1 iteration, an adapter-only save."""
    save, metrics = work / f"lora_{name}", work / f"metrics_{name}.jsonl"
    rmtree(save)
    rmtree(metrics)
    evict(hf, "evict")
    row = run([*launcher, "train", "--bf16", "--base-quantization", "nf4", "--tensor-model-parallel-size", str(tp),
               "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data", "--lr",
               "1e-4", "--log-interval", "1", "--no-progress", *LORA, "--save-trainable-params-only",
               "--pretrained-checkpoint", str(hf), "--train-iters", "1", "--save", str(save), "--metrics-file",
               str(metrics)], work / f"train_{name}.log", first_line_of=metrics)
    row["tp"] = tp
    row["adapter_bytes"] = dir_bytes(save)
    row["nf4_base_bytes"] = nf4_bytes(cfg)
    log = (work / f"train_{name}.log").read_text()
    loaded = re.search(r"loaded base weights from .* in ([0-9.]+) s", log)
    row["base_load_and_quantize_s"] = float(loaded.group(1)) if loaded else None
    print(f"{name}: {row}", flush=True)
    return row


def qlora_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for name, label in (("qlora", "7B"), ("qlora_13b", "13B")):
        row = r.get(name)
        if row is None:
            continue
        share = row["nf4_base_bytes"] / row["tp"]  # this rank's share of the NF4 base (norms aside)
        worst = max(row["peak_rss"]) if row["peak_rss"] else float("nan")
        out.append({"target": f"qlora {label} (TP={row['tp']}, NF4): peak RSS per rank <= 1.3 x its NF4 share + 2 GiB",
                    "value": f"{worst / GIB:.2f} GiB", "limit": f"{(1.3 * share + 2 * GIB) / GIB:.2f} GiB",
                    "met": worst <= 1.3 * share + 2 * GIB})
    return out


def render_qlora(r: dict[str, Any]) -> list[str]:
    lines = []
    for name, label in (("qlora", "7B"), ("qlora_13b", "13B")):
        row = r.get(name)
        if row is None:
            continue
        bf16 = row.get("bf16_bytes", r["hf_bytes"])
        lines.append(f"qlora {label} (TP={row['tp']}, --base-quantization nf4 --bf16, from the HF directory): wall "
                     f"{row['wall_s']:.1f} s, launch->first step {row['first_step_s'] or float('nan'):.1f} s, base load "
                     f"+ quantization {row.get('base_load_and_quantize_s') or float('nan'):.1f} s, NF4 base "
                     f"{row['nf4_base_bytes'] / GIB:.2f} GiB (bf16: {bf16 / GIB:.2f} GiB), peak RSS per rank "
                     f"{', '.join(f'{v / GIB:.2f}' for v in row['peak_rss'])} GiB, adapter checkpoint "
                     f"{row['adapter_bytes'] / 2**20:.1f} MiB")
    return lines + [f"{'met ' if t['met'] else 'MISSED'} {t['target']}: {t['value']} (limit {t['limit']})"
                    for t in r["targets"] if t["target"].startswith("qlora")]


def fingerprint_rates(cfg: dict[str, int]) -> dict[str, float]:
    """G elements/s of each fingerprint version on one core, over one rank's TP=2 shard of an MLP weight (the
    fingerprint's CPU cost; a base load overlaps it with reading)."""
    from peftckpt.checkpoint.state.fingerprint import FINGERPRINT_VERSION, base_fingerprint
    from peftckpt.sharding.entries import GlobalTensor, Piece

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        shape = (cfg["intermediate_size"], cfg["hidden_size"])
        shard = torch.randn(shape[0] // 2, shape[1]).to(torch.bfloat16)
        entries = {"w": GlobalTensor(shape, shard.dtype, [Piece((0, 0), shard)])}
        rates = {}
        for version in (2, FINGERPRINT_VERSION):
            start = time.perf_counter()
            base_fingerprint(entries, distributed=False, version=version)
            rates[f"v{version}"] = shard.numel() / (time.perf_counter() - start) / 1e9
        return rates
    finally:
        torch.set_num_threads(threads)


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    share = r["hf_bytes"] / 2  # each rank's share of the bf16 base at TP=2 (embeddings aside)
    out = []
    for name in ("from_hf", "from_import"):
        row = r[name]
        worst = max(row["peak_rss"]) if row["peak_rss"] else float("nan")
        out.append({"target": f"{name}: peak RSS per rank <= 1.3 x share + 2 GiB",
                    "value": f"{worst / GIB:.2f} GiB", "limit": f"{(1.3 * share + 2 * GIB) / GIB:.2f} GiB",
                    "met": worst <= 1.3 * share + 2 * GIB})
        if "base_load_s" in row:
            raw = r["raw_read_hf_s" if name == "from_hf" else "raw_read_import_s"]
            ratio = raw / row["base_load_s"]
            out.append({"target": f"{name}: base load >= 0.9 x a balanced raw read (2 readers)", "value": f"{ratio:.2f}",
                        "limit": "0.90", "met": ratio >= 0.9})
        if row.get("read_bytes"):  # the whole run reads the base once, and the small rest (code, data)
            ratio = sum(row["read_bytes"]) / r["hf_bytes"]
            out.append({"target": f"{name}: bytes read from storage by the ranks <= 1.05 x the base (whole run)",
                        "value": f"{ratio:.3f}", "limit": "1.05", "met": ratio <= 1.05})
            if "fingerprint_s" in row:  # taken while reading: the time it added after the last read
                frac = row["fingerprint_s"] / row["base_load_s"]
                out.append({"target": f"{name}: fingerprint (time added to the base load) <= 10% of the base load",
                            "value": f"{frac:.1%}",
                            "limit": "10%", "met": frac <= 0.10})
    peak = max(r["import_hf"]["peak_rss"] or [0])
    out.append({"target": "import-hf peak RSS <= 3 GiB", "value": f"{peak / GIB:.2f} GiB", "limit": "3 GiB",
                "met": peak <= 3 * GIB})
    return out


def render(r: dict[str, Any]) -> str:
    lines = [f"base: {r['hf_bytes'] / GIB:.2f} GiB bf16 ({r['config']['num_hidden_layers']} layers); balanced raw read "
             f"(2 readers) of the HF files {r['raw_read_hf_s']:.1f} s ({r['hf_bytes'] / GIB / r['raw_read_hf_s']:.2f} "
             f"GiB/s), into fresh memory {r['raw_read_hf_fresh_s']:.1f} s; of the imported base "
             f"{r['raw_read_import_s']:.1f} s, into fresh memory {r['raw_read_import_fresh_s']:.1f} s",
             f"import-hf: {r['import_hf']['wall_s']:.1f} s, peak RSS {max(r['import_hf']['peak_rss'] or [0]) / GIB:.2f}"
             f" GiB, wrote {r['import_hf']['bytes_written'] / GIB:.2f} GiB"]
    for name in ("from_hf", "from_import"):
        row = r[name]
        lines.append(f"{name}: wall {row['wall_s']:.1f} s, launch->first step {row['first_step_s'] or float('nan'):.1f} s, "
                     f"base load {row.get('base_load_s', float('nan')):.1f} s, fingerprint "
                     f"{row.get('fingerprint_s', float('nan')):.1f} s, peak RSS/rank "
                     f"{', '.join(f'{v / GIB:.2f}' for v in row['peak_rss'])} GiB, read from storage per rank "
                     f"{', '.join(f'{v / GIB:.2f}' for v in row.get('read_bytes', []))} GiB, adapter checkpoint "
                     f"{row['adapter_bytes'] / 2**20:.1f} MiB; resume {row['resume']['wall_s']:.1f} s; "
                     f"export-peft {row['export_peft']['wall_s']:.1f} s")
    lines.append("fingerprint on one core: " + ", ".join(f"{v} {x:.2f} G elements/s"
                                                      for v, x in r.get("fingerprint_rates", {}).items())
                 + f" (int8 dot instructions: {', '.join(r.get('cpu_int8_dot', [])) or 'none'}; "
                   f"chunk kernel: {r.get('fingerprint_kernel', 'int_mm')})")
    if "qlora" in r:
        lines += [line for line in render_qlora(r) if not line.startswith(("met ", "MISSED"))]
    lines += [f"{'met ' if t['met'] else 'MISSED'} {t['target']}: {t['value']} (limit {t['limit']})"
              for t in r["targets"]]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
