"""Ordering work between processes: main-first blocks, main-only printing, a logger.

``main_process_first(ctx)`` and ``local_main_process_first(ctx)`` are context
managers that let one process (say, the one that downloads a data set) run a
block before the others; ``print_main`` prints on the main process only;
``get_logger`` returns a ``logging.LoggerAdapter`` whose calls take
``main_process_only=`` and ``in_order=``, as Accelerate's ``MultiProcessAdapter``.
Nothing here adds a logging handler, reads the environment or keeps state.

>>> ctx = DistributedContext()
>>> with main_process_first(ctx):
...     print_main(ctx, "only rank 0 prints this")
only rank 0 prints this
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from collections.abc import Mapping
from types import TracebackType
from typing import IO
from typing import TYPE_CHECKING
from typing import Any
from typing import Final
from typing import TypeAlias

from funcaccel._checks import check_bool
from funcaccel._checks import check_type
from funcaccel._checks import fail_on_ranks
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel._primitives import exchange_codes
from funcaccel.collectives import wait_for_everyone
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group

__all__ = [
    "get_logger",
    "local_main_process_first",
    "main_process_first",
    "print_main",
]

_FAILED: Final = 1
_ExcInfo: TypeAlias = (
    bool
    | tuple[type[BaseException], BaseException, TracebackType | None]
    | tuple[None, None, None]
    | BaseException
    | None
)
_LEVELS: Final = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET")


def _meet(ctx: DistributedContext, caller: str, stage: str, failed: bool) -> None:
    """Exchange whether this rank's body raised; raise on a rank that did not.

    A rank whose own body raised returns here (its caller re-raises its own
    exception); the others raise a ``RuntimeError`` naming the failed ranks, so no
    rank goes on to wait for a rank that has given up.
    """
    codes = exchange_codes(ctx, _FAILED if failed else 0, caller=caller)
    failed_ranks = [rank for rank, code in enumerate(codes) if code == _FAILED]
    if failed_ranks and not failed:
        fail_on_ranks(caller, f"the body raised ({stage})", failed_ranks)


def _first_ctx(
    ctx: DistributedContext, caller: str, *, local: bool
) -> contextlib.AbstractContextManager[None]:
    check_context(caller, ctx)
    require_process_group(ctx, caller)
    first = ctx.is_local_main_process if local else ctx.is_main_process
    return _goes_first(ctx, caller, first)


@contextlib.contextmanager
def _goes_first(ctx: DistributedContext, caller: str, first: bool) -> Iterator[None]:
    if ctx.num_processes == 1:
        yield
        return
    if not first:
        # Waits here until the first ranks have run the body.
        _meet(ctx, caller, "while the first processes ran it", failed=False)
    try:
        yield
    except BaseException:
        if first:
            _meet(ctx, caller, "while the first processes ran it", failed=True)
        else:
            _meet(ctx, caller, "after the first processes ran it", failed=True)
        raise
    if first:
        _meet(ctx, caller, "while the first processes ran it", failed=False)
    _meet(ctx, caller, "after the first processes ran it", failed=False)


def main_process_first(
    ctx: DistributedContext,
) -> contextlib.AbstractContextManager[None]:
    """Return a context manager in which the main process runs the body first.

    Rank 0 runs the body while the other ranks wait; then they run it
    (concurrently); then every rank waits until all have finished, and all leave
    the block together. With one process the body just runs. Every rank must
    enter the block.

    If the body raises on some rank, no rank is left waiting: at the next meeting
    point the ranks exchange who failed. The failed rank re-raises its own
    exception; every other rank raises a ``RuntimeError`` naming the failed ranks.
    So if rank 0's body raises, the other ranks do not run the body at all. (An
    exception is reported this way only when the rank reaches the meeting point;
    a rank that dies or hangs inside the body leaves the others waiting until the
    process group's timeout.)

    Args:
        ctx: the run's context.

    Returns:
        A fresh, unentered context manager.

    Raises:
        TypeError: ``ctx`` is not a ``DistributedContext``.
        RuntimeError: no matching process group with several processes; or, on
            entry or exit of the block, the body raised on another rank.

    Example, with 3 ranks and ``with main_process_first(ctx): ds = load_or_download()``:
    rank 0 downloads and caches; ranks 1 and 2 then load the cached copy; all three
    leave the block once every rank has its data set.

    >>> with main_process_first(DistributedContext()):
    ...     pass
    """
    return _first_ctx(ctx, "main_process_first", local=False)


def local_main_process_first(
    ctx: DistributedContext,
) -> contextlib.AbstractContextManager[None]:
    """Return a context manager in which each machine's local rank 0 runs first.

    As ``main_process_first`` (arguments, result, errors and failure handling),
    with the rank 0 of each machine (``ctx.is_local_main_process``) running the
    body first, while every other rank of the run waits; then the others run it,
    and all leave together.

    Example, with 2 machines of 2 processes (global ranks 0-3, local ranks 0, 1,
    0, 1): ranks 0 and 2 write a per-machine cache; then ranks 1 and 3 read it.

    >>> with local_main_process_first(DistributedContext()):
    ...     pass
    """
    return _first_ctx(ctx, "local_main_process_first", local=True)


def print_main(
    ctx: DistributedContext,
    *args: object,
    sep: str | None = " ",
    end: str | None = "\n",
    file: IO[str] | None = None,
    flush: bool = False,
) -> None:
    """Print ``args`` as ``print`` does, on the main process only.

    The keywords are ``print``'s (named here, so a misspelt one is a type error).
    No communication: other ranks return at once.

    Args:
        ctx: the run's context (only ``is_main_process`` is read).
        *args: what to print.
        sep: as for ``print``.
        end: as for ``print``.
        file: as for ``print`` (``None``: ``sys.stdout``).
        flush: as for ``print``.

    Example, with 2 ranks: ``print_main(ctx, "epoch", 3)`` prints ``epoch 3`` once,
    from rank 0.

    >>> print_main(DistributedContext(), "a", "b", sep="-")
    a-b
    """
    check_context("print_main", ctx)
    if ctx.is_main_process:
        print(*args, sep=sep, end=end, file=file, flush=flush)


if TYPE_CHECKING:
    _Adapter: TypeAlias = logging.LoggerAdapter[logging.Logger]
else:  # LoggerAdapter is subscriptable at runtime only from Python 3.11
    _Adapter = logging.LoggerAdapter


class _RankLoggerAdapter(_Adapter):
    """A ``LoggerAdapter`` that logs on the main process only unless told otherwise.

    Every logging call (``debug`` ... ``critical``, ``exception``, ``log``) takes
    two more keywords: ``main_process_only`` (default True) and ``in_order``
    (default False).
    """

    def __init__(self, logger: logging.Logger, ctx: DistributedContext) -> None:
        super().__init__(logger, {})
        self.ctx: Final = ctx

    def log(
        self,
        level: int,
        msg: object,
        *args: object,
        exc_info: _ExcInfo = None,
        stack_info: bool = False,
        stacklevel: int = 1,
        extra: Mapping[str, object] | None = None,
        **kwargs: object,
    ) -> None:
        """Log ``msg`` at ``level`` on the main process, or on every rank.

        ``main_process_only=False, in_order=True`` logs on rank 0, then rank 1,
        ... with a barrier after each turn; every rank must make that call (the
        barriers run even where ``level`` is disabled, so ranks whose loggers
        differ in level do not hang). ``in_order`` alone does nothing more: only
        the main process logs.
        """
        # Read from **kwargs, where the base class's signature puts them.
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        check_bool("get_logger", "main_process_only", main_process_only)
        check_bool("get_logger", "in_order", in_order)
        # The record names the caller of debug()/info()/..., not this method:
        # logging skips its own frames, and one more level skips this one.
        options: dict[str, Any] = dict(
            kwargs,
            exc_info=exc_info,
            stack_info=stack_info,
            stacklevel=stacklevel + 1,
            extra=extra,
        )
        ctx = self.ctx
        if main_process_only or not in_order or ctx.num_processes == 1:
            if not main_process_only or ctx.is_main_process:
                self._emit(level, msg, args, options)
            return
        require_process_group(ctx, "get_logger")
        for turn in range(ctx.num_processes):
            if turn == ctx.process_index:
                self._emit(level, msg, args, options)
            wait_for_everyone(ctx)

    def _emit(
        self,
        level: int,
        msg: object,
        args: tuple[object, ...],
        options: dict[str, Any],
    ) -> None:
        if self.isEnabledFor(level):
            msg, processed = self.process(msg, options)
            # One more frame between the caller and logging: this one.
            processed["stacklevel"] = processed["stacklevel"] + 1
            self.logger.log(level, msg, *args, **processed)


def get_logger(
    ctx: DistributedContext, name: str, log_level: str | int | None = None
) -> logging.LoggerAdapter[logging.Logger]:
    """Return an adapter over ``logging.getLogger(name)`` that logs per rank.

    Each call of ``.debug`` / ``.info`` / ``.warning`` / ``.error`` /
    ``.critical`` / ``.exception`` / ``.log`` accepts ``main_process_only=True``
    (log on rank 0 only; with ``False``, on every rank that makes the call) and
    ``in_order=False`` (with ``main_process_only=False``: rank 0 logs, then rank 1,
    ..., with a barrier after each, so every rank must make the call). No handler
    is added: configure handlers with ``logging`` as usual.

    Args:
        ctx: the run's context.
        name: the logger's name, as for ``logging.getLogger``.
        log_level: when given, the level set on that named logger (a name such as
            ``"info"``, case-insensitive, or an int). Unlike Accelerate, the root
            logger's level is left alone and no environment variable is read.

    Returns:
        A new adapter; the underlying logger is the process's shared one.

    Raises:
        TypeError: an argument of the wrong type (or, per call, a
            ``main_process_only`` / ``in_order`` that is not a bool).
        ValueError: ``log_level`` is not a level name.

    Example, with 2 ranks: ``log.info("start")`` logs once, from rank 0;
    ``log.info("seen", main_process_only=False)`` logs on both, in any order;
    ``log.info("shard", main_process_only=False, in_order=True)`` logs rank 0's line
    before rank 1's.

    >>> import sys
    >>> log = get_logger(DistributedContext(), "funcaccel.demo", log_level="info")
    >>> log.logger.addHandler(handler := logging.StreamHandler(sys.stdout))
    >>> log.info("hello")
    hello
    >>> log.logger.removeHandler(handler)
    """
    check_context("get_logger", ctx)
    check_type("get_logger", "name", name, str, hint="Pass e.g. __name__.")
    logger = logging.getLogger(name)
    if log_level is not None:
        logger.setLevel(_level(log_level))
    return _RankLoggerAdapter(logger, ctx)


def _level(log_level: object) -> int | str:
    what = "a level name, an int or None"
    hint = "Pass e.g. 'info'."
    level: int | str = check_type(
        "get_logger", "log_level", log_level, (int, str), what=what, hint=hint
    )
    if isinstance(level, int):
        return level
    if level.upper() not in _LEVELS:
        what = f"one of {', '.join(_LEVELS)} (any case)"
        fail_value("get_logger", "log_level", level, what)
    return level.upper()
