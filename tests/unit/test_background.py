"""Background save threads keep their torch work on one core: OpenMP would give each such thread a team of
spinning workers on the cores training uses (see ``peftckpt.checkpoint.background``)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from peftckpt.checkpoint import background
from peftckpt.checkpoint.background import one_core
from peftckpt.checkpoint.options import SaveOptions

from .small_model import small_checkpointer


def test_one_core_limits_the_calling_thread_only() -> None:
    runtime = background._openmp()
    assert runtime is not None  # torch on Linux runs its CPU kernels on the OpenMP runtime it ships
    before = runtime.omp_get_max_threads()
    seen: list[int] = []

    def limited() -> None:
        one_core()
        seen.append(runtime.omp_get_max_threads())
        torch.ones(1 << 20).mul_(2)  # a parallel region, on this thread alone
    thread = threading.Thread(target=limited)
    thread.start()
    thread.join()
    assert seen == [1]
    assert runtime.omp_get_max_threads() == before and torch.get_num_threads() == before  # training's untouched


def test_a_deferred_async_saves_thread_runs_on_one_core(tmp_path: Path) -> None:
    runtime = background._openmp()
    assert runtime is not None
    ckpt, _ = small_checkpointer()
    ckpt.save(tmp_path / "run", 1, options=SaveOptions(async_save=True, defer_snapshot=True))
    ckpt.wait()
    worker = ckpt._saves.worker
    assert worker is not None and worker.submit(runtime.omp_get_max_threads).result() == 1
    ckpt.close()
