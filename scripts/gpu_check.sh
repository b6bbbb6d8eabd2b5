#!/usr/bin/env bash
# The GPU check (not run by CI, which has no GPU): on a machine with one or more CUDA GPUs, LoRA with
# adapter-only checkpoints at the largest TP the GPUs allow, an exact resume, a reshard to TP=1, an async save;
# prints losses, timings and checkpoint sizes, and exits non-zero if a check fails.
#
#   scripts/gpu_check.sh            # from the repository root, after `make venv`
#   DEVICE=cpu NPROC=2 scripts/gpu_check.sh   # the same sequence on the CPU (gloo), e.g. to try the script
#
# Environment: DEVICE (cuda), NPROC (every visible GPU), WORK (a temporary directory), PYTHON (.venv/bin/python).
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
if [[ -z "${NPROC:-}" ]]; then
    NPROC=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if '$DEVICE' == 'cuda' else 2)")
fi
if [[ "$NPROC" -lt 1 ]]; then
    echo "gpu_check: no CUDA device visible (torch.cuda.device_count() is 0); DEVICE=cpu runs it on the CPU" >&2
    exit 2
fi
TP=1
while [[ $((TP * 2)) -le "$NPROC" && $((TP * 2)) -le 8 ]]; do TP=$((TP * 2)); done
WORK=${WORK:-$(mktemp -d -t peftckpt-gpu-check.XXXXXX)}
mkdir -p "$WORK"

# A ~1.3B-parameter Llama-shaped model on GPUs (bf16 base); a tiny one on the CPU.
if [[ "$DEVICE" == "cuda" ]]; then
    MODEL=(--num-layers 16 --hidden-size 2048 --ffn-hidden-size 5504 --num-attention-heads 16
           --num-query-groups 8 --vocab-size 32000 --seq-length 1024 --micro-batch-size 2 --global-batch-size 16)
else
    MODEL=(--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8 --num-query-groups 8
           --vocab-size 256 --seq-length 32 --micro-batch-size 2 --global-batch-size 8)
fi
COMMON=("${MODEL[@]}" --mock-data --device "$DEVICE" --log-interval 1 --no-progress --seed 7 --deterministic)
LORA=(--lora-rank 16 --lora-dropout 0.1 --bf16 --save-trainable-params-only --pretrained-checkpoint "$WORK/base")

run() {  # run NAME NPROC FLAGS...: one training run, its wall time and metrics file
    local name=$1 nproc=$2
    shift 2
    local start=$SECONDS
    "$(dirname "$PYTHON")/torchrun" --standalone --nproc-per-node "$nproc" -m peftckpt train "${COMMON[@]}" \
        --metrics-file "$WORK/$name.jsonl" "$@" > "$WORK/$name.log" 2>&1 \
        || { echo "gpu_check: run '$name' failed; its output:" >&2; tail -50 "$WORK/$name.log" >&2; exit 1; }
    echo "$name: $((SECONDS - start)) s"
}

echo "gpu_check: $NPROC process(es) on $DEVICE, TP=$TP; work directory $WORK"
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"
# 1. a base (full checkpoint), briefly trained so that the adapters start from something
run base "$TP" --tensor-model-parallel-size "$TP" --train-iters 4 --save "$WORK/base"
# 2. LoRA, 12 iterations straight (the reference)
run straight "$TP" --tensor-model-parallel-size "$TP" "${LORA[@]}" --train-iters 12
# 3. the same run stopped after 6 (async adapter-only saves every 3), then resumed from its checkpoint
run first "$TP" --tensor-model-parallel-size "$TP" "${LORA[@]}" --train-iters 12 --exit-interval 6 \
    --save "$WORK/lora" --save-interval 3 --async-save
run resumed "$TP" --tensor-model-parallel-size "$TP" "${LORA[@]}" --train-iters 12 --load "$WORK/lora" \
    --save "$WORK/lora" --save-interval 3
# 4. the adapter resharded to TP=1 (one process): the evaluation loss of the same model at both layouts
EVAL=("${MODEL[@]}" --mock-data --device "$DEVICE" --bf16 --pretrained-checkpoint "$WORK/base" --load "$WORK/lora" --json)
"$(dirname "$PYTHON")/torchrun" --standalone --nproc-per-node "$TP" -m peftckpt eval "${EVAL[@]}" \
    --tensor-model-parallel-size "$TP" > "$WORK/eval_tp.json"
"$PYTHON" -m peftckpt eval "${EVAL[@]}" > "$WORK/eval_tp1.json"
"$PYTHON" -m peftckpt verify "$WORK/lora" > /dev/null

"$PYTHON" - "$WORK" "$TP" <<'EOF'
import json
import sys
from pathlib import Path

work, tp = Path(sys.argv[1]), int(sys.argv[2])


def losses(name):
    return [r["loss"] for r in map(json.loads, (work / f"{name}.jsonl").read_text().splitlines()) if "loss" in r]


def size(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


straight, first, resumed = losses("straight"), losses("first"), losses("resumed")
print("losses (straight):", " ".join(f"{x:.5f}" for x in straight))
print("losses (resumed): ", " ".join(f"{x:.5f}" for x in first + resumed))
tracker = (work / "lora" / "latest_checkpointed_iteration.txt").read_text().strip()
base = next(p for p in (work / "base").iterdir() if p.name.startswith("iter_"))
adapter = work / "lora" / f"iter_{int(tracker):07d}"
print(f"checkpoint sizes: base (full) {size(base) / 1e6:.1f} MB, adapter-only {size(adapter) / 1e6:.2f} MB "
      f"({size(adapter) / size(base):.4f} of the base)")
tp_loss = json.loads((work / "eval_tp.json").read_text())["loss"]
tp1_loss = json.loads((work / "eval_tp1.json").read_text())["loss"]
print(f"eval loss of the adapter: TP={tp} {tp_loss:.6f}, resharded to TP=1 {tp1_loss:.6f}")
failures = []
if first + resumed != straight:
    failures.append("the resumed run's losses differ from the straight run's (not bit-exact)")
if abs(tp_loss - tp1_loss) > 2e-2 * abs(tp1_loss):  # bf16 base: the layouts round differently
    failures.append(f"eval losses at TP={tp} and TP=1 differ by more than 2%")
for failure in failures:
    print("FAILED:", failure)
print("gpu_check: OK" if not failures else "gpu_check: FAILED")
sys.exit(1 if failures else 0)
EOF
