"""Mixed precision: autocast contexts, the fp16 grad scaler, unscaling and clipping.

``autocast_ctx(ctx)`` runs a forward pass in the context's mixed-precision dtype
(nothing at all with ``mixed_precision="no"``); ``build_grad_scaler(ctx)`` returns
the ``torch.amp.GradScaler`` fp16 needs (``None`` otherwise). The helpers below do
the scaler's part of an optimizer step, each on one optimizer or a sequence of them:
``unscale_grads_`` (once per step, however often it is called), ``clip_grad_norm_``
and ``clip_grad_value_`` (both unscale first) and ``optimizer_step`` (tells whether
the scaler skipped the step).

>>> ctx = DistributedContext(mixed_precision="bf16")
>>> with autocast_ctx(ctx):
...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
torch.bfloat16
>>> build_grad_scaler(ctx) is None
True
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Final

import torch
from torch.amp.grad_scaler import OptState

from funcaccel._checks import as_tuple_of
from funcaccel._checks import check_norm
from funcaccel._checks import check_scaler
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_dtensor
from funcaccel._dist_types import is_zero_parameter
from funcaccel._typing import MixedPrecision
from funcaccel.context import DistributedContext
from funcaccel.kwargs import AutocastKwargs
from funcaccel.kwargs import GradScalerKwargs

_MODES: Final = "'no', 'fp16' or 'bf16'"
_OWNERS: Final = "the optimizer(s) owning the parameters when a scaler is given"
_UNSCALED: Final = "Their gradients are unscaled before clipping."
_NOT_ZERO: Final = (
    "outside a DeepSpeed ZeRO engine, whose optimizer holds their gradients in its "
    "own partitions"
)
_ZERO_FIX: Final = (
    "Pass max_grad_norm={!r} to accumulate_step instead (ZeRO clips the window's "
    "whole gradient before its step), or set DeepSpeedOptions(gradient_clipping=...)."
)

__all__ = [
    "autocast_ctx",
    "autocast_dtype",
    "build_grad_scaler",
    "clip_grad_norm_",
    "clip_grad_value_",
    "optimizer_parameters",
    "optimizer_step",
    "rescale_grads_",
    "unscale_grads_",
]


def autocast_dtype(mixed_precision: MixedPrecision) -> torch.dtype | None:
    """Return the autocast dtype of a mixed-precision mode (``None`` for ``"no"``).

    >>> autocast_dtype("fp16"), autocast_dtype("bf16"), autocast_dtype("no")
    (torch.float16, torch.bfloat16, None)
    """
    if mixed_precision == "fp16":
        return torch.float16
    if mixed_precision == "bf16":
        return torch.bfloat16
    if mixed_precision == "no":
        return None
    fail_value("autocast_dtype", "mixed_precision", mixed_precision, _MODES)


def autocast_ctx(
    ctx: DistributedContext, kwargs: AutocastKwargs | None = None
) -> AbstractContextManager[object]:
    """Return a context that autocasts to ``ctx.mixed_precision`` on ``ctx.device``.

    ``"no"``: a context that does nothing (``kwargs`` ignored). ``"fp16"`` /
    ``"bf16"``: ``torch.autocast(ctx.device.type, dtype=float16 / bfloat16,
    **kwargs.to_kwargs())``, on CPU too. Contexts nest like ``torch.autocast``.

    Args:
        ctx: the run's context; only ``device`` and ``mixed_precision`` are read.
        kwargs: options for ``torch.autocast`` (e.g. ``enabled=False`` to switch
            autocast off inside an outer one).

    Returns:
        A fresh, unentered context manager.

    Raises:
        TypeError: ``ctx`` or ``kwargs`` of the wrong type.

    >>> ctx = DistributedContext(mixed_precision="bf16")
    >>> with autocast_ctx(ctx), autocast_ctx(ctx, AutocastKwargs(enabled=False)):
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.float32
    """
    check_context("autocast_ctx", ctx)
    check_type("autocast_ctx", "kwargs", kwargs, AutocastKwargs, optional=True)
    dtype = autocast_dtype(ctx.mixed_precision)
    if dtype is None:
        return contextlib.nullcontext()
    options = kwargs.to_kwargs() if kwargs is not None else {}
    return torch.autocast(ctx.device.type, dtype=dtype, **options)


def build_grad_scaler(
    ctx: DistributedContext, kwargs: GradScalerKwargs | None = None
) -> torch.amp.GradScaler | None:
    """Return a new ``torch.amp.GradScaler`` for fp16, ``None`` for other modes.

    The scaler is ``torch.amp.GradScaler(ctx.device.type, **kwargs.to_kwargs())``,
    CPU included.

    Raises:
        TypeError: ``ctx`` or ``kwargs`` of the wrong type.

    >>> scaler = build_grad_scaler(
    ...     DistributedContext(mixed_precision="fp16"), GradScalerKwargs(init_scale=4)
    ... )
    >>> float(scaler.get_scale())
    4.0
    >>> build_grad_scaler(DistributedContext()) is None
    True
    """
    check_context("build_grad_scaler", ctx)
    check_type("build_grad_scaler", "kwargs", kwargs, GradScalerKwargs, optional=True)
    if ctx.mixed_precision != "fp16":
        return None
    options = kwargs.to_kwargs() if kwargs is not None else {}
    return torch.amp.GradScaler(ctx.device.type, **options)


def unscale_grads_(
    scaler: torch.amp.GradScaler,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
) -> int:
    """Unscale the gradients of each optimizer in place, once per step.

    ``torch.amp.GradScaler.unscale_`` raises when called twice for one optimizer
    before ``update()``; this skips the optimizers the scaler already unscaled in
    this step (it reads the scaler's per-optimizer stage), so clipping twice, or
    clipping and then stepping, is safe. A disabled scaler does nothing.

    Returns:
        How many optimizers were unscaled by this call.

    Raises:
        TypeError: ``scaler`` or ``optimizer`` of the wrong type.

    >>> w = torch.nn.Parameter(torch.ones(1))
    >>> opt, scaler = torch.optim.SGD([w], lr=0.5), torch.amp.GradScaler("cpu", init_scale=4.0)
    >>> torch.autograd.backward(scaler.scale(w.sum()))
    >>> unscale_grads_(scaler, opt), unscale_grads_(scaler, opt), w.grad.item()
    (1, 0, 1.0)
    """
    check_scaler("unscale_grads_", scaler)
    optimizers = as_tuple_of(
        optimizer, torch.optim.Optimizer, caller="unscale_grads_", name="optimizer"
    )
    if not scaler.is_enabled():
        return 0
    count = 0
    for opt in optimizers:
        # The stage torch itself checks before raising "unscale_() has already
        # been called"; ``get`` avoids creating an entry in its defaultdict. After
        # ``step()`` the stage is STEPPED and torch's own error is the right one.
        state = scaler._per_optimizer_states.get(id(opt))
        if state is not None and state["stage"] is OptState.UNSCALED:
            continue
        scaler.unscale_(opt)
        count += 1
    return count


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float = 2.0,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place to a total norm of ``max_norm``.

    With a scaler the gradients of ``optimizer`` (one or several) are unscaled
    first, once per step (see ``unscale_grads_``); ``parameters`` should be theirs.
    ``DTensor`` gradients (FSDP2, tensor parallelism, both on a mesh) count with
    their whole tensor, each once: the norm is the one the unsharded model's
    gradients have, whatever their meshes and placements. Plain gradients next to
    them count as this rank's (replicated) values. Every rank must then call this
    with the same parameters in the same order (one all-reduce per ``DTensor``).

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped.
        max_norm: the largest total norm allowed (> 0; ``math.inf`` only measures).
        norm_type: the p of the p-norm (``math.inf`` for the max norm).
        scaler: the fp16 grad scaler, if any.
        optimizer: the optimizer(s) owning ``parameters``; required with a scaler.

    Returns:
        The total norm of the gradients before clipping, a plain (0-dim) tensor.

    Raises:
        ValueError: ``max_norm`` not > 0, a scaler without an optimizer, or
            parameters of a DeepSpeed engine (use ``accumulate_step``'s
            ``max_grad_norm``).
        TypeError: an argument of the wrong type.

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grad_norm_([w], 1.0).item(), [round(g, 4) for g in w.grad.tolist()]
    (5.0, [0.6, 0.8])
    """
    check_norm("clip_grad_norm_", "max_norm", max_norm)
    check_norm("clip_grad_norm_", "norm_type", norm_type)
    _unscale_first("clip_grad_norm_", scaler, optimizer)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if any(is_zero_parameter(p) for p in params):
        # ZeRO moves the gradients into its own partitions (``.grad`` is None or
        # stale): clipping here would silently clip nothing.
        fix = _ZERO_FIX.format(max_norm)
        fail_value("clip_grad_norm_", "parameters", params, _NOT_ZERO, fix)
    grads = [p.grad for p in params if p.grad is not None]
    if any(is_dtensor(g) for g in grads):
        return _clip_distributed(grads, max_norm, norm_type)
    return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)


