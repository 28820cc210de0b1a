"""The built-in trackers that write plain files: JSON lines and CSV.

Each satisfies ``funcaccel.tracking.Tracker`` and is called through ``log_metrics``,
``store_config`` and ``finish_trackers``. None touches the disk (or imports an
optional package) before its first call, so every rank may build the same list. A
file tracker opens its file on first use, appends, flushes after every record so a
crash loses nothing, and ``finish()`` closes it; ``finish()`` twice is harmless, a
``log`` after ``finish()`` is a ``ValueError``. Values go through
``normalize_metrics`` / ``normalize_config``: a one-element tensor is logged as its
item, a larger tensor is a ``ValueError``, another type a ``TypeError``.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Callable
from collections.abc import Mapping
from pathlib import Path
from typing import IO
from typing import Final

from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel.tracking._base import PlainMetrics
from funcaccel.tracking._base import TrackerBase
from funcaccel.tracking._base import tracker_path
from funcaccel.tracking._values import ConfigValue

__all__ = [
    "CSVTracker",
    "JSONLTracker",
]

Clock = Callable[[], float]
_TIME_KEYS: Final = ("step", "time")
_RESERVED: Final = (*_TIME_KEYS, "config")
_NOT_RESERVED: Final = (
    "other than 'step', 'time' and 'config' (each record's own keys)",
    "Rename that metric.",
)
_STEP_TIME: Final = (
    "a row starting with 'step', 'time'",
    "Pass a new path or one a CSVTracker wrote.",
)
_FIRST: Final = (
    "Log every metric in the first call (step and time are reserved), or use "
    "JSONLTracker."
)
_MOVE_IT: Final = "Move it away or pass another path."


def _check_clock(owner: str, clock: object) -> Clock:
    if not callable(clock):
        what = "a callable returning the wall time, such as time.time"
        fail_type(owner, "clock", clock, what)
    return clock


def _open_append(owner: str, path: Path) -> IO[str]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return path.open("a", encoding="utf-8", newline="")
    except OSError as error:
        msg = (
            f"{owner}: cannot open {str(path)!r} for appending: {error}; pass a path "
            "in a directory this process can write."
        )
        raise OSError(msg) from error


class _FileTracker(TrackerBase):
    """What the file trackers share: the checked path and clock, a file opened late."""

    __slots__ = ("_clock", "_file", "_path")

    def __init__(
        self,
        owner: str,
        name: str,
        path: str | os.PathLike[str],
        main_process_only: bool,
        clock: Clock,
    ) -> None:
        self._path = tracker_path(owner, "path", path)
        super().__init__(name=name, main_process_only=main_process_only)
        self._clock = _check_clock(owner, clock)
        self._file: IO[str] | None = None

    @property
    def path(self) -> Path:
        """The file written."""
        return self._path


class JSONLTracker(_FileTracker):
    """Append one JSON object per line to ``path``.

    ``log(values, step)`` writes ``{"step": step, "time": <wall time>, **values}``;
    ``store_init_configuration(values)`` writes ``{"config": {...}, "time": ...}``
    to the same file, so a reader tells the two apart by the ``"config"`` key
    (hence ``step``, ``time`` and ``config`` are reserved metric names). NaN and
    infinities are written as ``NaN``/``Infinity``, which Python's ``json`` reads.

    Args:
        path: the file; created with its parent directories on first use, and
            appended to when it exists.
        main_process_only: whether only the main process writes (the default).
        clock: the wall-time source for ``"time"``; ``time.time`` by default.
    """

    __slots__ = ()

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        main_process_only: bool = True,
        clock: Clock = time.time,
    ) -> None:
        super().__init__("JSONLTracker", "jsonl", path, main_process_only, clock)

    def _write(self, record: Mapping[str, object]) -> None:
        line = json.dumps(record) + "\n"
        if self._file is None:
            self._file = _open_append("JSONLTracker", self._path)
        self._file.write(line)
        self._file.flush()

    def _write_metrics(self, values: PlainMetrics, step: int | None) -> None:
        """Append ``{"step": step, "time": now, **values}`` as one line."""
        for reserved in _RESERVED:
            if reserved in values:
                fail_value(
                    "JSONLTracker.log", "every metric name", reserved, *_NOT_RESERVED
                )
        self._write({"step": step, "time": self._clock(), **values})

    def _write_config(self, values: dict[str, ConfigValue]) -> None:
        """Append ``{"config": values, "time": now}`` as one line."""
        self._write({"config": values, "time": self._clock()})

    def _close(self) -> None:
        """Flush and close the file (if it was ever opened)."""
        if self._file is not None:
            self._file.close()
            self._file = None


class CSVTracker(_FileTracker):
    """Append one CSV row per ``log`` to ``path``; columns are fixed once.

    The columns are ``step``, ``time`` and the metric names of the first ``log``, in
    their order, written as the header; when ``path`` already holds a header (a
    resumed run) its columns are used instead. A later ``log`` may leave columns
    empty, but a metric name outside the columns is a ``ValueError`` raised before
    anything is written (log every metric in the first call, or use
    ``JSONLTracker``). ``step=None`` leaves the cell empty.

    The configuration goes to ``config_path`` (``metrics.csv`` →
    ``metrics.config.json``): one JSON object, merged with what that file already
    held, later keys winning, replaced atomically.

    Args:
        path: the CSV file; created with its parent directories on first use.
        main_process_only: whether only the main process writes (the default).
        clock: the wall-time source for ``time``; ``time.time`` by default.
    """

    __slots__ = ("_columns", "_writer")

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        main_process_only: bool = True,
        clock: Clock = time.time,
    ) -> None:
        super().__init__("CSVTracker", "csv", path, main_process_only, clock)
        self._columns: tuple[str, ...] | None = None
        self._writer: csv.DictWriter[str] | None = None

    @property
    def config_path(self) -> Path:
        """The JSON file ``store_init_configuration`` writes."""
        return self._path.with_suffix(".config.json")

    @property
    def columns(self) -> tuple[str, ...] | None:
        """The CSV columns, or ``None`` before the first ``log``."""
        return self._columns

    def _existing_header(self) -> tuple[str, ...] | None:
        try:
            with self._path.open(encoding="utf-8", newline="") as handle:
                header = next(csv.reader(handle), None)
        except FileNotFoundError:
            return None
        except OSError as error:
            msg = (
                f"CSVTracker: cannot open {str(self._path)!r} to read its header: "
                f"{error}; pass a path in a directory this process can write."
            )
            raise OSError(msg) from error
        if not header:
            return None
        if tuple(header[:2]) != _TIME_KEYS:
            where = f"the header of {str(self._path)!r}"
            fail_value("CSVTracker", where, header, *_STEP_TIME)
        return tuple(header)

    def _write_metrics(self, values: PlainMetrics, step: int | None) -> None:
        """Append one row: ``step``, the wall time and ``values`` by column."""
        columns = self._columns
        write_header = False
        if columns is None:
            existing = self._existing_header()
            write_header = existing is None
            columns = (*_TIME_KEYS, *values) if existing is None else existing
        clash = [key for key in values if key in _TIME_KEYS]
        unknown = [key for key in values if key not in columns]
        if clash or unknown:
            what = f"a column of its own (the columns are {list(columns)})"
            fail_value(
                "CSVTracker.log", "every metric", (clash or unknown)[0], what, _FIRST
            )
        if self._writer is None:
            self._file = _open_append("CSVTracker", self._path)
            self._writer = csv.DictWriter(self._file, fieldnames=columns)
            if write_header:
                self._writer.writeheader()
            self._columns = columns
        assert self._file is not None
        self._writer.writerow({"step": step, "time": self._clock(), **values})
        self._file.flush()

    @staticmethod
    def _stored_config(owner: str, target: Path) -> dict[str, object]:
        try:
            text = target.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as error:
            msg = (
                f"{owner}: cannot open {str(target)!r} to read it: {error}; pass a "
                "path in a directory this process can write."
            )
            raise OSError(msg) from error
        try:
            stored = json.loads(text)
        except ValueError:
            stored = None
        if not isinstance(stored, dict):
            fail_value(owner, repr(str(target)), text, "a JSON object", _MOVE_IT)
        return stored

    def _write_config(self, values: dict[str, ConfigValue]) -> None:
        """Merge ``values`` into the JSON object at ``config_path``."""
        owner = "CSVTracker.store_init_configuration"
        target = self.config_path
        merged = self._stored_config(owner, target)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            merged.update(values)
            partial = target.with_name(target.name + ".partial")
            partial.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
            os.replace(partial, target)
        except OSError as error:
            msg = (
                f"{owner}: cannot write {str(target)!r}: {error}; pass a path in a "
                "directory this process can write."
            )
            raise OSError(msg) from error

    def _close(self) -> None:
        """Flush and close the CSV file (if it was ever opened)."""
        if self._file is not None:
            self._file.close()
            self._file = None
            self._writer = None
