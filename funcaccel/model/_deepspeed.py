"""``wrap_deepspeed``: a DeepSpeed ZeRO engine that owns the model and its optimizer.

DeepSpeed is imported here only, when an engine is built; ``import funcaccel``
never imports it. ``accumulate_step`` drives the engine's accumulation from the
``GradState`` (``funcaccel._deepspeed_step``); docs/deepspeed.md has the rules.
"""

from __future__ import annotations

import os
from typing import Any
from typing import Final

import torch
import torch.distributed as dist
from torch import nn

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._typing import Stateful
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.grad_state import GradState
from funcaccel.model._deepspeed_options import DeepSpeedOptions
from funcaccel.model._deepspeed_options import merged_config
from funcaccel.model._wrappers import check_unwrapped

__all__ = ["build_engine", "wrap_deepspeed"]

_SYNC_EACH_BATCH: Final = (
    "False for a DeepSpeed engine, whose ZeRO stages reduce gradients themselves"
)
_ONE_OPTIMIZER: Final = "exactly one optimizer built on the model's parameters"
_STATEFUL: Final = "an object with state_dict()/load_state_dict(), or None"


class _HeldScheduler:
    """A scheduler the engine saves and loads with its checkpoints, but never steps.

    ``maybe_step_scheduler`` steps the user's scheduler by funcaccel's rules (once
    per process per applied update, never on a skipped fp16 step), as on the DDP
    path; the engine would otherwise step it once more on every update.
    """

    def __init__(self, scheduler: Stateful) -> None:
        self.scheduler = scheduler

    def step(self, *args: object, **kwargs: object) -> None:
        del args, kwargs  # stepped by maybe_step_scheduler instead

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)


def wrap_deepspeed(
    ctx: DistributedContext,
    model: nn.Module,
    deepspeed: DeepSpeedOptions | None = None,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: Stateful | None = None,
    grad: GradState | None = None,
) -> nn.Module:
    """Move ``model`` to ``ctx.device`` in place and build a DeepSpeed ZeRO engine on it.

    The engine is returned and from then on owns ``model``, ``optimizer`` (its
    param groups now hold ZeRO's fp32 partitions) and ``scheduler`` (saved in the
    engine's checkpoints, stepped by ``maybe_step_scheduler`` only). Pass the
    engine and ``optimizer`` to ``accumulate_step``. The config is ``deepspeed``
    merged with what funcaccel knows (``grad.accumulation_steps``,
    ``ctx.mixed_precision``); a value that disagrees is an error naming both.
    ``wrap_model(ctx, model, deepspeed=..., optimizers=optimizer)`` does the same.

    With 2 ranks and ``DeepSpeedOptions(zero_stage=2)``, each rank keeps the
    optimizer state of half the flat fp32 parameters and updates that half.

    Args:
        ctx: the distributed context; needs a process group at any world size.
        model: the user's module, not wrapped yet.
        deepspeed: ZeRO stage, offload and config (docs/deepspeed.md); ``None``
            for ``DeepSpeedOptions()`` (ZeRO-2).
        optimizer: the one torch optimizer built on ``model``'s parameters.
        scheduler: the LR scheduler the engine checkpoints, or ``None``.
        grad: the run's ``GradState``: its ``accumulation_steps`` becomes the
            engine's; ``None`` for ``GradState()``.

    Returns:
        DeepSpeed's engine (an ``nn.Module``; ``unwrap_model`` gives ``model``).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``model`` already wrapped, or a config that disagrees with
            ``ctx`` or ``grad``.
        RuntimeError: no process group, or no ``LOCAL_RANK`` in the environment.

    >>> wrap_deepspeed(DistributedContext(), nn.Linear(2, 1), optimizer=None)
    Traceback (most recent call last):
    ...
    TypeError: wrap_deepspeed: optimizer must be a torch.optim.Optimizer; got None (NoneType). Pass the one optimizer built on model.parameters().
    """
    caller = "wrap_deepspeed"
    model = check_unwrapped(caller, ctx, model)
    options = check_type(
        caller, "deepspeed", deepspeed, DeepSpeedOptions, optional=True
    )
    what, hint = (
        "a torch.optim.Optimizer",
        "Pass the one optimizer built on model.parameters().",
    )
    check_type(
        caller, "optimizer", optimizer, torch.optim.Optimizer, what=what, hint=hint
    )
    options = DeepSpeedOptions() if options is None else options
    return build_engine(caller, ctx, model, options, (optimizer,), scheduler, grad)


def build_engine(
    caller: str,
    ctx: DistributedContext,
    model: nn.Module,
    options: DeepSpeedOptions,
    optimizers: tuple[torch.optim.Optimizer, ...],
    scheduler: Stateful | None,
    grad: GradState | None,
) -> nn.Module:
    """Move ``model`` to ``ctx.device``; return ``deepspeed.initialize``'s engine for it.

    Raises:
        TypeError: ``grad`` or ``scheduler`` of the wrong type.
        ValueError: not exactly one optimizer, or a config that disagrees with
            ``ctx`` or ``grad``.
        RuntimeError: no process group matching ``ctx``, or no ``LOCAL_RANK``.
    """
    model.to(ctx.device)
    what = "the run's GradState or None"
    grad = check_type(caller, "grad", grad, GradState, what=what, optional=True)
    grad = GradState() if grad is None else grad
    if grad.sync_each_batch:
        fail_value(caller, "grad.sync_each_batch", True, _SYNC_EACH_BATCH)
    if len(optimizers) != 1:
        fail_value(
            caller, "optimizers", optimizers, _ONE_OPTIMIZER, "Pass optimizers=opt."
        )
    check_type(caller, "scheduler", scheduler, Stateful, what=_STATEFUL, optional=True)
    config = merged_config(caller, ctx, options, grad)
    if not dist.is_initialized():
        msg = f"{caller}: a DeepSpeed engine needs a torch.distributed process group (even with one process); build the context with build_context(), which starts it."
        raise RuntimeError(msg)
    require_process_group(ctx, caller)
    # DeepSpeed reads LOCAL_RANK from the environment itself (torchrun sets it).
    if "LOCAL_RANK" not in os.environ:
        msg = f"{caller}: DeepSpeed needs the LOCAL_RANK environment variable, which torchrun and the deepspeed launcher set; launch with one of them, or set LOCAL_RANK={ctx.local_process_index} before {caller}."
        raise RuntimeError(msg)
    import deepspeed  # slow and optional: only this path needs it

    if ctx.device.type == "cpu":
        # DeepSpeed's CPU backend would JIT-compile a shared-memory all-reduce
        # (minutes of C++ on first use) that only its inference path uses; ZeRO
        # training reduces through torch.distributed. DeepSpeed keeps this table
        # for the process and reads it when it first starts its communication.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    held = None if scheduler is None else _HeldScheduler(scheduler)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizers[0],
        lr_scheduler=held,
        config=config,
        dist_init_required=False,
    )
    assert isinstance(engine, nn.Module)
    return engine