def _unscale_first(
    caller: str,
    scaler: torch.amp.GradScaler | None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
) -> None:
    """Unscale ``optimizer``'s gradients before clipping, when there is a scaler."""
    if scaler is None:
        return
    check_scaler(caller, scaler)
    if optimizer is None:
        fail_value(caller, "optimizer", optimizer, _OWNERS, _UNSCALED)
    unscale_grads_(scaler, optimizer)


def _clip_distributed(
    grads: list[torch.Tensor], max_norm: float, norm_type: float
) -> torch.Tensor:
    # torch's clip_grad_norm_ stacks the per-gradient norms, which fails for
    # DTensors on different meshes (a tensor-parallel weight next to an FSDP-only
    # one); each norm is made whole (full_tensor) first instead.
    norms = []
    with torch.no_grad():
        for grad in grads:
            norm = torch.linalg.vector_norm(grad, norm_type)
            norms.append(norm.full_tensor() if is_dtensor(norm) else norm)
        dtype = functools.reduce(torch.promote_types, (n.dtype for n in norms))
        device = norms[0].device
        stacked = torch.stack([n.to(device=device, dtype=dtype) for n in norms])
        total: torch.Tensor = torch.linalg.vector_norm(stacked, norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            local = grad.to_local() if is_dtensor(grad) else grad
            # Scaling is elementwise, so scaling each shard scales the whole.
            local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total


def clip_grad_value_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    clip_value: float,
    *,
    scaler: torch.amp.GradScaler | None = None,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
) -> None:
    """Clamp, in place, every gradient of ``parameters`` to ``[-clip_value, clip_value]``.

    With a scaler the gradients of ``optimizer`` (one or several) are unscaled
    first, once per step (see ``unscale_grads_``), as in ``clip_grad_norm_``, so
    ``clip_value`` is in the units of the real gradients. Parameters without a
    gradient are skipped. Each element is clamped on its own, so sharded (FSDP2
    ``DTensor``) gradients need no communication.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clamped.
        clip_value: the largest absolute value allowed (> 0; ``math.inf`` does
            nothing but the unscaling).
        scaler: the fp16 grad scaler, if any.
        optimizer: the optimizer(s) owning ``parameters``; required with a scaler.

    Raises:
        ValueError: ``clip_value`` not > 0, or a scaler without an optimizer.
        TypeError: an argument of the wrong type.

    >>> w = torch.nn.Parameter(torch.zeros(3))
    >>> w.grad = torch.tensor([-3.0, 0.5, 2.0])
    >>> clip_grad_value_([w], 1.0)
    >>> w.grad.tolist()
    [-1.0, 0.5, 1.0]
    """
    check_norm("clip_grad_value_", "clip_value", clip_value)
    _unscale_first("clip_grad_value_", scaler, optimizer)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    # torch's clip_grad_value_ fails on an empty list of gradients (torch 2.13).
    with_grad = [p for p in params if p.grad is not None]
    if with_grad:
        torch.nn.utils.clip_grad_value_(with_grad, float(clip_value))


