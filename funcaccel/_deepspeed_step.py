"""``accumulate_step`` for a DeepSpeed ZeRO engine (built by ``wrap_deepspeed``).

Nothing here imports DeepSpeed: the engine is driven through the few methods
funcaccel needs. The engine keeps its own accumulation counter and divides every
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
- with ``max_grad_norm`` the new state's ``grad_norm`` is the engine's
  ``get_global_grad_norm()`` after the step: ZeRO's norm over all ranks' partitions,
  divided by the loss scale, so the norm of the gradient the update used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import Final

import torch
from torch import nn

from funcaccel._checks import fail_value
from funcaccel._primitives import all_reduce_ints
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.grad_state import check_num_items
from funcaccel.grad_state import closing_factor
from funcaccel.grad_state import is_window_end
from funcaccel.grad_state import next_grad_state

__all__ = ["deepspeed_step", "engine_boundary_ctx"]

_CALLER: Final = "accumulate_step"
_REBUILD: Final = "Build the engine with wrap_model(..., grad=grad)."
_SCALAR_LOSS: Final = "a scalar loss tensor that requires grad"
_SOME_ITEMS: Final = (
    "above 0 summed over the window and the ranks (a DeepSpeed engine cannot "
    "drop a reduced window without stepping)"
)
_NO_EMPTY: Final = "Leave empty windows out of the loop."


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
    owner = "the one given to wrap_model (or engine.optimizer), which the engine owns"
    if optimizer is not engine.optimizer and optimizer is not engine.basic_optimizer:
        fail_value(_CALLER, "optimizer", optimizer, owner, "Pass that one.")
    for name, value, does in (
        ("scaler", scaler, "scales fp16 losses"),
        (
            "autocast_kwargs",
            autocast_kwargs,
            "runs its module in the config's precision",
        ),
    ):
        if value is not None:
            fail_value(_CALLER, name, value, f"None: a DeepSpeed engine {does} itself")
    clip = engine.gradient_clipping()
    clips = f"None or the engine config's gradient_clipping ({clip!r})"
    if max_grad_norm is not None and 0 < clip != max_grad_norm:
        fail_value(_CALLER, "max_grad_norm", max_grad_norm, clips)
    steps, k = engine.gradient_accumulation_steps(), grad.accumulation_steps
    built = f"the engine's gradient_accumulation_steps ({steps})"
    if steps != k:
        fail_value(_CALLER, "grad.accumulation_steps", k, built, _REBUILD)


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
    items = None if num_items is None else check_num_items(_CALLER, num_items)
    with engine_boundary_ctx((engine,), synced):  # sync_ctx's context for engines
        loss = loss_fn()
        scalar = isinstance(loss, torch.Tensor) and loss.numel() == 1
        if not (scalar and loss.requires_grad):
            fail_value(_CALLER, "loss_fn()'s result", loss, _SCALAR_LOSS)
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
        (total,) = all_reduce_ints(ctx, [local], caller=_CALLER)
        if total == 0:
            fail_value(_CALLER, "num_items", total, _SOME_ITEMS, _NO_EMPTY)
        # ZeRO averaged the summed-loss gradients over the p ranks.
        factor = ctx.num_processes / total
    with _scaled_step(engine.optimizer, factor, max_grad_norm):
        engine.step()
    skipped = bool(getattr(engine.optimizer, "overflow", False))
    norm = None if max_grad_norm is None else _engine_norm(engine)
    return shown, next_grad_state(grad, True, end_of_dataloader, skipped, None, norm)


def _engine_norm(engine: Any) -> torch.Tensor | None:
    """Return the norm the engine's last step measured, as a 0-dim tensor."""
    value = engine.get_global_grad_norm()
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(())
    # A Python float is a double: kept exact.
    return torch.tensor(float(value), dtype=torch.float64)
