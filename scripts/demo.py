"""`make demo`: the whole product on a laptop-sized GPT, on CPU, in about a minute.

1. pretrain a tiny Llama-style GPT at TP=2 x PP=2 (4 processes) and save a full torch_dist checkpoint;
2. LoRA fine-tune from it with --save-trainable-params-only, stopping at iteration 10;
3. resume from the adapter-only checkpoint (+ the base) to iteration 20;
4. verify the checkpoint offline and print full vs adapter-only sizes.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

OUT = Path("demo_out")
MODEL = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "8", "--num-query-groups", "4",
         "--ffn-hidden-size", "256", "--vocab-size", "256", "--seq-length", "64", "--micro-batch-size", "4",
         "--global-batch-size", "16", "--mock-data", "--log-interval", "5"]
LAYOUT = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
LORA = ["--lora-rank", "8", "--lora-alpha", "16", "--lr", "5e-3", "--train-iters", "20", "--lr-warmup-iters", "2",
        "--pretrained-checkpoint", str(OUT / "base"), "--save", str(OUT / "lora"), "--load", str(OUT / "lora"),
        "--save-interval", "10", "--save-trainable-params-only"]


def torchrun(*args: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "peftckpt", "train", *args]
    print("\n$ " + " ".join(["torchrun", "--nproc-per-node", "4", "-m", "peftckpt", "train", *args]), flush=True)
    subprocess.run(cmd, check=True)


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines() if "loss" in json.loads(line)]


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    print("== 1. pretrain the base (all parameters trainable), save a full checkpoint")
    torchrun(*MODEL, *LAYOUT, "--lr", "1e-2", "--train-iters", "40", "--save", str(OUT / "base"),
             "--metrics-file", str(OUT / "pretrain.jsonl"))
    print("== 2. LoRA fine-tune on the frozen base, adapter-only checkpoints; stop at iteration 10")
    torchrun(*MODEL, *LAYOUT, *LORA, "--exit-interval", "10", "--metrics-file", str(OUT / "lora.jsonl"))
    print("== 3. resume from the adapter-only checkpoint (+ base) and train to iteration 20")
    torchrun(*MODEL, *LAYOUT, *LORA, "--metrics-file", str(OUT / "lora.jsonl"))
    print("\n== 4. verify offline")
    subprocess.run([sys.executable, "-m", "peftckpt", "verify", str(OUT / "lora")], check=True)
    base = OUT / "base" / "iter_0000040"
    adapter = OUT / "lora" / "iter_0000020"
    base_bytes, adapter_bytes = size(base), size(adapter)
    manifest = json.loads((adapter / "metadata.json").read_text())
    pre, ft = losses(OUT / "pretrain.jsonl"), losses(OUT / "lora.jsonl")
    print(f"\npretrain loss   {pre[0]:.3f} -> {pre[-1]:.3f}")
    print(f"LoRA loss       {ft[0]:.3f} -> {ft[-1]:.3f} (iterations 1-10, then resumed 11-20)")
    print(f"full checkpoint        {base_bytes / 1e6:8.2f} MB  ({base})")
    print(f"adapter-only checkpoint {adapter_bytes / 1e6:7.2f} MB  ({adapter}), "
          f"{len(manifest['saved_keys'])} adapter tensors saved, {len(manifest['excluded_keys'])} frozen left out")
    print(f"adapter-only / full = {adapter_bytes / base_bytes:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
