"""The training step a memory estimate runs on fake tensors, and its fake inputs.

``accumulate_step_fn`` wraps the model as ``wrap_model`` would for the rank
(or keeps it whole for DDP and one process, which hold all of it) and returns
one ``accumulate_step`` on the fake batch; a pipeline's step is
``_pipeline_memory.cut_and_step``. ``fake_batch`` turns the caller's batch
(real or ``meta`` tensors) into fake tensors of the same shapes and dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from typing import Any
from typing import TypeAlias

import torch
from torch import nn

from funcaccel._tree import tree_map
from funcaccel._typing import MixedPrecision
from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.flops import output_loss
from funcaccel.grad_state import GradState
from funcaccel.model import apply_activation_checkpointing
from funcaccel.model import wrap_model

__all__ = ["StepFn", "accumulate_step_fn", "fake_batch", "no_init"]

StepFn: TypeAlias = Callable[[GradState, torch.optim.Optimizer], GradState]
"""One training step of a plan: the accumulation state in, the next one out."""


def no_init(module: nn.Module) -> None:
    """Initialise nothing: ``wrap_model``'s ``init_fn`` for fake tensors."""
    del module  # fake tensors: their values do not matter, only their sizes


def fake_batch(mode: Any, batch: object) -> object:
    """``batch`` with each tensor made a fake one of ``mode`` (same shape and dtype)."""

    def fake(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_meta:
            with mode:
                return torch.empty(x.shape, dtype=x.dtype, device="cpu")
        return mode.from_tensor(x)

    return tree_map(fake, batch)


def _call(model: nn.Module, batch: object) -> object:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


def accumulate_step_fn(
    ctx: DistributedContext,
    model: nn.Module,
    fake: object,
    wrap_kwargs: Mapping[str, Any],
    *,
    whole: bool,
    mixed_precision: MixedPrecision,
    loss_fn: Callable[[Any], torch.Tensor] | None,
) -> tuple[nn.Module, StepFn]:
    """Wrap ``model`` as the run does; return it and one ``accumulate_step`` on ``fake``.

    ``whole``: the model is kept as it is (DDP, one process) and only its
    blocks are checkpointed, as ``wrap_kwargs``' ``activation_checkpointing``
    asks; else ``wrap_model(ctx, model, **wrap_kwargs)``.
    """
    step_ctx = ctx
    if whole:
        # Each DDP rank holds the whole model; its step is one process's.
        # wrap_model would only move it and checkpoint its blocks, done here.
        step_ctx = DistributedContext(mixed_precision=mixed_precision)
        wrapped = model
        checkpointing = wrap_kwargs.get("activation_checkpointing")
        if checkpointing is not None:
            apply_activation_checkpointing(wrapped, checkpointing)
    else:
        wrapped = wrap_model(ctx, model, **wrap_kwargs)
    compute_loss = loss_fn or output_loss

    def step(grad: GradState, optimizer: torch.optim.Optimizer) -> GradState:
        _, grad = accumulate_step(
            step_ctx,
            grad,
            wrapped,
            optimizer,
            lambda: compute_loss(_call(wrapped, fake)),
        )
        return grad

    return wrapped, step
