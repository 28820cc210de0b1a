"""Step a learning-rate scheduler in step with the optimizer updates actually applied.

The decision is pure (``scheduler_steps_due``, from ``ctx`` and the ``GradState``
that ``accumulate_step`` returned); ``maybe_step_scheduler`` carries it out, never
stepping a scheduler that has a ``total_steps`` (``OneCycleLR``) past its end.

>>> from funcaccel.accumulate import GradState
>>> from funcaccel.context import DistributedType
>>> ctx = DistributedContext(
...     num_processes=2, process_index=0, distributed_type=DistributedType.MULTI_CPU
... )
>>> scheduler_steps_due(ctx, GradState(), split_batches=False)
2
>>> scheduler_steps_due(ctx, GradState(), split_batches=True)
1

How many steps an update counts for depends on the loader (``split_batches``),
so with several processes the loader (or the flag) must be passed:

>>> scheduler_steps_due(ctx, GradState())
Traceback (most recent call last):
...
ValueError: scheduler_steps_due: with 2 processes an update counts 1 scheduler step ...
"""

from __future__ import annotations

from typing import Final
from typing import SupportsFloat

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.lr_scheduler import ReduceLROnPlateau

from funcaccel._checks import check_bool
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import summary
from funcaccel._checks import type_name
from funcaccel._ctx_checks import check_context
from funcaccel._typing import SupportsStep
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.loader import ShardedLoader

__all__ = ["maybe_step_scheduler", "scheduler_steps_due"]

_CALLER: Final = "maybe_step_scheduler"
_WITH_LOADER: Final = "None when loader= is given"
_BOTH: Final = "The loader already says whether it splits batches; pass one of the two."
_NOT_OPTIMIZER: Final = (
    "an LR scheduler, not an optimizer",
    "Its step() would update the parameters; pass the LR scheduler built on it.",
)
_MSG_NEITHER: Final = (
    "{caller}: with {p} processes an update counts 1 scheduler step if the loader "
    "splits each batch across processes (split_batches=True) and {p} if not, and "
    "neither loader= nor split_batches= was given; pass loader=<the ShardedLoader "
    "from shard_loader>, or split_batches=True/False for a loader of your own."
)
_MSG_NO_METRICS: Final = (
    f"{_CALLER}: ReduceLROnPlateau steps on a metric but metrics=None; pass "
    "metrics=<validation loss or other monitored value>."
)
_MSG_UNUSED_METRICS: Final = (
    _CALLER + ": metrics={} is only used by ReduceLROnPlateau, not {}; drop metrics."
)


def scheduler_steps_due(
    ctx: DistributedContext,
    grad: GradState,
    *,
    loader: ShardedLoader | None = None,
    split_batches: bool | None = None,
    step_with_optimizer: bool = True,
) -> int:
    """Return how many scheduler steps the last micro-step calls for (pure).

    1. ``step_with_optimizer=False``: one per call, whatever ``grad`` says.
    2. Else none after an accumulation micro-step (``not grad.sync_gradients``) or
       a step the fp16 scaler skipped (``grad.step_was_skipped``).
    3. Else one with ``split_batches``, ``ctx.num_processes`` without: the schedule
       counts single-process batches, so each update on ``p`` ranks counts ``p``
       (accumulation does not stretch it).

    ``split_batches`` is read from ``loader`` (the ``ShardedLoader`` the batches
    come from), or given as a bool for a loader of your own. One process needs
    neither (an update counts one step either way), nor does
    ``step_with_optimizer=False``; several processes refuse to guess.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: several processes and neither ``loader`` nor
            ``split_batches``; or both.

    >>> from funcaccel.accumulate import GradState
    >>> one = DistributedContext()
    >>> scheduler_steps_due(one, GradState(accumulation_steps=2, micro_step=1, sync_gradients=False))
    0
    >>> scheduler_steps_due(one, GradState(step_was_skipped=True))
    0
    >>> scheduler_steps_due(one, GradState(step_was_skipped=True), step_with_optimizer=False)
    1
    """
    caller = "scheduler_steps_due"
    _check_args(ctx, grad, step_with_optimizer, caller)
    split = _split_batches(ctx, loader, split_batches, step_with_optimizer, caller)
    return _due(ctx, grad, split, step_with_optimizer)


def _split_batches(
    ctx: DistributedContext,
    loader: object,
    split_batches: object,
    step_with_optimizer: bool,
    caller: str,
) -> bool:
    """Return the loader's ``split_batches``, from whichever of the two was given."""
    if split_batches is not None:
        if loader is not None:
            fail_value(caller, "split_batches", split_batches, _WITH_LOADER, _BOTH)
        return check_bool(caller, "split_batches", split_batches)
    if loader is not None:
        what = "the ShardedLoader shard_loader returned"
        hint = "For a loader of your own pass split_batches=True or False instead."
        return check_type(
            caller, "loader", loader, ShardedLoader, what=what, hint=hint
        ).split_batches
    if ctx.num_processes > 1 and step_with_optimizer:
        raise ValueError(_MSG_NEITHER.format(caller=caller, p=ctx.num_processes))
    return False


