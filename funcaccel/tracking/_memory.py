"""``InMemoryTracker``: a tracker that keeps its records in memory."""

from __future__ import annotations

import dataclasses

from funcaccel.tracking._base import PlainMetrics
from funcaccel.tracking._base import TrackerBase
from funcaccel.tracking._values import ConfigValue

__all__ = ["InMemoryTracker", "LogRecord"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LogRecord:
    """One ``log`` call as ``InMemoryTracker`` kept it."""

    step: int | None
    values: dict[str, bool | int | float | str]


class InMemoryTracker(TrackerBase):
    """Keep every record in memory; for tests, notebooks and custom reporting.

    >>> tracker = InMemoryTracker()
    >>> tracker.log({"loss": 1.5}, step=0)
    >>> tracker.store_init_configuration({"lr": 0.1})
    >>> tracker.logs[0].values, tracker.config
    ({'loss': 1.5}, {'lr': 0.1})
    """

    __slots__ = ("_config", "_logs")

    def __init__(self, *, name: str = "memory", main_process_only: bool = True) -> None:
        super().__init__(name=name, main_process_only=main_process_only)
        self._logs: list[LogRecord] = []
        self._config: dict[str, ConfigValue] = {}

    @property
    def logs(self) -> tuple[LogRecord, ...]:
        """Every ``log`` call so far, in order."""
        return tuple(self._logs)

    @property
    def config(self) -> dict[str, ConfigValue]:
        """A copy of the stored configuration (later calls override keys)."""
        return dict(self._config)

    def _write_metrics(self, values: PlainMetrics, step: int | None) -> None:
        self._logs.append(LogRecord(step=step, values=values))

    def _write_config(self, values: dict[str, ConfigValue]) -> None:
        self._config.update(values)
