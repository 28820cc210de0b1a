"""Experiment trackers and the one place that decides which rank calls them.

The rules: docs/tracking.md#semantics-trackers-and-gating.

A tracker is any object with the ``Tracker`` methods; the helpers here take ``ctx``
and call each tracker on the main process only, or on every rank for a tracker whose
``main_process_only`` is ``False``. Trackers do no I/O before their first gated
call, so every rank may construct the same list:

>>> from funcaccel.context import DistributedContext, DistributedType
>>> rank1 = DistributedContext(
...     num_processes=2, process_index=1, distributed_type=DistributedType.MULTI_CPU
... )
>>> from funcaccel.tracking import InMemoryTracker
>>> tracker = InMemoryTracker()
>>> log_metrics(rank1, [tracker], {"loss": 0.5}, step=3)  # rank 1: not called
>>> log_metrics(DistributedContext(), [tracker], {"loss": 0.5}, step=3)
>>> [(r.step, r.values) for r in tracker.logs]
[(3, {'loss': 0.5})]

``InMemoryTracker`` keeps records in memory; the other built-in trackers write
files. ``normalize_metrics`` and ``normalize_config`` give a custom tracker the same
checks on values.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Mapping
from typing import Final
from typing import Protocol
from typing import runtime_checkable

from funcaccel._checks import check_bool
from funcaccel._checks import fail_type
from funcaccel._ctx_checks import check_context
from funcaccel.context import DistributedContext
from funcaccel.tracking._values import ConfigValue
from funcaccel.tracking._values import MetricValue
from funcaccel.tracking._values import check_mapping
from funcaccel.tracking._values import check_step

__all__ = ["Tracker", "finish_trackers", "log_metrics", "store_config"]

_TRACKER: Final = "a Tracker (with name, log, store_init_configuration and finish)"


@runtime_checkable
class Tracker(Protocol):
    """What ``log_metrics``, ``store_config`` and ``finish_trackers`` call.

    A tracker may also have ``main_process_only: bool``; when it is absent the
    tracker is treated as main-process-only. Return values are ignored.
    """

    @property
    def name(self) -> str:
        """A short name for messages, such as ``"jsonl"``."""
        ...

    def log(self, values: Mapping[str, MetricValue], step: int | None = None) -> object:
        """Record one set of metric values, at ``step`` when given."""
        ...

    def store_init_configuration(self, values: Mapping[str, ConfigValue]) -> object:
        """Record the run's hyperparameters."""
        ...

    def finish(self) -> object:
        """Flush and release whatever the tracker holds."""
        ...


def _gated(
    caller: str, ctx: DistributedContext, trackers: Iterable[Tracker]
) -> list[Tracker]:
    """Return the trackers this rank calls, in order, after checking the inputs."""
    check_context(caller, ctx)
    if isinstance(trackers, Tracker) or not isinstance(trackers, Iterable):
        hint = "Wrap a single tracker in a list: [tracker]."
        fail_type(caller, "trackers", trackers, "a list of trackers", hint)
    chosen: list[Tracker] = []
    for index, tracker in enumerate(list(trackers)):
        if not isinstance(tracker, Tracker):
            fail_type(caller, f"trackers[{index}]", tracker, _TRACKER)
        main_only = getattr(tracker, "main_process_only", True)
        name = f"the main_process_only of trackers[{index}] ({tracker.name})"
        check_bool(caller, name, main_only)
        if ctx.is_main_process or not main_only:
            chosen.append(tracker)
    return chosen


def log_metrics(
    ctx: DistributedContext,
    trackers: Iterable[Tracker],
    values: Mapping[str, MetricValue],
    *,
    step: int | None = None,
) -> None:
    """Call ``tracker.log(values, step=step)`` for each tracker this rank runs.

    On 2 ranks, ``log_metrics(ctx, [t], {"loss": 0.5}, step=3)`` calls
    ``t.log({"loss": 0.5}, step=3)`` once, on rank 0; a tracker with
    ``main_process_only=False`` is called on both. ``values`` is passed through
    unmodified (the same object); trackers are called in order.

    Raises:
        TypeError: ``ctx``, ``trackers``, ``values`` or ``step`` of the wrong type.
        ValueError: a negative ``step``.
    """
    caller = "log_metrics"
    chosen = _gated(caller, ctx, trackers)
    check_mapping(caller, "values", values)
    check_step(caller, step)
    for tracker in chosen:
        tracker.log(values, step=step)


def store_config(
    ctx: DistributedContext,
    trackers: Iterable[Tracker],
    values: Mapping[str, ConfigValue],
) -> None:
    """Call ``tracker.store_init_configuration(values)`` for each tracker this rank runs.

    Gating as ``log_metrics``; ``values`` is passed through unmodified.

    Raises:
        TypeError: ``ctx``, ``trackers`` or ``values`` of the wrong type.
    """
    caller = "store_config"
    chosen = _gated(caller, ctx, trackers)
    check_mapping(caller, "values", values)
    for tracker in chosen:
        tracker.store_init_configuration(values)


def finish_trackers(ctx: DistributedContext, trackers: Iterable[Tracker]) -> None:
    """Call ``tracker.finish()`` for each tracker this rank runs, all of them.

    Gating as ``log_metrics``. A tracker that raises does not stop the others from
    being finished; the first error is raised once all have been called.

    Raises:
        TypeError: ``ctx`` or ``trackers`` of the wrong type.
        Exception: the first error a tracker's ``finish`` raised.
    """
    errors: list[Exception] = []
    for tracker in _gated("finish_trackers", ctx, trackers):
        try:
            tracker.finish()
        except Exception as error:
            errors.append(error)  # raised once every tracker has been finished
    if errors:
        raise errors[0]