def _check_args(
    ctx: object,
    grad: object,
    step_with_optimizer: object,
    caller: str,
) -> None:
    check_context(caller, ctx)
    what = "the GradState accumulate_step returned"
    check_type(caller, "grad", grad, GradState, what=what)
    check_bool(caller, "step_with_optimizer", step_with_optimizer)


def _due(
    ctx: DistributedContext,
    grad: GradState,
    split_batches: bool,
    step_with_optimizer: bool,
) -> int:
    if not step_with_optimizer:
        return 1
    if not grad.sync_gradients or grad.step_was_skipped:
        return 0
    return 1 if split_batches else ctx.num_processes


def _has_steps_left(scheduler: object) -> bool:
    # OneCycleLR raises once stepped past total_steps; _step_count starts at 1
    # after the constructor's own step, so steps are allowed while <= total_steps.
    total = getattr(scheduler, "total_steps", None)
    count = getattr(scheduler, "_step_count", None)
    if not isinstance(total, int) or not isinstance(count, int):
        return True
    return count <= total


def maybe_step_scheduler(
    ctx: DistributedContext,
    scheduler: LRScheduler | SupportsStep,
    grad: GradState,
    *,
    loader: ShardedLoader | None = None,
    split_batches: bool | None = None,
    step_with_optimizer: bool = True,
    metrics: SupportsFloat | None = None,
) -> int:
    """Step ``scheduler`` in place as often as ``scheduler_steps_due`` says.

    Call it after every ``accumulate_step`` with the state that returned, and
    with ``loader=`` the ``ShardedLoader`` the batches come from (whether it
    splits batches decides how many steps an update counts). A scheduler with a
    ``total_steps`` (``OneCycleLR``) stops at its end instead of raising;
    ``ReduceLROnPlateau`` needs ``metrics`` and is usually stepped once per
    evaluation with ``step_with_optimizer=False``. The rules:
    docs/accumulate.md#semantics-stepping-the-scheduler.

    Example, 2 ranks, ``k=2``, 4 batches per rank, ``StepLR``: ``_step_count`` goes
    1 → 3 → 5 on every rank (``split_batches=True``: 1 → 2 → 3). ``OneCycleLR`` with
    ``total_steps=3``, 2 ranks, ``k=1``: 3, 4, 4.

    Args:
        ctx: the run's context.
        scheduler: a torch LR scheduler, or anything with ``step()``.
        grad: the state ``accumulate_step`` returned for this micro-step.
        loader: the ``ShardedLoader`` being trained on; its ``split_batches``
            is used.
        split_batches: instead of ``loader``, for a loader of your own: whether
            each batch is split across processes.
        step_with_optimizer: step with the optimizer (else once per call).
        metrics: the value ``ReduceLROnPlateau.step`` compares.

    Returns:
        How many times the scheduler stepped.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``metrics`` missing for ``ReduceLROnPlateau``, or given to
            another scheduler; several processes and neither ``loader`` nor
            ``split_batches`` (or both).
    """
    if not (  # the usual arguments in one expression (this runs per micro-step)
        isinstance(ctx, DistributedContext)
        and isinstance(grad, GradState)
        and type(step_with_optimizer) is bool
    ):
        _check_args(ctx, grad, step_with_optimizer, _CALLER)
    # The usual calls, decided without a function call (this runs per micro-step).
    if split_batches is None and type(loader) is ShardedLoader:
        split = loader.split_batches
    elif split_batches is None and loader is None and ctx.num_processes == 1:
        split = False  # one process: an update counts one step either way
    else:
        split = _split_batches(ctx, loader, split_batches, step_with_optimizer, _CALLER)
    plateau = isinstance(scheduler, ReduceLROnPlateau)
    if (
        (metrics is None) == plateau
        or not callable(getattr(scheduler, "step", None))
        or isinstance(scheduler, Optimizer)
    ):
        _check_scheduler(scheduler, plateau, metrics)
    if plateau:
        _check_metrics(metrics)
    due = _due(ctx, grad, split, step_with_optimizer)
    stepped = 0
    while stepped < due and _has_steps_left(scheduler):
        if isinstance(scheduler, ReduceLROnPlateau):
            assert metrics is not None  # checked above
            scheduler.step(metrics)
        else:
            scheduler.step()
        stepped += 1
    return stepped


def _check_scheduler(scheduler: object, plateau: bool, metrics: object) -> None:
    if isinstance(scheduler, Optimizer):
        fail_type(_CALLER, "scheduler", scheduler, *_NOT_OPTIMIZER)
    if not callable(getattr(scheduler, "step", None)):
        fail_type(_CALLER, "scheduler", scheduler, "an object with a step() method")
    if plateau and metrics is None:
        raise ValueError(_MSG_NO_METRICS)
    if not plateau and metrics is not None:
        kind = type_name(scheduler)
        raise ValueError(_MSG_UNUSED_METRICS.format(summary(metrics), kind))


def _check_metrics(metrics: object) -> None:
    # ReduceLROnPlateau compares float(metrics) with its best value so far.
    number = not isinstance(metrics, (str, bytes))
    try:
        float(metrics)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        number = False
    if not number:
        what = "a number or a one-element tensor for ReduceLROnPlateau to compare"
        fail_type(_CALLER, "metrics", metrics, what)
