"""Experiment trackers and the one place that decides which rank calls them (SPEC §9).

A tracker is any object with the ``Tracker`` methods; the helpers here take ``ctx``
and call each tracker on the main process only, or on every rank for a tracker whose
``main_process_only`` is ``False``. Trackers do no I/O before their first gated
call, so every rank may construct the same list:

>>> from funcaccel.context import DistributedContext, DistributedType
>>> rank1 = DistributedContext(
...     num_processes=2, process_index=1, distributed_type=DistributedType.MULTI_CPU
... )
>>> tracker = InMemoryTracker()
>>> log_metrics(rank1, [tracker], {"loss": 0.5}, step=3)  # rank 1: not called
>>> log_metrics(DistributedContext(), [tracker], {"loss": 0.5}, step=3)
>>> [(r.step, r.values) for r in tracker.logs]
[(3, {'loss': 0.5})]

``InMemoryTracker`` (here) keeps records in memory; the file-backed trackers live
in ``funcaccel.trackers``. ``normalize_metrics`` and ``normalize_config`` (defined
in ``funcaccel._tracker_checks``) give a custom tracker the same checks on values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from collections.abc import Mapping
from typing import Protocol
from typing import runtime_checkable

from funcaccel._checks import _check_bool
from funcaccel._tracker_checks import ConfigValue
from funcaccel._tracker_checks import MetricValue
from funcaccel._tracker_checks import _check_mapping
from funcaccel._tracker_checks import _check_open
from funcaccel._tracker_checks import _check_step
from funcaccel._tracker_checks import _type_name
from funcaccel._tracker_checks import normalize_config
from funcaccel._tracker_checks import normalize_metrics
from funcaccel.context import DistributedContext

__all__ = [
    "ConfigValue",
    "InMemoryTracker",
    "LogRecord",
    "MetricValue",
    "Tracker",
    "finish_trackers",
    "log_metrics",
    "normalize_config",
    "normalize_metrics",
    "store_config",
]


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
    if not isinstance(ctx, DistributedContext):
        msg = (
            f"{caller}: ctx must be a DistributedContext; got {ctx!r} "
            f"({_type_name(ctx)}). Build one with build_context()."
        )
        raise TypeError(msg)
    if isinstance(trackers, Tracker) or not isinstance(trackers, Iterable):
        msg = (
            f"{caller}: trackers must be a list of trackers; got {trackers!r} "
            f"({_type_name(trackers)}). Wrap a single tracker in a list: [tracker]."
        )
        raise TypeError(msg)
    chosen: list[Tracker] = []
    for index, tracker in enumerate(list(trackers)):
        if not isinstance(tracker, Tracker):
            msg = (
                f"{caller}: trackers[{index}] is {tracker!r} ({_type_name(tracker)}), "
                "which lacks the Tracker methods (name, log, store_init_configuration, "
                "finish)."
            )
            raise TypeError(msg)
        main_only = getattr(tracker, "main_process_only", True)
        if not isinstance(main_only, bool):
            msg = (
                f"{caller}: trackers[{index}] ({tracker.name}) has main_process_only="
                f"{main_only!r} ({_type_name(main_only)}); it must be a bool."
            )
            raise TypeError(msg)
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
    _check_mapping(caller, "values", values)
    _check_step(caller, step)
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
    _check_mapping(caller, "values", values)
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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LogRecord:
    """One ``log`` call as ``InMemoryTracker`` kept it."""

    step: int | None
    values: dict[str, bool | int | float | str]


class InMemoryTracker:
    """Keep every record in memory; for tests, notebooks and custom reporting.

    >>> tracker = InMemoryTracker()
    >>> tracker.log({"loss": 1.5}, step=0)
    >>> tracker.store_init_configuration({"lr": 0.1})
    >>> tracker.logs[0].values, tracker.config
    ({'loss': 1.5}, {'lr': 0.1})
    """

    __slots__ = ("_config", "_finished", "_logs", "_main_process_only", "_name")

    def __init__(self, *, name: str = "memory", main_process_only: bool = True) -> None:
        _check_bool("InMemoryTracker", "main_process_only", main_process_only)
        if not isinstance(name, str):
            msg = f"InMemoryTracker: name must be a str; got {name!r}."
            raise TypeError(msg)
        if not name:
            msg = "InMemoryTracker: name must not be empty; got ''. Pass e.g. 'memory'."
            raise ValueError(msg)
        self._name = name
        self._main_process_only = main_process_only
        self._logs: list[LogRecord] = []
        self._config: dict[str, ConfigValue] = {}
        self._finished = False

    @property
    def name(self) -> str:
        """The tracker's name."""
        return self._name

    @property
    def main_process_only(self) -> bool:
        """Whether only the main process calls this tracker."""
        return self._main_process_only

    @property
    def logs(self) -> tuple[LogRecord, ...]:
        """Every ``log`` call so far, in order."""
        return tuple(self._logs)

    @property
    def config(self) -> dict[str, ConfigValue]:
        """A copy of the stored configuration (later calls override keys)."""
        return dict(self._config)

    @property
    def finished(self) -> bool:
        """Whether ``finish()`` was called."""
        return self._finished

    def log(self, values: Mapping[str, object], step: int | None = None) -> None:
        """Append a record of ``values`` at ``step``; ``values`` is copied."""
        _check_open("InMemoryTracker", "log", self._finished)
        _check_step("InMemoryTracker.log", step)
        plain = normalize_metrics(values, caller="InMemoryTracker.log")
        self._logs.append(LogRecord(step=step, values=plain))

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Merge ``values`` into the stored configuration."""
        owner = "InMemoryTracker.store_init_configuration"
        _check_open("InMemoryTracker", "store_init_configuration", self._finished)
        self._config.update(normalize_config(values, caller=owner))

    def finish(self) -> None:
        """Mark the tracker finished; the records stay readable."""
        self._finished = True
