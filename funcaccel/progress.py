"""A progress display shown by the main process only.

``progress(ctx, iterable)`` yields the items of ``iterable`` unchanged on every
rank. On the main process it also shows progress on stderr: a tqdm bar when tqdm is
importable and stderr is a terminal, otherwise (a log file, a pipe, no tqdm) a plain
line every ``every`` items and after the last one. Other ranks print nothing, so a
run on 8 processes shows one bar, not 8. Given ``throughput=``, a function that
returns the latest window's ``Throughput`` (or ``None`` before the first), the
display adds its rates (tokens/s, TFLOP/s per device, MFU) to each line or bar.
"""

from __future__ import annotations

import importlib
import math
import sys
import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sized
from typing import Final
from typing import Protocol
from typing import TypeVar

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._ctx_checks import check_context
from funcaccel.context import DistributedContext
from funcaccel.throughput import Throughput

__all__ = ["progress"]

T = TypeVar("T")

_UNSIZED_EVERY: Final = 100
_LINES_WHEN_SIZED: Final = 10


Rates = Callable[[], Throughput | None]


class _Bar(Protocol):
    def update(self, n: int = 1) -> object: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> object: ...

    def close(self) -> None: ...


class _BarFactory(Protocol):
    def __call__(self, *, total: int | None, desc: str | None) -> _Bar: ...


def _load_tqdm() -> _BarFactory | None:
    """Return ``tqdm.tqdm``, or ``None`` when tqdm cannot be imported."""
    try:
        # import_module keeps mypy from needing tqdm's (absent) type stubs.
        module = importlib.import_module("tqdm")
    except ImportError:
        return None
    factory: _BarFactory = module.tqdm
    return factory


def _stderr_is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty()) if callable(isatty) else False


def _rates(throughput: Rates | None) -> str:
    """The latest window's rates, or "" without one."""
    latest = None if throughput is None else throughput()
    if latest is None:
        return ""
    if not isinstance(latest, Throughput):
        fail_type("progress", "throughput()", latest, "a Throughput or None")
    return latest.describe()


def _bar_items(
    factory: _BarFactory,
    items: Iterable[T],
    total: int | None,
    desc: str | None,
    throughput: Rates | None,
) -> Iterator[T]:
    bar = factory(total=total, desc=desc)
    try:
        for item in items:
            yield item
            rates = _rates(throughput)
            if rates:
                bar.set_postfix_str(rates, refresh=False)
            bar.update(1)
    finally:
        bar.close()


def _line(label: str, done: int, total: int | None, start: float, rates: str) -> str:
    elapsed = time.monotonic() - start
    tail = f", {rates}" if rates else ""
    if total:
        return f"{label}: {done}/{total} ({100 * done / total:.0f}%) in {elapsed:.1f}s{tail}"
    return f"{label}: {done} in {elapsed:.1f}s{tail}"


def _plain_items(
    items: Iterable[T],
    total: int | None,
    desc: str | None,
    every: int,
    throughput: Rates | None,
) -> Iterator[T]:
    label = desc or "progress"
    start = time.monotonic()
    done = 0
    for item in items:
        yield item
        done += 1
        if done % every == 0:
            line = _line(label, done, total, start, _rates(throughput))
            print(line, file=sys.stderr, flush=True)
    if done % every != 0 or done == 0:
        line = _line(label, done, total, start, _rates(throughput))
        print(line, file=sys.stderr, flush=True)


def progress(
    ctx: DistributedContext,
    iterable: Iterable[T],
    *,
    total: int | None = None,
    desc: str | None = None,
    every: int | None = None,
    throughput: Rates | None = None,
) -> Iterator[T]:
    """Yield the items of ``iterable``, showing progress on the main process only.

    With 2 ranks, ``for batch in progress(ctx, loader, desc="train")`` shows one
    bar, from rank 0; rank 1 iterates silently. The bar is tqdm's when tqdm is
    importable and stderr is a terminal; otherwise plain lines. Nothing is printed
    before the first item is requested.

    Args:
        ctx: the distributed context; ``ctx.is_main_process`` decides who shows.
        iterable: what to iterate; consumed once, items passed through unchanged.
        total: the number of items; ``len(iterable)`` when ``None`` and sized.
        desc: the label shown before the count (``"progress"`` in plain lines).
        every: the plain display prints a line every ``every`` items (and after
            the last one); by default about 10 lines when the total is known,
            else every 100 items. tqdm refreshes by time and ignores it.
        throughput: called (on the main process) each time the display is
            updated; the ``Throughput`` it returns is shown after the count
            (``"..., 2,500 tok/s, MFU 41.0%"``), ``None`` shows nothing.

    Returns:
        An iterator over the same items.

    Raises:
        TypeError: ``ctx``, ``iterable``, ``total``, ``desc`` or ``every`` of the
            wrong type; a ``throughput`` that is not callable, or that returns
            something other than a ``Throughput`` or ``None`` (when called).
        ValueError: a negative ``total`` or an ``every`` below 1.
    """
    check_context("progress", ctx)
    if not isinstance(iterable, Iterable):
        fail_type("progress", "iterable", iterable, "iterable")
    if total is not None:
        check_int("progress", "total", total, 0)
    if every is not None:
        check_int("progress", "every", every, 1)
    check_type("progress", "desc", desc, str, optional=True)
    if throughput is not None and not callable(throughput):
        fail_type(
            "progress",
            "throughput",
            throughput,
            "a function returning a Throughput or None",
            "Pass e.g. throughput=lambda: latest.",
        )
    if not ctx.is_main_process:
        return iter(iterable)
    if total is None and isinstance(iterable, Sized):
        total = len(iterable)
    # A bar redrawn with carriage returns is noise in a log file: lines there.
    factory = _load_tqdm() if _stderr_is_terminal() else None
    if factory is not None:
        return _bar_items(factory, iterable, total, desc, throughput)
    if every is None:
        every = (
            max(1, math.ceil(total / _LINES_WHEN_SIZED)) if total else _UNSIZED_EVERY
        )
    return _plain_items(iterable, total, desc, every, throughput)
