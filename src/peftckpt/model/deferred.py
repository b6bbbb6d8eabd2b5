"""Parameters that know how to initialise themselves, so a model can be built without values.

Every parameter of the GPT (and of its adapters) is created by :func:`sharded_param` with a
:class:`ShardedInit`: a function that returns the *full* (global, canonical) initial tensor and how that
tensor is split over tensor parallelism. Built on a real device, the parameter is filled at once; built on
the meta device, it has a shape and nothing else until :func:`materialize` allocates this rank's shards
(``to_empty``) and :func:`init_parameters` fills those that need values -- one full tensor at a time, sliced
to this rank's shard and dropped, so the values are the same whichever way the model was built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.tensor_parallel import TensorParallel, local_tensor

__all__ = ["ShardedInit", "ParamFilter", "PARAM_INITS_ATTR", "sharded_param", "init_parameters", "materialize",
           "is_meta"]

#: Attribute (a ``dict[param_name, ShardedInit]``) of a module whose parameters were made by :func:`sharded_param`.
PARAM_INITS_ATTR = "_peftckpt_param_inits"

#: ``include(full_name, param)`` decides which parameters :func:`init_parameters` fills.
ParamFilter = Callable[[str, nn.Parameter], bool]


@dataclass(frozen=True)
class ShardedInit:
    """How to produce one parameter's value: ``full()`` is the global initial tensor, of which the rank keeps
    its shard along ``dim`` (``None`` = replicated) of each of ``num_chunks`` blocks (see
    :meth:`TensorParallel.shard_of`)."""

    full: Callable[[], torch.Tensor]
    tp: TensorParallel
    dim: int | None
    num_chunks: int = 1

    def fill(self, param: nn.Parameter) -> None:
        """Generate the full tensor, copy this rank's shard into ``param`` (cast to its dtype), drop it."""
        self.tp.fill_param(param, self.full(), self.dim, self.num_chunks)


def sharded_param(module: nn.Module, name: str, shape: Sequence[int], init: ShardedInit, *,
                  device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                  requires_grad: bool = True) -> nn.Parameter:
    """Register ``module.<name>``: this rank's shard of a global tensor of ``shape``, on ``device``.

    The parameter is initialised at once unless ``device`` is the meta device; ``init`` is kept on the module
    for :func:`init_parameters` either way."""
    param = init.tp.empty_param(shape, init.dim, init.num_chunks, dtype=dtype, device=device,
                                requires_grad=requires_grad)
    setattr(module, name, param)  # (not register_parameter: it refuses a name that is a plain attribute now)
    inits: dict[str, ShardedInit] = dict(getattr(module, PARAM_INITS_ATTR, {}))
    inits[name] = init
    setattr(module, PARAM_INITS_ATTR, inits)
    if not local_tensor(param).is_meta:
        init.fill(param)
    return param


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is still on the meta device (has no storage)."""
    return any(local_tensor(p).is_meta for p in module.parameters())


def init_parameters(root: nn.Module, include: ParamFilter | None = None) -> list[str]:
    """Fill the parameters under ``root`` made by :func:`sharded_param` (those ``include`` accepts, default
    all) with their initial values; returns the names filled. The parameters must have storage (see
    :func:`materialize`). At most one full tensor exists at a time."""
    filled: list[str] = []
    for prefix, module in root.named_modules():
        for name, init in getattr(module, PARAM_INITS_ATTR, {}).items():
            param = module._parameters.get(name)
            if param is None:
                continue
            full_name = f"{prefix}.{name}" if prefix else name
            if include is None or include(full_name, param):
                init.fill(param)
                filled.append(full_name)
    return filled


def materialize(root: nn.Module, device: torch.device | str = "cpu", include: ParamFilter | None = None) -> list[str]:
    """Allocate storage for a module built on the meta device (``to_empty``: this rank's shards only) and
    initialise the parameters ``include`` accepts; the others stay *uninitialised* until a checkpoint is
    loaded into them. Returns the names initialised.

    Every tensor of ``root`` gets new, empty storage: call this on a module whose tensors all live on the
    meta device, never on one that already holds values."""
    real = [n for n, p in root.named_parameters() if not local_tensor(p).is_meta]
    real += [n for n, b in root.named_buffers() if not b.is_meta]
    if real:
        raise RuntimeError(f"materialize() needs a module built on the meta device; {real[:3]} hold values "
                           "that to_empty would discard")
    root.to_empty(device=device)
    return init_parameters(root, include)
