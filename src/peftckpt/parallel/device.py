"""The device a rank computes on (``--device``) and the process-group backend that goes with it.

``auto`` is CUDA when this process sees a GPU, else the CPU. On CUDA, the rank's GPU is ``LOCAL_RANK`` (as
``torchrun`` sets it) modulo the GPUs it sees, and the default process group is ``cpu:gloo,cuda:nccl``:
collectives of CUDA tensors (gradients, activations between pipeline stages) go over NCCL, those of CPU
tensors and Python objects (the checkpointer's agreements, DCP's planning, a signal's stop vote) over gloo.
So the same code runs on either device, and a CPU run goes through every path a GPU run takes but NCCL.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported when a device is resolved: the flags are parsed without it
    import torch

__all__ = ["DEVICES", "resolve_device", "backend_for"]

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` of ``--device name`` for this rank (made the current CUDA device). ``ValueError``
    naming the flag when it cannot be had."""
    import torch

    if name not in DEVICES:
        raise ValueError(f"--device {name!r}: expected one of {', '.join(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: this process sees no CUDA device (torch.cuda.is_available() is False"
                         f"{'' if torch.version.cuda else ': this torch is a CPU build'}); use --device cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def backend_for(device: torch.device) -> str:
    """The default process group's backend for ranks computing on ``device``."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
