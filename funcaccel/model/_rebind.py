"""Optimizers follow their parameters when sharding or materialising replaces them.

FSDP2, tensor parallelism and ``to_empty`` (a model built on ``meta``) put new
parameter objects in a module; an optimizer built before holds the old ones.
``rebind_by_name_`` points it, in place, at the new parameters under the same
names, moving (and sharding) its state with them.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence

import torch
from torch import nn

from funcaccel._checks import as_tuple_of
from funcaccel._dist_types import is_dtensor

__all__ = ["as_optimizers", "rebind_by_name_", "rebind_optimizers_"]


def as_optimizers(
    caller: str, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
) -> tuple[torch.optim.Optimizer, ...]:
    """Return ``optimizers`` (one, or a sequence, possibly empty) as a tuple.

    >>> as_optimizers("f", ())
    ()
    """
    if isinstance(optimizers, tuple) and not optimizers:
        return ()
    kind = torch.optim.Optimizer
    return as_tuple_of(optimizers, kind, caller=caller, name="optimizers")


def rebind_by_name_(
    optimizers: Sequence[torch.optim.Optimizer],
    before: Mapping[str, nn.Parameter],
    model: nn.Module,
) -> int:
    """Point ``optimizers`` at ``model``'s parameters that replaced, under the same
    names, those in ``before`` (``dict(model.named_parameters(remove_duplicate=False))``
    taken before sharding or materialising); see ``rebind_optimizers_``."""
    after = dict(model.named_parameters(remove_duplicate=False))
    replaced = {
        id(old): after[name]
        for name, old in before.items()
        if name in after and after[name] is not old
    }
    return rebind_optimizers_(optimizers, replaced)


def rebind_optimizers_(
    optimizers: Sequence[torch.optim.Optimizer],
    replaced: Mapping[int, nn.Parameter],
) -> int:
    """Point ``optimizers`` in place at the parameters that replaced their own.

    ``replaced`` maps ``id(old parameter)`` to the parameter that took its place.
    Each param group keeps its order and hyperparameters; a replaced parameter's
    optimizer state moves to the new one, and a state tensor of the old
    parameter's shape (a momentum, Adam's moments) is sharded as the new
    parameter is (each rank keeps its own rows, as ``fully_shard`` does with the
    parameter itself); other state (``step``) is kept as it is.

    Returns:
        How many parameter entries were replaced.
    """
    count = 0
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            params: list[torch.Tensor] = []
            for old in group["params"]:
                new = replaced.get(id(old))
                if new is None:
                    params.append(old)
                    continue
                state = optimizer.state.pop(old, None)
                if state:
                    optimizer.state[new] = {
                        key: _sharded_like(value, old, new)
                        for key, value in state.items()
                    }
                params.append(new)
                count += 1
            group["params"] = params
    return count


def _sharded_like(value: object, old: torch.Tensor, new: torch.Tensor) -> object:
    if not (
        isinstance(value, torch.Tensor)
        and not is_dtensor(value)
        and is_dtensor(new)
        and value.dim() > 0
        and value.shape == old.shape
    ):
        return value
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank slices its own copy, as fully_shard does with
    # the parameter, so no rank's state is overwritten by another's.
    return distribute_tensor(
        value.to(new.device_mesh.device_type),
        new.device_mesh,
        new.placements,
        src_data_rank=None,
    )
