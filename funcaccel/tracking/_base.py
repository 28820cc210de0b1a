"""``TrackerBase``: what every built-in tracker shares, so a backend only writes.

The base owns the tracker's ``name``, ``main_process_only`` and ``finished``
state, and wraps the backend's writing in the checks every tracker makes: a
finished tracker refuses more records, ``step`` is an int >= 0 or ``None``, and
values are normalised (``normalize_metrics`` / ``normalize_config``) before the
backend sees them. ``tracker_path`` and ``require_package`` are the shared
argument checks of the file-backed and the optional-package trackers.
"""

from __future__ import annotations

import abc
import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypeAlias

from funcaccel._checks import check_bool
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import type_name
from funcaccel.tracking._values import ConfigValue
from funcaccel.tracking._values import check_open
from funcaccel.tracking._values import check_step
from funcaccel.tracking._values import normalize_config
from funcaccel.tracking._values import normalize_metrics

__all__ = ["TrackerBase", "require_package", "tracker_path"]

PlainMetrics: TypeAlias = dict[str, bool | int | float | str]


class TrackerBase(abc.ABC):
    """A base for trackers: the checks and the finished state, around your writing.

    A subclass calls ``super().__init__(name=..., main_process_only=...)`` and
    implements ``_write_metrics(values, step)``, ``_write_config(values)`` and,
    when it holds a file or a connection, ``_close()``. The ``Tracker`` methods
    call them after the shared checks (a finished tracker refuses records,
    ``step`` is checked, values are normalised), so the backend sees plain values
    only; ``finish()`` calls ``_close()`` once. Build nothing in ``__init__`` that
    touches the disk or the network. More: docs/tracking.md#a-tracker-of-your-own.

    >>> class ListTracker(TrackerBase):
    ...     def __init__(self) -> None:
    ...         super().__init__(name="list", main_process_only=True)
    ...         self.rows: list[tuple[int | None, dict[str, object]]] = []
    ...     def _write_metrics(self, values, step):
    ...         self.rows.append((step, values))
    ...     def _write_config(self, values):
    ...         pass
    >>> tracker = ListTracker()
    >>> tracker.log({"loss": 0.5}, step=2)
    >>> tracker.finish()
    >>> tracker.rows, tracker.finished
    ([(2, {'loss': 0.5})], True)

    Args:
        name: the tracker's short name, for messages (such as ``"jsonl"``).
        main_process_only: whether only the main process calls this tracker.

    Raises:
        TypeError: ``name`` is not a str or ``main_process_only`` not a bool.
        ValueError: ``name`` is empty.
    """

    __slots__ = ("_finished", "_main_process_only", "_name")

    def __init__(self, *, name: str, main_process_only: bool) -> None:
        owner = type_name(self)
        check_name(owner, "name", name, "memory")
        check_bool(owner, "main_process_only", main_process_only)
        self._name = name
        self._main_process_only = main_process_only
        self._finished = False

    @property
    def name(self) -> str:
        """The tracker's short name, for messages."""
        return self._name

    @property
    def main_process_only(self) -> bool:
        """Whether only the main process calls this tracker."""
        return self._main_process_only

    @property
    def finished(self) -> bool:
        """Whether ``finish()`` was called."""
        return self._finished

    def log(self, values: Mapping[str, object], step: int | None = None) -> None:
        """Check ``step`` and ``values``, then write the normalised values at ``step``.

        Raises:
            ValueError: the tracker was finished, a negative ``step``, or a tensor
                with other than one element.
            TypeError: ``step``, a key or a value of the wrong type.
        """
        owner = type_name(self)
        check_open(owner, "log", self._finished)
        check_step(f"{owner}.log", step)
        self._write_metrics(normalize_metrics(values, caller=f"{owner}.log"), step)

    def store_init_configuration(self, values: Mapping[str, object]) -> None:
        """Check ``values``, then write the normalised configuration.

        Raises:
            ValueError: the tracker was finished, or a tensor with other than one
                element.
            TypeError: a key or a value of the wrong type.
        """
        owner = type_name(self)
        method = "store_init_configuration"
        check_open(owner, method, self._finished)
        config = normalize_config(values, caller=f"{owner}.{method}")
        self._write_config(config)

    def finish(self) -> None:
        """Close what the tracker holds (once) and refuse further records."""
        if not self._finished:
            # Marked first, so that a close that raises still refuses further
            # records rather than writing into a half-closed backend.
            self._finished = True
            self._close()

    @abc.abstractmethod
    def _write_metrics(self, values: PlainMetrics, step: int | None) -> None:
        """Write one set of plain metric values (a new dict the backend may keep)."""

    @abc.abstractmethod
    def _write_config(self, values: dict[str, ConfigValue]) -> None:
        """Write the plain configuration values (a new dict the backend may keep)."""

    def _close(self) -> None:
        """Release what the backend holds; called once, by the first ``finish()``."""
        return  # a backend that holds nothing has nothing to release


def tracker_path(owner: str, name: str, value: object) -> Path:
    """Return ``value`` as a ``Path``: a non-empty str or ``os.PathLike`` of str.

    Raises:
        TypeError: ``value`` is not a str or ``os.PathLike``.
        ValueError: ``value`` is empty.
    """
    what = "a str or os.PathLike"
    text = os.fspath(check_type(owner, name, value, (str, os.PathLike), what=what))
    if not isinstance(text, str):
        hint = "It is a path of bytes; pass it as a str."
        fail_type(owner, name, value, "a str or os.PathLike of str", hint)
    if not text:
        fail_value(owner, name, value, "non-empty", "Pass a path such as 'runs/exp1'.")
    return Path(text)


def check_name(owner: str, name: str, value: object, example: str) -> str:
    """Return ``value`` if it is a non-empty str; ``example`` is shown as the fix.

    Raises:
        TypeError: ``value`` is not a str.
        ValueError: ``value`` is empty.
    """
    text = check_type(owner, name, value, str, hint=f"Pass e.g. {example!r}.")
    if not text:
        fail_value(owner, name, text, "non-empty", f"Pass e.g. {example!r}.")
    return text


def require_package(owner: str, package: str, extra: str) -> None:
    """Raise ``ImportError`` naming ``owner`` and the pip extra if ``package`` is missing.

    Nothing is imported: the check only looks ``package`` up on the import path.
    """
    if importlib.util.find_spec(package) is None:
        msg = (
            f"{owner}: the {package} package is not installed; install it with "
            f"`pip install 'funcaccel[{extra}]'` (or `pip install {package}`)."
        )
        raise ImportError(msg)
