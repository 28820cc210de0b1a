"""Step a learning-rate scheduler in step with the optimizer updates actually applied.

The decision is pure (``scheduler_steps_due``, from ``ctx`` and the ``GradState``
that ``accumulate_step`` returned); ``maybe_step_scheduler`` carries it out, never
stepping a scheduler that has a ``total_steps`` (``OneCycleLR``) past its end.

>>> from funcaccel.accumulate import GradState
>>> from funcaccel.context import DistributedType
>>> ctx = DistributedContext(
...     num_processes=2, process_index=0, distributed_type=DistributedType.MULTI_CPU
... )
>>> scheduler_steps_due(ctx, GradState(), schedule_counts="batches")
2
>>> scheduler_steps_due(ctx, GradState(), schedule_counts="updates")
1

How many steps an update counts depends on how the schedule's length is
counted, so every call that steps with the optimizer says it, through the
loader or ``schedule_counts``, on one process too (where both give 1):

>>> scheduler_steps_due(DistributedContext(), GradState())
Traceback (most recent call last):
...
ValueError: scheduler_steps_due: neither loader= nor schedule_counts= says how ...
"""

from __future__ import annotations

from typing import Final
from typing import Literal
from typing import SupportsFloat
from typing import cast

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.lr_scheduler import ReduceLROnPlateau

from funcaccel._checks import check_bool
from funcaccel._checks import check_choice
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

__all__ = ["ScheduleCounts", "maybe_step_scheduler", "scheduler_steps_due"]

ScheduleCounts = Literal["updates", "batches"]
_COUNTS: Final[tuple[ScheduleCounts, ...]] = ("updates", "batches")
_CALLER: Final = "maybe_step_scheduler"
_NOT_OPTIMIZER: Final = (
    "an LR scheduler, not an optimizer",
    "Its step() would update the parameters; pass the LR scheduler built on it.",
)
_MSG_NEITHER: Final = (
    "{caller}: neither loader= nor schedule_counts= says how the schedule's length "
    "is counted, which decides how many steps an optimizer update counts once "
    "several processes run (this run has {p}); got loader=None, "
    "schedule_counts=None. Pass loader=<the ShardedLoader from shard_loader> "
    "(Accelerate's convention, read from that loader), schedule_counts='updates' "
    "for a schedule counted in optimizer updates (one step per update; a loop "
    "without a loader, such as nanoGPT's), or schedule_counts='batches' for one "
    "counted in one process's batches (num_processes steps per update)."
)
_REPLACED: Final = "left out: schedule_counts= replaced it"
_SPLIT_FIX: Final = (
    "Pass schedule_counts='batches' (num_processes steps per update, what "
    "split_batches=False did: a schedule counted in one process's batches), "
    "schedule_counts='updates' (one step per update, what split_batches=True "
    "did), or loader=<the ShardedLoader> to read it from the loader."
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
    schedule_counts: ScheduleCounts | None = None,
    split_batches: None = None,
    step_with_optimizer: bool = True,
) -> int:
    """Return how many scheduler steps the last micro-step calls for (pure).

    1. ``step_with_optimizer=False``: one per call, whatever ``grad`` says.
    2. Else none after an accumulation micro-step (``not grad.sync_gradients``) or
       a step the fp16 scaler skipped (``grad.step_was_skipped``).
    3. Else one per update when the schedule counts optimizer updates
       (``schedule_counts="updates"``); when it counts one process's batches
       (``"batches"``, Accelerate's convention), one per update if ``loader``
       splits each batch across processes and ``ctx.num_processes`` if not (an
       update on ``p`` ranks used up ``p`` such batches; accumulation does not
       stretch it); a loader sharded on a mesh counts its data-parallel ranks
       (``loader.data_parallel_size``), since tensor-parallel peers read the
       same batches.

    ``schedule_counts`` defaults to ``"batches"`` when ``loader`` (the
    ``ShardedLoader`` the batches come from) is given; without a loader it must
    be given whenever the scheduler steps with the optimizer, on one process too,
    so that a script fails where it is written rather than when scaled out.
    ``split_batches=`` was replaced by ``schedule_counts=`` and is refused.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: neither ``loader`` nor ``schedule_counts`` (with
            ``step_with_optimizer``), a ``schedule_counts`` other than
            ``"updates"``/``"batches"``, or ``split_batches`` given.

    >>> from funcaccel.accumulate import GradState
    >>> one = DistributedContext()
    >>> micro = GradState(accumulation_steps=2, micro_step=1, sync_gradients=False)
    >>> scheduler_steps_due(one, micro, schedule_counts="updates")
    0
    >>> scheduler_steps_due(one, GradState(step_was_skipped=True), schedule_counts="updates")
    0
    >>> scheduler_steps_due(one, GradState(step_was_skipped=True), step_with_optimizer=False)
    1
    """
    caller = "scheduler_steps_due"
    _check_args(ctx, grad, step_with_optimizer, caller)
    per_update = _per_update(
        ctx, loader, schedule_counts, split_batches, step_with_optimizer, caller
    )
    return _due(grad, per_update, step_with_optimizer)


