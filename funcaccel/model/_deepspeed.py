"""DeepSpeed ZeRO engines: built by ``wrap_model``, stepped by ``accumulate_step``.

DeepSpeed is imported here only, when an engine is built; ``import funcaccel``
never imports it. The engine keeps its own accumulation counter and divides every
micro-step's loss by its ``gradient_accumulation_steps``; funcaccel drives it
instead from the ``GradState``:

- before each micro-step's forward, ``engine.set_gradient_accumulation_boundary``
  says whether this micro-step closes the window (the same rule as for DDP), so
  the ZeRO reduction and the optimizer step happen on the same micro-steps;
- ``engine.backward(loss)`` divides by ``k`` (the engine's steps equal the
  ``GradState``'s), exactly as the DDP path's backward of ``loss / k``;
- on a short last window of ``m < k`` micro-steps the gradient must be multiplied
  by ``k / m``. ZeRO keeps the reduced gradients in its own partitions, scaled by
  its loss scale ``s`` (1 without fp16), and divides them by ``s`` (and the clip
  factor, computed from the same scaled norm) just before the optimizer update.
  For that one step the loss scale is set to ``s * m / k``, which multiplies the
  update's gradient, and the norm used for clipping, by exactly ``k / m``; the
  scale is put back (with whatever change DeepSpeed's dynamic scaler made) after.
  A token-weighted window (``num_items``) uses the same seam with ``N / p``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from funcaccel._checks import summary
from funcaccel._primitives import all_reduce_ints
from funcaccel._typing import Stateful
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.grad_state import GradState
from funcaccel.grad_state import check_num_items
from funcaccel.grad_state import closing_factor
from funcaccel.grad_state import is_window_end
from funcaccel.grad_state import next_grad_state
from funcaccel.model._deepspeed_options import DeepSpeedOptions
from funcaccel.model._deepspeed_options import merged_config

__all__ = [
    "build_engine",
    "deepspeed_step",
    "engine_boundary_ctx",
]


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


def build_engine(
    ctx: DistributedContext,
    model: nn.Module,
    options: DeepSpeedOptions,
    optimizers: tuple[torch.optim.Optimizer, ...],
    scheduler: Stateful | None,
    grad: GradState | None,
) -> nn.Module:
    """Return ``deepspeed.initialize``'s engine for ``model`` (see ``wrap_model``).

    Raises:
        TypeError: ``grad`` not a ``GradState``.
        ValueError: not exactly one optimizer, or a config that disagrees with
            ``ctx`` or ``grad``.
        RuntimeError: no process group matching ``ctx``.
    """
    caller = "wrap_model"
    if grad is None:
        grad = GradState()
    elif not isinstance(grad, GradState):
        msg = f"{caller}: grad must be the run's GradState or None; got {summary(grad)} ({type(grad).__name__})."
        raise TypeError(msg)
    if grad.sync_each_batch:
        msg = f"{caller}: GradState(sync_each_batch=True) has no meaning for a DeepSpeed engine, whose ZeRO stages reduce gradients themselves; use sync_each_batch=False."
        raise ValueError(msg)
    if len(optimizers) != 1:
        msg = (
            f"{caller}: deepspeed= needs exactly one optimizer built on the model's "
            f"parameters, passed as optimizers=opt; got {len(optimizers)}."
        )
        raise ValueError(msg)
    if scheduler is not None and not isinstance(scheduler, Stateful):
        msg = f"{caller}: scheduler must have state_dict()/load_state_dict(), or be None; got {summary(scheduler)}."
        raise TypeError(msg)
    config = merged_config(ctx, options, grad, caller=caller)
    if not dist.is_initialized():
        msg = (
            f"{caller}: deepspeed= needs a torch.distributed process group (even with "
            "one process); build the context with build_context(), which starts it."
        )
        raise RuntimeError(msg)
    require_process_group(ctx, caller)
    if "LOCAL_RANK" not in os.environ:
        # DeepSpeed reads it from the environment itself (torchrun sets it).
        msg = (
            f"{caller}: DeepSpeed needs the LOCAL_RANK environment variable, which "
            "torchrun and the deepspeed launcher set; launch with one of them, or set "
            f"LOCAL_RANK={ctx.local_process_index} before wrap_model."
        )
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


def engine_boundary_ctx(
    engines: tuple[nn.Module, ...], boundary: bool
) -> contextlib.AbstractContextManager[None]:
    """Return a context that marks the next micro-step as closing a window or not."""

    @contextlib.contextmanager
    def marked() -> Iterator[None]:
        for engine in engines:
            marker: Any = engine
            marker.set_gradient_accumulation_boundary(boundary)
        yield

    return marked()


def _check_engine_step(
    grad: GradState,
    engine: Any,
    optimizer: object,
    scaler: object,
    autocast_kwargs: object,
    max_grad_norm: float | None,
) -> None:
    caller = "accumulate_step"
    if optimizer is not engine.optimizer and optimizer is not engine.basic_optimizer:
        msg = (
            f"{caller}: the model is a DeepSpeed engine, which owns its optimizer; "
            f"pass the optimizer given to wrap_model (or engine.optimizer); got "
            f"{summary(optimizer)} ({type(optimizer).__name__})."
        )
        raise ValueError(msg)
    if scaler is not None:
        msg = (
            f"{caller}: a DeepSpeed engine scales fp16 losses itself; pass scaler=None."
        )
        raise ValueError(msg)
    if autocast_kwargs is not None:
        msg = f"{caller}: a DeepSpeed engine runs its module in the config's precision itself; pass autocast_kwargs=None."
        raise ValueError(msg)
    configured = engine.gradient_clipping()
    if max_grad_norm is not None and configured > 0 and configured != max_grad_norm:
        msg = (
            f"{caller}: the engine's config clips to gradient_clipping={configured!r}, "
            f"but max_grad_norm is {max_grad_norm!r}; set one of them (or make them equal)."
        )
        raise ValueError(msg)
    if engine.gradient_accumulation_steps() != grad.accumulation_steps:
        msg = (
            f"{caller}: the engine was built for {engine.gradient_accumulation_steps()} "
            f"accumulation steps, but GradState.accumulation_steps is "
            f"{grad.accumulation_steps}; build it with wrap_model(..., grad=grad)."
        )
        raise ValueError(msg)


@contextlib.contextmanager
def _scaled_step(zero: Any, factor: float, clip: float | None) -> Iterator[None]:
    """Multiply the next update's gradient by ``factor`` through ZeRO's loss scale."""
    before = zero.loss_scale
    clip_before = zero.clip_grad
    if factor != 1.0:
        zero.loss_scale = before / factor
    if clip is not None:
        zero.clip_grad = clip
    try:
        yield
    finally:
        zero.clip_grad = clip_before
        if factor != 1.0:
            after = zero.loss_scale
            # DeepSpeed's dynamic fp16 scaler may have halved or doubled the scale.
            zero.loss_scale = before if after == before / factor else after * factor


def deepspeed_step(
    ctx: DistributedContext,
    grad: GradState,
    engine: Any,
    optimizer: object,
    loss_fn: Callable[[], torch.Tensor],
    *,
    end_of_dataloader: bool,
    scaler: object,
    max_grad_norm: float | None,
    autocast_kwargs: object,
    num_items: int | torch.Tensor | None,
) -> tuple[torch.Tensor, GradState]:
    """Run ``accumulate_step`` for a DeepSpeed engine (the same rules as DDP's)."""
    _check_engine_step(grad, engine, optimizer, scaler, autocast_kwargs, max_grad_norm)
    synced = is_window_end(grad, end_of_dataloader)
    items = None if num_items is None else check_num_items("accumulate_step", num_items)
    with engine_boundary_ctx((engine,), synced):  # sync_ctx's context for engines
        loss = loss_fn()
        if not (
            isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.requires_grad
        ):
            msg = (
                "accumulate_step: loss_fn() must return a scalar loss tensor that "
                f"requires grad; got {summary(loss)}."
            )
            raise ValueError(msg)
        # A mean loss is divided by k (the engine's own steps); a summed,
        # token-weighted loss is not divided until the window's item count is known.
        engine.backward(loss, scale_wrt_gas=items is None)
    shown = loss.detach()
    if items is not None:
        shown = shown / items if items else shown
    local = None
    if items is not None:
        local = (grad.window_items or 0) + items
    if not synced:
        engine.step()  # counts the micro-step; the engine updates nothing here
        return shown, next_grad_state(grad, False, end_of_dataloader, False, local)
    if local is None:
        factor = closing_factor(grad)
    else:
        (total,) = all_reduce_ints(ctx, [local], caller="accumulate_step")
        if total == 0:
            msg = (
                "accumulate_step: the window holds no items on any rank (num_items "
                "summed to 0), and a DeepSpeed engine cannot drop a reduced window "
                "without stepping; leave empty windows out of the loop."
            )
            raise ValueError(msg)
        # ZeRO averaged the summed-loss gradients over the p ranks.
        factor = ctx.num_processes / total
    with _scaled_step(engine.optimizer, factor, max_grad_norm):
        engine.step()
    skipped = bool(getattr(engine.optimizer, "overflow", False))
    return shown, next_grad_state(grad, True, end_of_dataloader, skipped)
