"""``InMemoryTracker``: a tracker that keeps its records in memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from funcaccel._checks import check_bool
from funcaccel.tracking._values import ConfigValue
from funcaccel.tracking._values import check_open
from funcaccel.tracking._values import check_step
from funcaccel.tracking._values import normalize_config
from funcaccel.tracking._values import normalize_metrics

__all__ = ["InMemoryTracker", "LogRecord"]


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
        check_bool("InMemoryTracker", "main_process_only", main_process_only)
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
        check_open("InMemoryTracker", "log", self._finished)
        check_step("InMemoryTracker.log", step)
        plain = normalize_metrics(values, caller="InMemoryTracker.log")
        self._logs.append(LogRecord(step=step, values=plain))

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Merge ``values`` into the stored configuration."""
        owner = "InMemoryTracker.store_init_configuration"
        check_open("InMemoryTracker", "store_init_configuration", self._finished)
        self._config.update(normalize_config(values, caller=owner))

    def finish(self) -> None:
        """Mark the tracker finished; the records stay readable."""
        self._finished = True