def _per_update(
    ctx: DistributedContext,
    loader: object,
    schedule_counts: object,
    split_batches: object,
    step_with_optimizer: bool,
    caller: str,
) -> int:
    """Return how many scheduler steps one optimizer update counts."""
    if split_batches is not None:
        fail_value(caller, "split_batches", split_batches, _REPLACED, _SPLIT_FIX)
    split, streams = False, ctx.num_processes
    if loader is not None:
        if type(loader) is not ShardedLoader:  # the check itself only when needed
            what = "the ShardedLoader shard_loader returned"
            hint = "Without one, pass schedule_counts='updates' or 'batches' instead."
            check_type(caller, "loader", loader, ShardedLoader, what=what, hint=hint)
        sharded = cast("ShardedLoader", loader)
        # On a mesh only the data-parallel ranks read distinct batches.
        split, streams = sharded.split_batches, sharded.data_parallel_size
    if schedule_counts is None:
        if loader is None and step_with_optimizer:
            raise ValueError(_MSG_NEITHER.format(caller=caller, p=ctx.num_processes))
        schedule_counts = "batches"
    elif type(schedule_counts) is not str or schedule_counts not in _COUNTS:
        check_choice(caller, "schedule_counts", schedule_counts, _COUNTS)
    return 1 if schedule_counts == "updates" or split else streams


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


def _due(grad: GradState, per_update: int, step_with_optimizer: bool) -> int:
    if not step_with_optimizer:
        return 1
    if not grad.sync_gradients or grad.step_was_skipped:
        return 0
    return per_update


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
    schedule_counts: ScheduleCounts | None = None,
    split_batches: None = None,
    step_with_optimizer: bool = True,
    metrics: SupportsFloat | None = None,
) -> int:
    """Step ``scheduler`` in place as often as ``scheduler_steps_due`` says.

    Call it after every ``accumulate_step`` with the state that returned, and
    say how the schedule's length is counted: ``loader=`` the ``ShardedLoader``
    the batches come from (Accelerate's convention: ``num_processes`` steps per
    update, one if the loader splits batches), or ``schedule_counts="updates"``
    (one step per update, e.g. a loop without a loader, each rank sampling its
    own batches) or ``"batches"``. Leaving out both is an error on one process
    too, where the count would be right, so that it is not first met when the
    script is scaled out (Accelerate needs neither: its loader and
    ``split_batches`` live on the ``Accelerator``). A scheduler with a
    ``total_steps`` (``OneCycleLR``) stops at its end instead of raising;
    ``ReduceLROnPlateau`` needs ``metrics`` and is usually stepped once per
    evaluation with ``step_with_optimizer=False``. The rules:
    docs/accumulate.md#semantics-stepping-the-scheduler.

    Example, 2 ranks, ``k=2``, 4 batches per rank, ``StepLR``: ``_step_count`` goes
    1 → 3 → 5 on every rank with ``schedule_counts="batches"`` (or an unsplit
    ``loader``), 1 → 2 → 3 with ``"updates"`` (or a splitting ``loader``).
    ``OneCycleLR`` with ``total_steps=3``, 2 ranks, ``k=1``, ``"batches"``: 3, 4, 4.

    Args:
        ctx: the run's context.
        scheduler: a torch LR scheduler, or anything with ``step()``.
        grad: the state ``accumulate_step`` returned for this micro-step.
        loader: the ``ShardedLoader`` being trained on; its ``split_batches``
            is used, and ``schedule_counts`` defaults to ``"batches"``.
        schedule_counts: ``"updates"`` if the schedule's length is counted in
            optimizer updates, ``"batches"`` if in one process's batches
            (Accelerate's convention). Required without ``loader``.
        split_batches: removed; refused with the ``schedule_counts`` to use.
        step_with_optimizer: step with the optimizer (else once per call).
        metrics: the value ``ReduceLROnPlateau.step`` compares.

    Returns:
        How many times the scheduler stepped.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``metrics`` missing for ``ReduceLROnPlateau``, or given to
            another scheduler; neither ``loader`` nor ``schedule_counts`` (with
            ``step_with_optimizer``); a ``schedule_counts`` other than
            ``"updates"``/``"batches"``; ``split_batches`` given.
    """
    if not (  # the usual arguments in one expression (this runs per micro-step)
        isinstance(ctx, DistributedContext)
        and isinstance(grad, GradState)
        and type(step_with_optimizer) is bool
    ):
        _check_args(ctx, grad, step_with_optimizer, _CALLER)
    plateau = isinstance(scheduler, ReduceLROnPlateau)
    if (
        (metrics is None) == plateau
        or not callable(getattr(scheduler, "step", None))
        or isinstance(scheduler, Optimizer)
    ):
        _check_scheduler(scheduler, plateau, metrics)
    if plateau:
        _check_metrics(metrics)
    per_update = _per_update(
        ctx, loader, schedule_counts, split_batches, step_with_optimizer, _CALLER
    )
    due = _due(grad, per_update, step_with_optimizer)
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