def optimizer_step(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *,
    scaler: torch.amp.GradScaler | None = None,
) -> bool:
    """Step each optimizer in place (through ``scaler``, then ``scaler.update()``).

    Without a scaler every ``optimizer.step()`` runs and the result is ``False``.
    With one, ``scaler.step`` runs for each optimizer, then ``scaler.update()``
    once. The step counts as *skipped* when the scaler found inf/NaN gradients for
    any of the optimizers; it then did not call that ``optimizer.step`` (a fused
    optimizer is handed the flag and skips inside its kernel).

    The skip is read from the scaler's own per-optimizer inf record, the very value
    ``scaler.step`` tested, before ``update()`` clears it. Comparing the scale
    before and after ``update()`` would be wrong once the scale has underflowed to
    0 (``0 * backoff_factor == 0``: a skipped step leaves it unchanged), and it
    cannot tell which of several optimizers skipped.

    Returns:
        Whether the step was skipped (for any optimizer) by the scaler.

    Raises:
        TypeError: ``optimizer`` or ``scaler`` of the wrong type.

    >>> w = torch.nn.Parameter(torch.ones(1))
    >>> opt, scaler = torch.optim.SGD([w], lr=0.5), torch.amp.GradScaler("cpu", init_scale=4.0)
    >>> torch.autograd.backward(scaler.scale(w.sum() * float("inf")))
    >>> optimizer_step(opt, scaler=scaler), w.item(), scaler.get_scale()
    (True, 1.0, 2.0)
    """
    optimizers = as_tuple_of(
        optimizer, torch.optim.Optimizer, caller="optimizer_step", name="optimizer"
    )
    if scaler is None:
        for opt in optimizers:
            opt.step()
        return False
    check_scaler("optimizer_step", scaler)
    if not scaler.is_enabled():
        for opt in optimizers:
            scaler.step(opt)
        return False
    skipped = False
    for opt in optimizers:
        scaler.step(opt)
        found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        skipped = skipped or any(bool(v.item()) for v in found.values())
    scaler.update()
    return skipped


