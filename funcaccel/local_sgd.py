"""Local SGD: ranks step on their own gradients and average parameters every k steps.

``LocalSGDState`` counts optimizer steps; ``local_sgd_step(ctx, state, model)``
advances it and, on every ``local_sgd_steps``-th step, replaces each parameter by
its mean over the ranks (Accelerate's ``LocalSGD``). Gradients must not be
all-reduced meanwhile, or every rank steps alike and there is nothing to average:
train a module that is not DDP-wrapped (``model.to(ctx.device)`` with the same
seed on every rank, instead of ``wrap_model``), or run the whole loop inside
``no_sync(ctx, model)`` for a DDP model, which is what Accelerate's ``LocalSGD``
does.

With 2 ranks and ``local_sgd_steps=2``: after step 1 rank 0 holds ``w0`` and rank
1 ``w1``; step 2 leaves both with ``(w0' + w1') / 2``, where ``w_r'`` is rank
``r``'s parameter after its own second step.

>>> state = LocalSGDState(local_sgd_steps=2)
>>> state.steps, should_average(state), should_average(state.advanced().advanced())
(0, False, True)
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from funcaccel._checks import check_bool
from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._compile import inside_compile
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_fsdp_module
from funcaccel.collectives import reduce
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.grad_state import GradState

__all__ = ["LocalSGDState", "average_parameters_", "local_sgd_step", "should_average"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LocalSGDState:
    """How many optimizer steps local SGD has counted; a value, never changed.

    Args:
        local_sgd_steps: average the parameters every this many steps (>= 1).
        steps: optimizer steps counted so far (>= 0).
        enabled: ``False`` turns averaging off (steps are still counted).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a count out of range.
    """

    local_sgd_steps: int
    steps: int = 0
    enabled: bool = True

    def __post_init__(self) -> None:
        check_int("LocalSGDState", "local_sgd_steps", self.local_sgd_steps, 1)
        check_int("LocalSGDState", "steps", self.steps, 0)
        check_bool("LocalSGDState", "enabled", self.enabled)

    def advanced(self) -> LocalSGDState:
        """Return the state one step later; ``self`` is unchanged."""
        return dataclasses.replace(self, steps=self.steps + 1)


def should_average(state: LocalSGDState) -> bool:
    """Return whether the step that led to ``state`` averages (with several processes).

    >>> [should_average(LocalSGDState(local_sgd_steps=3, steps=s)) for s in range(7)]
    [False, False, False, True, False, False, True]
    """
    return (
        state.enabled and state.steps > 0 and state.steps % state.local_sgd_steps == 0
    )


def _check_model(model: object, caller: str) -> nn.Module:
    inner = inside_compile(
        check_type(caller, "model", model, nn.Module, what="an nn.Module")
    )
    if is_fsdp_module(inner):
        msg = (
            f"{caller}: model is an FSDP2 module, whose parameters are shards; local "
            "SGD needs whole parameters on every rank: train it unwrapped or DDP."
        )
        raise TypeError(msg)
    return inner


def average_parameters_(ctx: DistributedContext, model: nn.Module) -> None:
    """Replace every parameter of ``model``, in place, by its mean over the ranks.

    Every rank must call it (it all-reduces); buffers are left as they are. With
    one process nothing changes. With 2 ranks holding ``[1., 4.]`` and ``[3., 2.]``
    both end with ``[2., 3.]``, bit for bit the same on each rank.

    Raises:
        TypeError: ``model`` is not a module, or is an FSDP2 module.
        ValueError: the parameters' shapes or dtypes differ across ranks.
        RuntimeError: several processes and no process group matching ``ctx``.
    """
    inner = _check_model(model, "average_parameters_")
    if ctx.num_processes == 1:
        return
    require_process_group(ctx, "average_parameters_")
    params = list(inner.parameters())
    means = reduce(ctx, [p.detach() for p in params], reduction="mean")
    with torch.no_grad():
        for param, mean in zip(params, means, strict=True):
            param.copy_(mean)


def _syncs_gradients(model: nn.Module) -> bool:
    return isinstance(model, DistributedDataParallel) and bool(
        model.require_backward_grad_sync
    )


def local_sgd_step(
    ctx: DistributedContext,
    state: LocalSGDState,
    model: nn.Module,
    *,
    grad: GradState | None = None,
) -> LocalSGDState:
    """Count one optimizer step and, every ``local_sgd_steps`` steps, average ``model``.

    Call it on every rank once per optimizer step, after the step. Passing
    ``grad=`` (the state ``accumulate_step`` returned) lets you call it after every
    micro-batch: a micro-step that did not step the optimizer
    (``grad.sync_gradients`` false) is not counted and ``state`` comes back as is.
    On a counted step where ``should_average`` holds of the new state and there
    are several processes, the parameters are averaged in place
    (``average_parameters_``). ``state`` is left unchanged; the next is returned.

    Per rank, with 3 ranks and ``local_sgd_steps=2``: steps 1 and 3 leave each
    rank's parameters its own; steps 2 and 4 leave every rank with the mean of
    the three.

    Args:
        ctx: the run's context.
        state: the state before this step.
        model: the module whose parameters are averaged (DDP or not, not FSDP2).
        grad: the ``GradState`` after this micro-step, to skip non-stepping ones.

    Returns:
        The next ``LocalSGDState``.

    Raises:
        TypeError: an argument of the wrong type, or an FSDP2 model.
        RuntimeError: several processes and no process group matching ``ctx``.

    Warns:
        UserWarning: the model is DDP and not inside ``no_sync(ctx, model)``, so
            its gradients were all-reduced and averaging changes nothing.
    """
    check_context("local_sgd_step", ctx)
    hint = "Start with LocalSGDState(local_sgd_steps=k)."
    check_type("local_sgd_step", "state", state, LocalSGDState, hint=hint)
    check_type("local_sgd_step", "grad", grad, GradState, optional=True)
    inner = _check_model(model, "local_sgd_step")
    if grad is not None and not grad.sync_gradients:
        return state
    after = state.advanced()
    if ctx.num_processes > 1 and should_average(after):
        if _syncs_gradients(inner):
            warnings.warn(
                "local_sgd_step: model is a DistributedDataParallel outside "
                "no_sync(ctx, model), so its gradients are all-reduced every step "
                "and averaging its parameters changes nothing; run the loop inside "
                "no_sync(ctx, model) or train the module unwrapped.",
                UserWarning,
                stacklevel=2,
            )
        average_parameters_(ctx, inner)
    return after
