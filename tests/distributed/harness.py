"""Run a function on N real gloo ranks (spawned processes) and get every rank's return value.

A rank's exception is re-raised in the test with that rank's traceback.
"""

from __future__ import annotations

import gc
import io
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            queue: Any, environ: dict[str, str], cwd: str) -> None:
    # A forkserver child starts with the server's environment and directory: take the test's.
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
        result = fn(rank, world_size, *args)
        # Serialise here: tensors sent through the queue as shared memory die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        gc.collect()  # while the group exists (see examples/dtensor_tp_lora.py: DTensor leaves cycles behind)
        if dist.is_initialized():
            dist.destroy_process_group()


_PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.tensor",
            "torch.distributed.pipelining", "peftckpt.checkpoint.api", "peftckpt.train.trainer"]


def _context() -> Any:
    """Ranks are forked from a server that imported torch and peftckpt once (a few seconds saved per rank
    over ``spawn``); the server itself never runs a torch op or joins a process group."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RankError(RuntimeError):
    pass


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 600) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` ranks; returns the results in rank order.

    ``fn`` must be a module-level function (it is pickled into the spawned processes).
    """
    ctx = _context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, dict(os.environ), os.getcwd()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely stuck in a collective
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankError("a rank failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