def optimizer_parameters(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
) -> list[torch.Tensor]:
    """Return the parameters of every optimizer's groups, each once, in order.

    >>> w = torch.nn.Parameter(torch.zeros(1))
    >>> opts = [torch.optim.SGD([w], lr=0.1), torch.optim.SGD([w], lr=0.2)]
    >>> len(optimizer_parameters(opts))
    1
    """
    optimizers = as_tuple_of(
        optimizer,
        torch.optim.Optimizer,
        caller="optimizer_parameters",
        name="optimizer",
    )
    seen: dict[int, torch.Tensor] = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                seen.setdefault(id(param), param)
    return list(seen.values())


def rescale_grads_(
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], factor: float
) -> int:
    """Multiply, in place, the gradients of every optimizer's parameters by ``factor``.

    Returns:
        How many gradients were scaled (parameters without a gradient are skipped).

    >>> w = torch.nn.Parameter(torch.zeros(2))
    >>> w.grad = torch.tensor([1.0, 2.0])
    >>> rescale_grads_(torch.optim.SGD([w], lr=0.1), 2.0), w.grad.tolist()
    (1, [2.0, 4.0])
    """
    optimizers = as_tuple_of(
        optimizer, torch.optim.Optimizer, caller="rescale_grads_", name="optimizer"
    )
    count = 0
    with torch.no_grad():
        for param in optimizer_parameters(optimizers):
            if param.grad is not None:
                param.grad.mul_(factor)
                count += 1
    return count
