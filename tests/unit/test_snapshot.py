"""The call state of a deferred async save: what the training thread records before the call returns."""

from __future__ import annotations

import torch
from torch import nn

from peftckpt.checkpoint.snapshot import take_call_state


def _buffer_values(model: nn.Module) -> list[torch.Tensor]:
    return [copied for _, copied in take_call_state([model], None).buffers]


def test_buffers_are_found_after_the_module_tree_or_a_buffer_changes() -> None:
    """The module lists kept between calls follow the tree: a submodule added after a first call has its buffers
    taken; a buffer replaced (as ``Module.to`` does) is taken as it is now, not as it was."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    first = _buffer_values(model)
    assert len(first) == 3  # running mean, running var, batches tracked

    model.add_module("extra", nn.BatchNorm1d(2))
    assert len(_buffer_values(model)) == 6
    model.late = nn.Sequential(nn.BatchNorm1d(3))  # setattr registers a module too
    assert len(_buffer_values(model)) == 9

    model[1].running_mean = torch.full((4,), 7.0)  # a buffer replaced by a new tensor
    assert any(torch.equal(t, torch.full((4,), 7.0)) for t in _buffer_values(model))
    model.to(torch.float64)  # Module.to replaces every floating-point buffer tensor
    assert {t.dtype for t in _buffer_values(model) if t.is_floating_point()} == {torch.float64}


def test_a_step_is_told_by_the_parameters_and_names_their_state() -> None:
    """Only the parameters' version counters are read at the call; the optimizer state moves with them."""
    model = nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    call = take_call_state([model], opt)
    owners = call.owners()
    weight = model.weight.untyped_storage().data_ptr()
    moments = [v.untyped_storage().data_ptr() for v in opt.state[model.weight].values()]
    assert all(owners[m] == weight for m in moments) and owners[weight] == weight
    assert call.moved() == set()
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert weight in call.moved()
