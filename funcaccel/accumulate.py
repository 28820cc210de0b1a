"""Gradient accumulation as a value: ``GradState`` in, ``GradState`` out.

``accumulate_step`` runs one micro-batch (forward, backward) and, every
``accumulation_steps`` micro-batches or at the end of the data, one optimizer step
whose gradient is the exact mean over the micro-batches of the window, a short last
window included. The pieces it is made of are public for custom loops:
``should_sync`` / ``should_skip_grad_sync`` (pure predicates), ``sync_ctx`` (DDP
``no_sync`` / FSDP2 gradient-sync switch), ``window_grad_factor`` and
``rescale_grads_`` (the ``k / m`` correction of a short window), ``advance_grad_state``
(the next state), plus ``clip_grad_norm_`` and ``optimizer_step`` from
``funcaccel.mixed_precision``. With ``num_items=`` the step is token-weighted
instead: summed losses, divided by the window's item count over all ranks. ``GradState`` and the pure rules live in
``funcaccel.grad_state`` and are re-exported here.

A window of 4 cut short by the end of the data after its first micro-batch: that
batch's gradient, divided by 4 in backward, is taken whole at the step.

>>> window_grad_factor(GradState(accumulation_steps=4), end_of_dataloader=True)
4.0
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Final
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from funcaccel._checks import as_tuple_of
from funcaccel._checks import check_norm
from funcaccel._checks import check_scaler
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._compile import inside_compile
from funcaccel._ctx_checks import check_context
from funcaccel._deepspeed_step import deepspeed_step
from funcaccel._deepspeed_step import engine_boundary_ctx
from funcaccel._dist_types import is_deepspeed_engine
from funcaccel._dist_types import is_dtensor
from funcaccel._dist_types import is_fsdp_module
from funcaccel._no_sync import no_sync_models
from funcaccel._optimizers_hold import check_optimizers_hold
from funcaccel._primitives import all_reduce_ints
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.grad_state import GradState
from funcaccel.grad_state import advance_grad_state
from funcaccel.grad_state import check_grad_state
from funcaccel.grad_state import check_num_items
from funcaccel.grad_state import check_window_kind
from funcaccel.grad_state import closing_factor
from funcaccel.grad_state import is_sync_skipped
from funcaccel.grad_state import is_window_end
from funcaccel.grad_state import next_grad_state
from funcaccel.grad_state import should_skip_grad_sync
from funcaccel.grad_state import should_sync
from funcaccel.grad_state import window_grad_factor
from funcaccel.kwargs import AutocastKwargs
from funcaccel.mixed_precision import autocast_ctx
from funcaccel.mixed_precision import clip_grad_norm_
from funcaccel.mixed_precision import optimizer_parameters
from funcaccel.mixed_precision import optimizer_step
from funcaccel.mixed_precision import rescale_grads_

__all__ = [
    "GradState",
    "accumulate_step",
    "advance_grad_state",
    "should_skip_grad_sync",
    "should_sync",
    "sync_ctx",
    "window_grad_factor",
]


def sync_ctx(
    ctx: DistributedContext,
    grad: GradState,
    models: nn.Module | Sequence[nn.Module],
    *,
    end_of_dataloader: bool = False,
) -> AbstractContextManager[object]:
    """Return the context the next micro-step's forward and backward run in.

    When ``should_skip_grad_sync`` holds, it enters DDP's ``no_sync()`` for each
    ``DistributedDataParallel`` in ``models`` and switches FSDP2 modules to
    ``set_requires_gradient_sync(False)``, set back to ``True`` on exit (on error
    too), or to what their ``FSDPOptions.accumulation_comm`` asks instead; other
    modules are untouched. Otherwise it does nothing. A DeepSpeed
    engine is told instead whether the micro-step closes the window
    (``set_gradient_accumulation_boundary``), on every micro-step.

    Per rank, with 2 processes and ``k=2``: micro-step 1 runs in ``no_sync`` and
    rank 0 keeps ``g(0)/2``, rank 1 ``g(1)/2``; micro-step 2 all-reduces, so both
    then hold ``(g(0)+g(2)+g(1)+g(3))/4``.

    Raises:
        TypeError: ``ctx``, ``grad`` or ``models`` of the wrong type.
    """
    check_context("sync_ctx", ctx)
    check_grad_state("sync_ctx", grad)
    modules = as_tuple_of(models, nn.Module, caller="sync_ctx", name="models")
    engines = tuple(m for m in modules if is_deepspeed_engine(m))
    if engines:
        # An engine reduces by itself; it only needs to know whether this
        # micro-step closes the window.
        return engine_boundary_ctx(
            engines, should_sync(grad, end_of_dataloader=end_of_dataloader)
        )
    if not should_skip_grad_sync(ctx, grad, end_of_dataloader=end_of_dataloader):
        return contextlib.nullcontext()
    return no_sync_models("sync_ctx", modules)


_CALLER: Final = "accumulate_step"


def _check_loss(loss: object) -> None:
    name, what = "loss_fn()'s result", "the loss of one micro-batch as a torch.Tensor"
    loss = check_type(_CALLER, name, loss, torch.Tensor, what=what)
    if loss.numel() != 1:
        hint = "Reduce it first, e.g. with .mean()."
        fail_value(_CALLER, name, loss, "a scalar loss", hint)
    if not loss.requires_grad:
        hint = "Compute it from the model's output, outside torch.no_grad()."
        fail_value(_CALLER, name, loss, "a loss that requires grad", hint)


def _check_step_args(
    ctx: DistributedContext,
    grad: GradState,
    loss_fn: object,
    end_of_dataloader: object,
    scaler: object,
    max_grad_norm: object,
    autocast_kwargs: object,
    num_items: object,
) -> None:
    caller = "accumulate_step"
    if not isinstance(ctx, DistributedContext):
        check_context(caller, ctx)
    if not isinstance(grad, GradState):
        check_grad_state(caller, grad)
    check_window_kind(caller, grad, num_items is not None)
    if not callable(loss_fn):
        what = "a callable taking no argument and returning the micro-batch loss"
        fail_type(caller, "loss_fn", loss_fn, what)
    if type(end_of_dataloader) is not bool:  # the checks' calls only when needed
        hint = "Pass batch.is_last."
        check_type(caller, "end_of_dataloader", end_of_dataloader, bool, hint=hint)
    if scaler is not None:
        check_scaler(caller, scaler)
    elif ctx.mixed_precision == "fp16":
        what = "a torch.amp.GradScaler when ctx.mixed_precision is 'fp16'"
        hint = "Pass scaler=build_grad_scaler(ctx)."
        fail_value(caller, "scaler", scaler, what, hint)
    if max_grad_norm is not None:
        check_norm(caller, "max_grad_norm", max_grad_norm)
    if autocast_kwargs is not None:
        check_type(caller, "autocast_kwargs", autocast_kwargs, AutocastKwargs)


def _forward_backward(
    ctx: DistributedContext,
    loss_fn: Callable[[], torch.Tensor],
    k: int,
    scaler: torch.amp.GradScaler | None,
    autocast_kwargs: AutocastKwargs | None,
) -> torch.Tensor:
    if ctx.mixed_precision == "no":  # autocast_ctx would be a null context
        loss = loss_fn()
    else:
        with autocast_ctx(ctx, autocast_kwargs):
            loss = loss_fn()
    if not (
        isinstance(loss, torch.Tensor) and loss.requires_grad and loss.numel() == 1
    ):
        _check_loss(loss)  # says what is wrong
    if (
        scaler is None
        and type(loss) is torch.Tensor
        and loss.grad_fn is not None
        and loss.is_floating_point()
    ):
        # Seeding backward with d(loss / k)/d(loss) = 1/k gives the gradients of
        # backward(loss / k) bit for bit, without the division in the graph
        # (about 20 us less per micro-step for a small model on CPU). The seed is
        # a fresh copy: autograd hands it to hooks and nodes that may change it in
        # place, and a parameter's .grad may end up a view of it.
        seed = _inverse_count(k, loss.dtype, loss.device, loss.shape).clone()
        torch.autograd.backward(loss, seed)
        return loss
    scaled = loss / k
    if scaler is not None:
        scaled = scaler.scale(scaled)
    torch.autograd.backward(scaled)
    return loss


@functools.lru_cache(maxsize=64)
def _inverse_count(
    k: int, dtype: torch.dtype, device: torch.device, shape: torch.Size
) -> torch.Tensor:
    # ones / k runs the very kernel autograd's division backward would run on
    # backward(loss / k), so the seed is exactly the gradient that reaches the loss
    # there. A constant per key, never handed out: callers use a clone.
    return torch.ones(shape, dtype=dtype, device=device) / k


def accumulate_step(
    ctx: DistributedContext,
    grad: GradState,
    model: nn.Module | Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_fn: Callable[[], torch.Tensor],
    *,
    end_of_dataloader: bool = False,
    scaler: torch.amp.GradScaler | None = None,
    max_grad_norm: float | None = None,
    autocast_kwargs: AutocastKwargs | None = None,
    num_items: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, GradState]:
    """Run one micro-batch and, when its window closes, step the optimizer(s).

    Changes the gradients, the optimizers and the scaler in place; ``grad`` is left
    unchanged. While the window is open, ``loss_fn()`` and its backward run in the
    models' no-sync context (several processes). The micro-step that closes it (the
    ``k``-th, or ``end_of_dataloader``) scales a short window of ``m`` micro-batches
    by ``k / m``, clips, steps every optimizer and zeroes the gradients, so the step
    sees the mean loss over the window's micro-batches on all ranks. With
    ``num_items`` it is token-weighted: summed losses over the window's item count.
    A DeepSpeed engine follows the same windows through its own step.

    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> grad = GradState(accumulation_steps=2)
    >>> for x in torch.ones(3, 2):  # windows of 2 micro-batches, then 1 open
    ...     loss, grad = accumulate_step(
    ...         DistributedContext(), grad, model, opt, lambda: model(x).sum()
    ...     )
    >>> grad.optimizer_steps, grad.micro_step
    (1, 1)

    Args:
        ctx, grad: the run's context and the state before this micro-step.
        model, optimizer: one or a sequence each (DDP, FSDP2 or plain modules).
        loss_fn: no argument; the micro-batch's scalar loss (with ``num_items``,
            its summed loss).
        end_of_dataloader: ``batch.is_last``; closes a short last window.
        scaler, max_grad_norm, autocast_kwargs: fp16 scaler (required for fp16),
            clipping norm, autocast options.
        num_items: this rank's item count for a token-weighted step, or ``None``.

    Returns:
        ``(loss.detach(), new_grad)``: the undivided loss (token-weighted: per item)
        and the next state (``step_was_skipped`` when the scaler skipped a step;
        ``grad_norm``, with ``max_grad_norm``, the pre-clip global norm of a
        closing micro-step, over the models' parameters in their order).

    Raises:
        TypeError, ValueError: a wrong argument or loss, named with its fix.
        RuntimeError: several processes but no matching process group.

    docs/accumulate.md states the exact rules, with per-rank examples.
    """
    if type(model) is not DistributedDataParallel and is_deepspeed_engine(model):
        return deepspeed_step(
            ctx,
            grad,
            model,
            optimizer,
            loss_fn,
            end_of_dataloader=end_of_dataloader,
            scaler=scaler,
            max_grad_norm=max_grad_norm,
            autocast_kwargs=autocast_kwargs,
            num_items=num_items,
        )
    _check_step_args(
        ctx,
        grad,
        loss_fn,
        end_of_dataloader,
        scaler,
        max_grad_norm,
        autocast_kwargs,
        num_items,
    )
    step = _Step(
        ctx,
        grad,
        as_tuple_of(model, nn.Module, caller=_CALLER, name="model"),
        as_tuple_of(optimizer, torch.optim.Optimizer, caller=_CALLER, name="optimizer"),
        loss_fn,
        end_of_dataloader,
        scaler,
        max_grad_norm,
        autocast_kwargs,
    )
    if num_items is None:
        return _mean_step(step)
    return _token_weighted_step(step, num_items)


class _Step(NamedTuple):
    """One micro-step's arguments, checked: what both kinds of step read."""

    ctx: DistributedContext
    grad: GradState
    models: tuple[nn.Module, ...]
    optimizers: tuple[torch.optim.Optimizer, ...]
    loss_fn: Callable[[], torch.Tensor]
    end_of_dataloader: bool
    scaler: torch.amp.GradScaler | None
    max_grad_norm: float | None
    autocast_kwargs: AutocastKwargs | None


def _mean_step(step: _Step) -> tuple[torch.Tensor, GradState]:
    """Run ``accumulate_step`` for mean losses."""
    ctx, grad = step.ctx, step.grad
    if ctx.num_processes > 1 and not dist.is_initialized():
        # The full check (world size and rank) is for wrap_model, at set-up; per
        # micro-step only the group's presence is checked, which costs nothing.
        require_process_group(ctx, _CALLER)
    synced = is_window_end(grad, step.end_of_dataloader)
    loss = _micro_batch(step, synced, grad.accumulation_steps)
    if not synced:
        return loss.detach(), next_grad_state(
            grad, False, step.end_of_dataloader, False
        )
    skipped, norm = _close_window(step, closing_factor(grad))
    end = step.end_of_dataloader
    return loss.detach(), next_grad_state(grad, True, end, skipped, None, norm)


def _token_weighted_step(
    step: _Step, num_items: int | torch.Tensor
) -> tuple[torch.Tensor, GradState]:
    """Run ``accumulate_step`` with ``num_items``."""
    ctx, grad, end = step.ctx, step.grad, step.end_of_dataloader
    items = check_num_items(_CALLER, num_items)
    p = ctx.num_processes
    if p > 1:
        require_process_group(ctx, _CALLER)
        if grad.micro_step == 0:  # once per window, before anything accumulates
            _require_averaged_grads(ctx, step.models)
    synced = is_window_end(grad, end)
    # Backward of the summed loss itself (k=1): nothing is divided until the
    # window's total is known.
    loss = _micro_batch(step, synced, 1)
    shown = loss.detach() / items if items else loss.detach()
    local = (grad.window_items or 0) + items
    if not synced:
        return shown, next_grad_state(grad, False, end, False, local)
    (total,) = all_reduce_ints(ctx, [local], caller=_CALLER)
    if total == 0:  # nothing to average: no update rather than 0/0
        for opt in step.optimizers:
            opt.zero_grad(set_to_none=True)
        return shown, next_grad_state(grad, True, end, True)
    # Each rank now holds (1/p) * sum over ranks of its summed-loss gradients
    # (DDP all-reduces the mean; FSDP2 reduce-scatters the mean of each shard;
    # one process holds the sum itself, p = 1), so p / total gives the sum over
    # ranks divided by the window's item count.
    skipped, norm = _close_window(step, p / total)
    return shown, next_grad_state(grad, True, end, skipped, None, norm)


def _micro_batch(step: _Step, synced: bool, k: int) -> torch.Tensor:
    """Run forward and backward, in the no-sync context when the step skips sync."""
    ctx = step.ctx
    args = (ctx, step.loss_fn, k, step.scaler, step.autocast_kwargs)
    if is_sync_skipped(ctx, step.grad, synced):
        with no_sync_models(_CALLER, step.models):
            return _forward_backward(*args)
    # No null context otherwise: entering one costs more than the rest of the checks.
    return _forward_backward(*args)


def _close_window(step: _Step, factor: float) -> tuple[bool, torch.Tensor | None]:
    """Scale the gradients by ``factor``, clip, step, zero.

    Changes the gradients, the optimizers and the scaler in place. Returns
    whether the step was skipped and the pre-clip norm (``None`` without
    ``max_grad_norm``).
    """
    optimizers, scaler = step.optimizers, step.scaler
    if step.ctx.num_processes > 1:
        # Once per window: an optimizer built before FSDP2 or tensor parallelism
        # replaced the parameters would step nothing, silently.
        check_optimizers_hold(_CALLER, step.models, optimizers)
    if factor != 1.0:
        rescale_grads_(optimizers, factor)
    norm = None
    if step.max_grad_norm is not None:
        norm = clip_grad_norm_(
            _clip_order(step.models, optimizers),
            step.max_grad_norm,
            scaler=scaler,
            optimizer=optimizers,
        ).detach()
    skipped = optimizer_step(optimizers, scaler=scaler)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return skipped, norm


def _clip_order(
    models: tuple[nn.Module, ...], optimizers: tuple[torch.optim.Optimizer, ...]
) -> list[torch.Tensor]:
    """Return the optimizers' parameters in the models' parameter order.

    The total norm sums the per-parameter norms in list order, so the order
    decides its last bits: taken in ``model.parameters()`` order it equals, bit
    for bit, what ``torch.nn.utils.clip_grad_norm_(model.parameters())`` returns
    when the optimizers hold the model's parameters. Parameters no model holds
    follow, in param-group order; a model's parameters no optimizer holds are
    left out (they are not stepped).

    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD([model.bias, model.weight], lr=0.1)
    >>> [tuple(p.shape) for p in _clip_order((model,), (opt,))]
    [(1, 2), (1,)]
    """
    owned = {id(param): param for param in optimizer_parameters(optimizers)}
    ordered: dict[int, torch.Tensor] = {}
    for model in models:
        for param in model.parameters():
            if id(param) in owned:
                ordered.setdefault(id(param), param)
    if len(ordered) < len(owned):
        for key, tensor in owned.items():
            ordered.setdefault(key, tensor)
    return list(ordered.values())


def _require_averaged_grads(
    ctx: DistributedContext, models: tuple[nn.Module, ...]
) -> None:
    # The p / total rule holds only where the gradients were averaged over ranks.
    for n, wrapped in enumerate(models):
        model = inside_compile(wrapped)
        if (
            isinstance(model, DistributedDataParallel)
            or is_fsdp_module(model)
            # Tensor parallelism on a mesh: the tp ranks see the same items, so
            # the count over all ranks is tp times the data-parallel count and
            # p / total is still the right factor.
            or any(is_dtensor(param) for param in model.parameters())
        ):
            continue
        if any(param.requires_grad for param in model.parameters()):
            msg = (
                f"accumulate_step: num_items= with {ctx.num_processes} processes "
                f"needs every trained model's gradients averaged over the ranks, "
                f"but model {n} is a plain {type(model).__name__}; wrap it with "
                "wrap_model(ctx, model) (DDP or FSDP2)."
            )
            raise ValueError(msg)
