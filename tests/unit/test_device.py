"""``--device``: what ``auto`` picks, the refusal of a device this process cannot use, the backend for each, and
the RNG state a checkpoint records for the device in use."""

from __future__ import annotations

import pytest
import torch

from peftckpt.checkpoint.state.sections import restore_rng, rng_entry
from peftckpt.parallel.device import backend_for, resolve_device


def test_auto_picks_cuda_only_where_a_gpu_is_visible() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert backend_for(torch.device("cpu")) == "gloo"
    # tensors on the GPU over NCCL; the checkpointer's objects and host tensors over gloo
    assert backend_for(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"


def test_cuda_without_a_gpu_is_one_clear_refusal() -> None:
    if torch.cuda.is_available():  # a GPU machine: this rank's GPU, made current
        assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
    else:
        with pytest.raises(ValueError, match=r"^--device cuda: this process sees no CUDA device .*; use --device cpu$"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="--device 'tpu': expected one of auto, cpu, cuda"):
        resolve_device("tpu")


def test_rng_state_holds_the_cuda_generator_only_where_cuda_is_used() -> None:
    entry = rng_entry()
    assert ("cuda" in entry) == torch.cuda.is_initialized()
    torch.manual_seed(3)
    entry = rng_entry()
    first = torch.rand(4)
    torch.rand(7)
    # a checkpoint of an earlier release listed every visible GPU's state: on a CPU-only run it is ignored
    restore_rng({**entry, "cuda": [] if not torch.cuda.is_available() else entry.get("cuda", [])})
    assert torch.equal(torch.rand(4), first)
