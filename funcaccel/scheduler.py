"""Step a learning-rate scheduler in step with the optimizer updates actually applied.

The decision is pure (``scheduler_steps_due``, from ``ctx`` and the ``GradState``
that ``accumulate_step`` returned); ``maybe_step_scheduler`` carries it out, never
stepping a scheduler that has a ``total_steps`` (``OneCycleLR``) past its end.

>>> from funcaccel.accumulate import GradState
>>> from funcaccel.context import DistributedType
>>> ctx = DistributedContext(
...     num_processes=2, process_index=0, distributed_type=DistributedType.MULTI_CPU
... )
>>> scheduler_steps_due(ctx, GradState())
2
>>> scheduler_steps_due(ctx, GradState(), split_batches=True)
1
"""

from __future__ import annotations

from typing import Final
from typing import SupportsFloat

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.lr_scheduler import ReduceLROnPlateau

from funcaccel._typing import SupportsStep
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState

__all__ = ["maybe_step_scheduler", "scheduler_steps_due"]

_CALLER: Final = "maybe_step_scheduler"


def _check_flag(caller: str, name: str, value: object) -> None:
    if type(value) is not bool:
        msg = (
            f"{caller}: {name} must be a bool; got {value!r} ({type(value).__name__})."
        )
        raise TypeError(msg)


def scheduler_steps_due(
    ctx: DistributedContext,
    grad: GradState,
    *,
    split_batches: bool = False,
    step_with_optimizer: bool = True,
) -> int:
    """Return how many scheduler steps the last micro-step calls for (pure).

    1. ``step_with_optimizer=False``: one per call, whatever ``grad`` says.
    2. Else none after an accumulation micro-step (``not grad.sync_gradients``) or
       a step the fp16 scaler skipped (``grad.step_was_skipped``).
    3. Else one with ``split_batches``, ``ctx.num_processes`` without: the schedule
       counts single-process batches, so each update on ``p`` ranks counts ``p``
       (accumulation does not stretch it).

    Raises:
        TypeError: an argument of the wrong type.

    >>> from funcaccel.accumulate import GradState
    >>> one = DistributedContext()
    >>> scheduler_steps_due(one, GradState(accumulation_steps=2, micro_step=1, sync_gradients=False))
    0
    >>> scheduler_steps_due(one, GradState(step_was_skipped=True))
    0
    >>> scheduler_steps_due(one, GradState(step_was_skipped=True), step_with_optimizer=False)
    1
    """
    _check_args(ctx, grad, split_batches, step_with_optimizer, "scheduler_steps_due")
    return _due(ctx, grad, split_batches, step_with_optimizer)


def _check_args(
    ctx: object,
    grad: object,
    split_batches: object,
    step_with_optimizer: object,
    caller: str,
) -> None:
    if not isinstance(ctx, DistributedContext):
        msg = f"{caller}: ctx must be a DistributedContext; got {type(ctx).__name__}."
        raise TypeError(msg)
    if not isinstance(grad, GradState):
        msg = (
            f"{caller}: grad must be the GradState accumulate_step returned; got "
            f"{grad!r} ({type(grad).__name__})."
        )
        raise TypeError(msg)
    _check_flag(caller, "split_batches", split_batches)
    _check_flag(caller, "step_with_optimizer", step_with_optimizer)


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
    split_batches: bool = False,
    step_with_optimizer: bool = True,
    metrics: SupportsFloat | None = None,
) -> int:
    """Step ``scheduler`` in place as often as ``scheduler_steps_due`` says.

    Call it after every ``accumulate_step`` with the state that returned. A
    scheduler with a ``total_steps`` attribute (``OneCycleLR``) steps only while
    its ``_step_count <= total_steps``, so it stops at its end instead of raising.
    ``ReduceLROnPlateau`` is stepped with ``metrics`` (required for it, refused
    for others); as it counts evaluations, it is usually stepped with
    ``step_with_optimizer=False`` once per evaluation.

    Example, 2 ranks, ``k=2``, 4 batches per rank, ``StepLR``: ``_step_count`` goes
    1 → 3 → 5 on every rank (``split_batches=True``: 1 → 2 → 3). ``OneCycleLR`` with
    ``total_steps=3``, 2 ranks, ``k=1``: 3, 4, 4.

    Args:
        ctx: the run's context.
        scheduler: a torch LR scheduler, or anything with ``step()``.
        grad: the state ``accumulate_step`` returned for this micro-step.
        split_batches: the loader splits each batch across processes.
        step_with_optimizer: step with the optimizer (else once per call).
        metrics: the value ``ReduceLROnPlateau.step`` compares.

    Returns:
        How many times the scheduler stepped.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``metrics`` missing for ``ReduceLROnPlateau``, or given to
            another scheduler.
    """
    if not (  # the usual arguments in one expression (this runs per micro-step)
        isinstance(ctx, DistributedContext)
        and isinstance(grad, GradState)
        and type(split_batches) is bool
        and type(step_with_optimizer) is bool
    ):
        _check_args(ctx, grad, split_batches, step_with_optimizer, _CALLER)
    plateau = isinstance(scheduler, ReduceLROnPlateau)
    if (
        (metrics is None) == plateau
        or not callable(getattr(scheduler, "step", None))
        or isinstance(scheduler, Optimizer)
    ):
        _check_scheduler(scheduler, plateau, metrics)
    if plateau:
        _check_metrics(metrics)
    due = _due(ctx, grad, split_batches, step_with_optimizer)
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
        msg = (
            f"{_CALLER}: scheduler is an optimizer ({type(scheduler).__name__}), whose "
            "step() would update the parameters; pass the LR scheduler built on it."
        )
        raise TypeError(msg)
    if not callable(getattr(scheduler, "step", None)):
        msg = (
            f"{_CALLER}: scheduler must have a step() method; got "
            f"{scheduler!r} ({type(scheduler).__name__})."
        )
        raise TypeError(msg)
    if plateau and metrics is None:
        msg = (
            f"{_CALLER}: ReduceLROnPlateau steps on a metric but "
            "metrics=None; pass metrics=<validation loss or other monitored value>."
        )
        raise ValueError(msg)
    if not plateau and metrics is not None:
        msg = (
            f"{_CALLER}: metrics={metrics!r} is only used by "
            f"ReduceLROnPlateau, not {type(scheduler).__name__}; drop metrics."
        )
        raise ValueError(msg)


def _check_metrics(metrics: object) -> None:
    # ReduceLROnPlateau compares float(metrics) with its best value so far.
    try:
        if isinstance(metrics, (str, bytes)):
            raise TypeError
        float(metrics)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        msg = (
            f"{_CALLER}: metrics must be a number or a one-element tensor for "
            f"ReduceLROnPlateau to compare; got {metrics!r} ({type(metrics).__name__})."
        )
        raise TypeError(msg) from None
