"""Local SGD: ranks step on their own gradients and average parameters every k counts.

``LocalSGDState`` counts calls of ``local_sgd_step(ctx, state, model)``: every
call, as Accelerate's ``LocalSGD.step()`` counts (``count="micro_batches"``, the
default: one call per micro-batch), or only the calls whose ``grad=`` shows a
closed accumulation window (``count="optimizer_steps"``). On every
``local_sgd_steps``-th count each parameter is replaced by its mean over the ranks.
Gradients must not be all-reduced meanwhile, or every rank steps alike and there
is nothing to average: run the loop inside ``local_sgd_ctx(ctx, state, model)``,
which enters a DDP model's ``no_sync`` when local SGD is enabled (and not when it
is disabled, so the model trains as plain DDP) and averages once more on exit, as
Accelerate's ``LocalSGD`` context does; or train a module that is not
DDP-wrapped.

With 2 ranks and ``local_sgd_steps=2``: after count 1 rank 0 holds ``w0`` and
rank 1 ``w1``; count 2 leaves both with ``(w0' + w1') / 2``, where ``w_r'`` is
rank ``r``'s parameter after its own second counted call.

>>> state = LocalSGDState(local_sgd_steps=2)
>>> state.steps, should_average(state), should_average(state.advanced().advanced())
(0, False, True)
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Final
from typing import Literal
from typing import TypeAlias

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from funcaccel._checks import check_bool
from funcaccel._checks import check_choice
from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._compile import inside_compile
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_fsdp_module
from funcaccel._no_sync import no_sync_models
from funcaccel.collectives import reduce
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.grad_state import GradState

__all__ = [
    "LocalSGDCount",
    "LocalSGDState",
    "average_parameters_",
    "local_sgd_ctx",
    "local_sgd_step",
    "should_average",
]

LocalSGDCount: TypeAlias = Literal["micro_batches", "optimizer_steps"]
_COUNTS: Final[tuple[LocalSGDCount, ...]] = ("micro_batches", "optimizer_steps")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LocalSGDState:
    """How many calls local SGD has counted; a value, never changed.

    Args:
        local_sgd_steps: average the parameters every this many counts (>= 1).
        count: what ``local_sgd_step`` counts. ``"micro_batches"`` (the default,
            Accelerate's ``LocalSGD.step()``): every call, so with one call per
            micro-batch and accumulation ``k`` an average can fall inside a
            window. ``"optimizer_steps"``: only the calls whose ``grad=`` closed
            a window, so ``local_sgd_steps`` counts optimizer updates whatever
            ``k`` is.
        steps: calls counted so far (>= 0).
        enabled: ``False`` turns averaging off (calls are still counted) and
            makes ``local_sgd_ctx`` a null context (the model trains as DDP).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a count out of range, or an unknown ``count``.
    """

    local_sgd_steps: int
    count: LocalSGDCount = "micro_batches"
    steps: int = 0
    enabled: bool = True

    def __post_init__(self) -> None:
        check_int("LocalSGDState", "local_sgd_steps", self.local_sgd_steps, 1)
        check_choice("LocalSGDState", "count", self.count, _COUNTS)
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
    """Count one call and, every ``local_sgd_steps`` counts, average ``model`` in place.

    Call it on every rank after every ``accumulate_step``. With
    ``state.count == "micro_batches"`` (Accelerate's counting) every call counts
    and ``grad=`` is refused; with ``"optimizer_steps"`` pass ``grad=`` (the state
    that ``accumulate_step`` returned): a micro-step that did not close its window
    (``grad.sync_gradients`` false) is not counted and ``state`` comes back as is.
    On a counted call where ``should_average`` holds of the new state and there
    are several processes, the parameters are averaged (``average_parameters_``).
    ``state`` is left unchanged; the next is returned.

    Per rank, with 2 ranks, ``k=2`` micro-batches per window and
    ``local_sgd_steps=3``: counting micro-batches averages after micro-batch 3
    (inside the second window, before its step) and 6; counting optimizer steps
    averages after micro-batch 6 (the third step) and 12.

    Args:
        ctx: the run's context.
        state: the state before this call.
        model: the module whose parameters are averaged (DDP or not, not FSDP2).
        grad: with ``count="optimizer_steps"``, the ``GradState`` after this
            micro-step; ``None`` with ``count="micro_batches"``.

    Returns:
        The next ``LocalSGDState``.

    Raises:
        TypeError: an argument of the wrong type, or an FSDP2 model.
        ValueError: ``grad=`` missing with ``count="optimizer_steps"``, or given
            with ``count="micro_batches"``.
        RuntimeError: several processes and no process group matching ``ctx``.

    Warns:
        UserWarning: the model is DDP and not inside ``local_sgd_ctx`` (or
            ``no_sync``), so its gradients were all-reduced and averaging changes
            nothing.
    """
    check_context("local_sgd_step", ctx)
    hint = "Start with LocalSGDState(local_sgd_steps=k)."
    check_type("local_sgd_step", "state", state, LocalSGDState, hint=hint)
    check_type("local_sgd_step", "grad", grad, GradState, optional=True)
    inner = _check_model(model, "local_sgd_step")
    by_steps = state.count == "optimizer_steps"
    if by_steps and grad is None:
        what = (
            "the GradState accumulate_step returned when state.count is "
            "'optimizer_steps' (it tells which micro-steps stepped)"
        )
        hint = (
            "Pass grad=grad, or count every call with "
            "LocalSGDState(..., count='micro_batches')."
        )
        fail_value("local_sgd_step", "grad", grad, what, hint)
    if not by_steps and grad is not None:
        what = "None when state.count is 'micro_batches' (every call counts)"
        hint = (
            "Leave grad= out to count micro-batches as Accelerate's LocalSGD does, "
            "or count optimizer steps with "
            "LocalSGDState(..., count='optimizer_steps')."
        )
        fail_value("local_sgd_step", "grad", grad, what, hint)
    if grad is not None and not grad.sync_gradients:
        return state
    after = state.advanced()
    if ctx.num_processes > 1 and should_average(after):
        if _syncs_gradients(inner):
            warnings.warn(
                "local_sgd_step: model is a DistributedDataParallel outside "
                "local_sgd_ctx(ctx, state, model) (or no_sync), so its gradients "
                "are all-reduced every step and averaging its parameters changes "
                "nothing; run the loop inside local_sgd_ctx(ctx, state, model) or "
                "train the module unwrapped.",
                UserWarning,
                stacklevel=2,
            )
        average_parameters_(ctx, inner)
    return after


def local_sgd_ctx(
    ctx: DistributedContext,
    state: LocalSGDState,
    model: nn.Module,
    *,
    average_on_exit: bool = True,
) -> AbstractContextManager[None]:
    """Return the context a local-SGD loop runs in (Accelerate's ``with LocalSGD``).

    When ``state.enabled`` and there are several processes, a DDP ``model``'s
    gradients are not all-reduced inside (its ``no_sync()``), and on a normal exit
    its parameters are averaged once more (``average_parameters_``), as
    Accelerate's ``LocalSGD.__exit__`` does, unless ``average_on_exit=False``.
    Otherwise (disabled, or one process) it does nothing, so a disabled run trains
    as plain DDP without a line of its own. On an exception nothing is averaged
    (the other ranks may not reach the all-reduce). Every rank must enter it.

    Args:
        ctx: the run's context.
        state: the initial ``LocalSGDState`` (only ``enabled`` is read).
        model: the trained module (DDP or unwrapped, not FSDP2).
        average_on_exit: average the parameters on leaving the loop.

    Raises:
        TypeError: an argument of the wrong type, or an FSDP2 model.
        ValueError: a DDP model built with ``static_graph=True``.
        RuntimeError: several processes and no process group matching ``ctx``.

    >>> net = torch.nn.Linear(1, 1)
    >>> with local_sgd_ctx(DistributedContext(), LocalSGDState(local_sgd_steps=2), net):
    ...     pass  # one process: nothing to skip or average
    """
    check_context("local_sgd_ctx", ctx)
    hint = "Start with LocalSGDState(local_sgd_steps=k)."
    check_type("local_sgd_ctx", "state", state, LocalSGDState, hint=hint)
    inner = _check_model(model, "local_sgd_ctx")
    check_bool("local_sgd_ctx", "average_on_exit", average_on_exit)
    if not state.enabled or ctx.num_processes == 1:
        return contextlib.nullcontext()
    require_process_group(ctx, "local_sgd_ctx")
    return _local_window(ctx, inner, average_on_exit)


@contextlib.contextmanager
def _local_window(
    ctx: DistributedContext, model: nn.Module, average_on_exit: bool
) -> Iterator[None]:
    with no_sync_models("local_sgd_ctx", (model,)):
        yield
    if average_on_exit:
        average_parameters_(ctx, model)
