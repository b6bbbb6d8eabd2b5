"""The examples are tests: each trains a tiny model on 2 real ranks, saves adapter-only with peftckpt, resumes
exactly (the resumed losses equal those of an uninterrupted run, bit for bit) and exports; the exports are
checked against the trained model. One more test runs both scripts as the README shows them, under torchrun."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ..distributed.harness import run_distributed

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> ModuleType:
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)


def _fsdp2_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    ex = _example("fsdp2_hf_peft")
    straight = ex.train(f"{root}/straight", steps=4, save_every=2)
    first = ex.train(f"{root}/resumed", steps=2, save_every=2)
    resumed = ex.train(f"{root}/resumed", steps=4, save_every=2, adapter_seed=7)  # adapters come from the load
    # the trained model's logits (FSDP2: every rank takes part), then rank 0 checks the PEFT export against them
    model = ex.build(adapter_seed=9)
    from peftckpt import Checkpointer

    Checkpointer(model).load(f"{root}/resumed")
    tokens = ex.batch(100, 0)
    with torch.no_grad():
        trained = model(input_ids=tokens).logits
    out: dict[str, Any] = {"straight": straight, "resumed": first + resumed}
    if rank == 0:
        from peft import PeftModel
        from transformers import LlamaConfig, LlamaForCausalLM

        exported = ex.export_peft(f"{root}/resumed", f"{root}/peft")
        torch.manual_seed(0)
        base = LlamaForCausalLM(LlamaConfig(**ex.CONFIG))
        with torch.no_grad():
            out["adapter_changed"] = (trained - base(input_ids=tokens).logits).abs().max().item()
            peft_model = PeftModel.from_pretrained(base, str(exported))  # wraps `base` in place
            out["export_error"] = (peft_model(input_ids=tokens).logits - trained).abs().max().item()
    dist.barrier()
    return out


def test_fsdp2_hf_peft_example(tmp_path: Path) -> None:
    results = run_distributed(_fsdp2_worker, 2, str(tmp_path))
    for r in results:
        assert len(r["straight"]) == 4
        assert r["resumed"] == r["straight"], "the resumed run's losses differ from the uninterrupted run's"
    assert results[0]["export_error"] < 1e-5
    assert results[0]["adapter_changed"] > 1e-3  # the check above would see a missing adapter


def _tp_worker(rank: int, world: int, root: str) -> dict[str, Any]:
    ex = _example("dtensor_tp_lora")
    straight = ex.train(f"{root}/straight", steps=4, save_every=2)
    first = ex.train(f"{root}/resumed", steps=2, save_every=2)
    resumed = ex.train(f"{root}/resumed", steps=4, save_every=2, adapter_seed=7)
    from torch.distributed.device_mesh import init_device_mesh

    from peftckpt import Checkpointer

    model = ex.build(adapter_seed=9, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    Checkpointer(model).load(f"{root}/resumed")
    tokens = ex.batch(100)
    with torch.no_grad():
        trained = model(tokens)
    alone = dist.new_group([0])
    out: dict[str, Any] = {"straight": straight, "resumed": first + resumed}
    if rank == 0:
        from safetensors.torch import load_file

        single, path = ex.export_merged(f"{root}/resumed", f"{root}/merged.safetensors", process_group=alone)
        merged = ex.build(adapter_seed=9, mesh=None)
        for block in merged.blocks:
            torch.nn.init.zeros_(block.down.lora_b.weight)
        merged.load_state_dict(load_file(str(path)), strict=False)
        with torch.no_grad():
            out["reshard_error"] = (single(tokens) - trained).abs().max().item()  # TP=2 checkpoint at TP=1
            out["merge_error"] = (merged(tokens) - trained).abs().max().item()
    dist.barrier()
    return out


def test_dtensor_tp_example(tmp_path: Path) -> None:
    results = run_distributed(_tp_worker, 2, str(tmp_path))
    for r in results:
        assert len(r["straight"]) == 4
        assert r["resumed"] == r["straight"], "the resumed run's losses differ from the uninterrupted run's"
    assert results[0]["reshard_error"] < 1e-5 and results[0]["merge_error"] < 1e-5


def test_examples_run_as_the_readme_shows(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    for script in ("fsdp2_hf_peft.py", "dtensor_tp_lora.py"):
        work = tmp_path / script.removesuffix(".py")
        done = subprocess.run([*torchrun, str(EXAMPLES / script), "--workdir", str(work), "--steps", "2",
                               "--save-every", "1"], capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "losses:" in done.stdout and "exported:" in done.stdout, done.stdout
        assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_single_process_example(tmp_path: Path) -> None:
    """The one-process loop in this process: a run stopped after step 5 (its last checkpoint at 4) and resumed
    gives the losses of a run never interrupted, bit for bit; a checkpoint holds the adapters and their Adam
    moments, not the frozen base."""
    ex = _example("single_process_lora")
    straight = ex.train(str(tmp_path / "straight"), steps=8, save_every=2)
    first = ex.train(str(tmp_path / "resumed"), steps=8, save_every=2, stop_at=5)
    second = ex.train(str(tmp_path / "resumed"), steps=8, save_every=2)
    assert list(straight) == list(range(1, 9)) and list(first) == list(range(1, 6))
    assert list(second) == list(range(5, 9)), "the resume did not start after the newest checkpoint (step 4)"
    assert {**first, **second} == straight, "the resumed run's losses differ from the uninterrupted run's"
    assert sum(list(straight.values())[-3:]) < sum(list(straight.values())[:3])  # it learns
    sizes = ex.checkpoint_bytes(str(tmp_path / "straight"))
    base = sum(p.numel() * p.element_size() for p in ex.build().parameters() if not p.requires_grad)
    assert len(sizes) == 4 and max(sizes.values()) < base / 2, (sizes, base)


def test_single_process_example_as_the_readme_shows(tmp_path: Path) -> None:
    """The README's commands for the one-process example, as pasted (``.venv/bin/python`` is this interpreter),
    print the losses of an uninterrupted run after the resume, and nothing on stderr: no warnings, no torch
    notice about a missing process group; and the README's library snippet is this example's loop."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    snippet = re.search(r"^### As a library\n\n```python\n(.*?)^```", readme, re.S | re.M)
    assert snippet is not None
    loop = snippet.group(1).split("\n\n", 1)[1]  # after the import line
    source = (EXAMPLES / "single_process_lora.py").read_text()
    assert "\n".join("    " + line if line else line for line in loop.splitlines()) in source
    assert snippet.group(1).split("\n\n", 1)[0] in source  # the import
    commands = [line.split() for line in readme.splitlines() if line.startswith(".venv/bin/python examples/single")]
    assert len(commands) == 2
    work = tmp_path / "work"
    printed: list[tuple[int, str]] = []
    for command in commands:
        command = [sys.executable, *command[1:]]
        command[command.index("--workdir") + 1] = str(work)
        done = subprocess.run(command, cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
        printed += [(int(step), loss) for step, loss in re.findall(r"^step +(\d+) +loss (\S+)$", done.stdout, re.M)]
    straight = _example("single_process_lora").train(str(tmp_path / "straight"), steps=12)
    # steps 1-7, then 7-12: step 7 ran before the stop and again after the resume from step 6
    assert [step for step, _ in printed] == [*range(1, 8), *range(7, 13)], printed
    assert printed == [(step, f"{straight[step]:.6f}") for step, _ in printed], "losses differ from a straight run's"

