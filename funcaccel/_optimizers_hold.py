"""Whether each optimizer still holds the model's parameters after sharding.

FSDP2 and tensor parallelism replace a model's parameters with new (``DTensor``)
ones, so an optimizer built before ``wrap_model`` and not passed to it would
update parameters the model no longer uses. ``accumulate_step`` refuses that on
its first step, with the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from funcaccel._dist_types import is_dtensor
from funcaccel._dist_types import is_fsdp_module

__all__ = ["check_optimizers_hold"]


def check_optimizers_hold(
    caller: str,
    models: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
) -> None:
    """Raise unless every optimizer holds a parameter of one of ``models``.

    Only FSDP2 and tensor parallelism replace parameters (with ``DTensor`` ones),
    so nothing is checked when no model is FSDP2 and none holds a ``DTensor``. In
    the usual case the first parameter of each optimizer is among the first
    parameters of the model, and the check stops there.

    Raises:
        ValueError: an optimizer that holds none of the models' parameters (it was
            built before ``wrap_model`` sharded them).
    """
    if not any(
        is_fsdp_module(model) or any(is_dtensor(p) for p in model.parameters())
        for model in models
    ):
        return
    for index, optimizer in enumerate(optimizers):
        groups = optimizer.param_groups
        first = next((g["params"][0] for g in groups if g["params"]), None)
        if first is None or _holds(models, first):
            continue
        owned = {id(p) for model in models for p in model.parameters()}
        if any(id(p) in owned for group in groups for p in group["params"]):
            continue
        name = "optimizer" if len(optimizers) == 1 else f"optimizer[{index}]"
        msg = (
            f"{caller}: {name} holds none of the model's parameters: "
            "wrap_model(..., fsdp=FSDPOptions(...)) or a tp_plan replaced them with "
            "sharded parameters, so an optimizer built before it would never change "
            "the model. Pass it to wrap_model(ctx, model, fsdp=..., optimizers="
            "optimizer), which re-points it at the new parameters, or build the "
            "optimizer after wrap_model from model.parameters()."
        )
        raise ValueError(msg)


def _holds(models: Sequence[nn.Module], param: torch.Tensor) -> bool:
    return any(p is param for model in models for p in model.parameters())
