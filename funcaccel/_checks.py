"""The argument checks every package shares: a leaf that imports nothing from funcaccel.

Each check takes the public function's name (``caller``) for its message and raises
the ``TypeError`` or ``ValueError`` that function documents; nothing here changes
its inputs. ``summary`` gives the bounded description of a value that every error
message shows, so that a message never dumps a whole batch.

>>> is_int(True), is_real(2), type_name(None)
(False, True, 'NoneType')
>>> check_int("f", "n", 3, 1)
3
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Final
from typing import NoReturn
from typing import TypeVar
from typing import cast

import torch

__all__ = [
    "a_or_an",
    "as_tuple_of",
    "check_bool",
    "check_choice",
    "check_type",
    "fail_on_ranks",
    "fail_type",
    "fail_value",
    "check_duration",
    "check_index",
    "check_int",
    "check_norm",
    "check_scaler",
    "is_bool",
    "is_int",
    "is_real",
    "make_dirs",
    "summary",
    "type_name",
]

T = TypeVar("T")

SUMMARY_LIMIT: Final = 80
"""The most characters ``summary`` keeps of a value's ``repr``."""
_SCALER: Final = ("a torch.amp.GradScaler or None", "Build one with build_grad_scaler.")


def is_bool(value: object) -> bool:
    return isinstance(value, bool)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_name(value: object) -> str:
    return type(value).__name__


def summary(value: object, limit: int = SUMMARY_LIMIT) -> str:
    """Return a short description of ``value`` for an error message.

    Tensors are described by shape and dtype, containers by their type and length;
    any other ``repr`` longer than ``limit`` characters is cut in the middle.

    >>> summary(torch.zeros(2, 3))
    'tensor(shape=(2, 3), dtype=torch.float32)'
    >>> summary(list(range(1000)))
    'list of 1000 items'
    >>> summary("abc")
    "'abc'"
    """
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    if isinstance(value, (list, tuple, Mapping)) and not _short(value, limit):
        return f"{type_name(value)} of {len(value)} items"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the real error
        return f"<{type_name(value)}>"
    if len(text) <= limit:
        return text
    keep = (limit - 5) // 2
    return f"{text[:keep]} ... {text[-keep:]}"


def _short(
    value: list[object] | tuple[object, ...] | Mapping[object, object], limit: int
) -> bool:
    if len(value) > limit // 2:
        return False
    try:
        return len(repr(value)) <= limit
    except Exception:
        return False


def a_or_an(word: str) -> str:
    """Return ``word`` with its indefinite article, for messages.

    >>> a_or_an("int"), a_or_an("Module")
    ('an int', 'a Module')
    """
    return f"an {word}" if word[:1].lower() in "aeiou" else f"a {word}"


def as_tuple_of(
    value: T | Sequence[T], kind: type[T], *, caller: str, name: str
) -> tuple[T, ...]:
    """Return ``value`` as a non-empty tuple of ``kind``; the input is not changed.

    Args:
        value: one ``kind`` instance or a sequence of them.
        kind: the class every item must be an instance of.
        caller: the public function, for error messages.
        name: the argument's name, for error messages.

    Raises:
        TypeError: ``value`` (or an item) is not a ``kind``.
        ValueError: ``value`` is an empty sequence.

    >>> as_tuple_of(3, int, caller="f", name="x")
    (3,)
    >>> as_tuple_of([1, 2], int, caller="f", name="x")
    (1, 2)
    """
    if isinstance(value, kind):
        return (value,)
    # tuple and list first: cheaper than the Sequence ABC check.
    if isinstance(value, (tuple, list)) or (
        isinstance(value, Sequence) and not isinstance(value, str)
    ):
        items = tuple(value)
        if not items:
            raise ValueError(
                f"{caller}: {name} is an empty sequence; pass at least one {kind.__name__}."
            )
        for item in items:
            if not isinstance(item, kind):
                fail_type(caller, f"every item of {name}", item, a_or_an(kind.__name__))
        return items
    fail_type(caller, name, value, f"{a_or_an(kind.__name__)} or a sequence of them")


def fail_type(
    caller: str, name: str, value: object, what: str, hint: str = ""
) -> NoReturn:
    """Raise the ``TypeError`` every wrong-type check raises.

    The message: ``"{caller}: {name} must be {what}; got {summary} ({type}).{hint}"``,
    with ``hint`` (the fix) after a space when given.

    >>> fail_type("f", "n", "3", "an int", "Pass int(n).")
    Traceback (most recent call last):
    TypeError: f: n must be an int; got '3' (str). Pass int(n).
    """
    _fail(TypeError, caller, name, f"{summary(value)} ({type_name(value)})", what, hint)


def _fail(
    error: type[Exception], caller: str, name: str, got: str, what: str, hint: str
) -> NoReturn:
    """Raise ``error`` with the one message shape of ``fail_type`` and ``fail_value``."""
    fix = f" {hint}" if hint else ""
    raise error(f"{caller}: {name} must be {what}; got {got}.{fix}")


def check_type(
    caller: str,
    name: str,
    value: T | object,
    types: type[T] | tuple[type, ...],
    *,
    what: str | None = None,
    hint: str = "",
    optional: bool = False,
) -> T:
    """Return ``value`` if it is an instance of ``types`` (or ``None`` when ``optional``).

    A bool never passes for an ``int`` or ``float``. ``what`` names the expected
    type in the message (default: the type's name with its article, "or None"
    added when ``optional``); ``hint`` gives the fix. See ``fail_type``.

    >>> check_type("f", "n", 3, int)
    3
    >>> check_type("f", "n", True, int, hint="Pass a count.")
    Traceback (most recent call last):
    TypeError: f: n must be an int; got True (bool). Pass a count.
    """
    if value is None and optional:
        return cast("T", value)  # None is what optional allows
    kinds = types if isinstance(types, tuple) else (types,)
    bool_as_number = isinstance(value, bool) and bool not in kinds
    if isinstance(value, kinds) and not bool_as_number:
        return cast("T", value)  # isinstance has checked it
    if what is None:
        names = " or ".join(kind.__name__ for kind in kinds)
        what = a_or_an(names) + (" or None" if optional else "")
    fail_type(caller, name, value, what, hint)


def check_choice(
    caller: str, name: str, value: T, choices: Sequence[T], *, hint: str = ""
) -> T:
    """Return ``value`` if it is one of ``choices``; raise ``ValueError`` if not.

    >>> check_choice("f", "mode", "max", ("sum", "mean"))
    Traceback (most recent call last):
    ValueError: f: mode must be one of 'sum', 'mean'; got 'max'.
    """
    if value in choices and type(value) in {type(choice) for choice in choices}:
        return value
    listed = ", ".join(repr(choice) for choice in choices)
    fail_value(caller, name, value, f"one of {listed}", hint)


def check_bool(caller: str, name: str, value: object) -> bool:
    """Return ``value`` if it is a bool; raise ``TypeError`` naming ``caller`` if not."""
    if type(value) is not bool:
        fail_type(caller, name, value, "a bool")
    return value


def check_int(caller: str, name: str, value: object, minimum: int) -> int:
    """Return ``value`` if it is an int (not a bool) of at least ``minimum``."""
    if not is_int(value):
        fail_type(caller, name, value, "an int", f"Pass an int >= {minimum}.")
    assert isinstance(value, int)
    if value < minimum:
        msg = f"{caller}: {name} ({value}) must be >= {minimum}; pass a larger value."
        raise ValueError(msg)
    return value


def check_index(
    caller: str, name: str, value: int, size_name: str, size: int, hint: str = ""
) -> int:
    """Return ``value`` if ``0 <= value < size``: a rank or position in a range.

    The message: ``"{caller}: {name} ({value}) must be in [0, {size_name}={size})"``,
    then ``"; {hint}"`` when a hint is given, else ``"."``.

    >>> check_index("f", "rank", 2, "world_size", 2, "pass a rank below 2.")
    Traceback (most recent call last):
    ValueError: f: rank (2) must be in [0, world_size=2); pass a rank below 2.
    """
    if not 0 <= value < size:
        fix = f"; {hint}" if hint else "."
        msg = f"{caller}: {name} ({value}) must be in [0, {size_name}={size}){fix}"
        raise ValueError(msg)
    return value


def check_duration(caller: str, name: str, value: object) -> timedelta | None:
    """Return ``value`` as a positive ``timedelta``: one, a number of seconds, or None.

    >>> check_duration("f", "timeout", 2.5), check_duration("f", "timeout", None)
    (datetime.timedelta(seconds=2, microseconds=500000), None)
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        duration = value
    elif is_real(value):
        assert isinstance(value, (int, float))
        try:
            duration = timedelta(seconds=value)
        except (OverflowError, ValueError):  # inf, nan, > 10**9 days
            what, hint = "a finite number of seconds", "Pass None to turn it off."
            fail_value(caller, name, value, what, hint)
    else:
        what = "a datetime.timedelta, a number of seconds or None"
        fail_type(caller, name, value, what)
    if duration <= timedelta(0):
        fail_value(caller, name, value, "positive", "Use e.g. 60 (seconds).")
    return duration


def check_norm(caller: str, name: str, value: object) -> None:
    """Check that ``value`` is a real number above 0 (a clipping norm or value)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        fail_type(caller, name, value, "a number")
    if math.isnan(float(value)) or value <= 0:
        fail_value(caller, name, value, "> 0", "Use e.g. 1.0.")


def check_scaler(caller: str, scaler: object) -> None:
    """Check that ``scaler`` is a ``torch.amp.GradScaler``."""
    if not isinstance(scaler, torch.amp.GradScaler):
        fail_type(caller, "scaler", scaler, *_SCALER)


def fail_value(
    caller: str, name: str, value: object, what: str, hint: str = ""
) -> NoReturn:
    """Raise the ``ValueError`` of a value out of range: ``fail_type``'s shape, no type.

    The message: ``"{caller}: {name} must be {what}; got {summary}.{hint}"``, with
    ``hint`` (the fix) after a space when given; ``check_choice`` uses the same shape.

    >>> fail_value("f", "rate", 1.5, "in (0, 1)", "Use e.g. 0.5.")
    Traceback (most recent call last):
    ValueError: f: rate must be in (0, 1); got 1.5. Use e.g. 0.5.
    """
    _fail(ValueError, caller, name, summary(value), what, hint)


def fail_on_ranks(caller: str, what: str, ranks: Sequence[int]) -> NoReturn:
    """Raise the ``RuntimeError`` of a rank that stops because others failed.

    Ranks exchange whether they failed before any of them raises, so that none is
    left waiting in a collective; a rank that did not fail itself raises this.

    >>> fail_on_ranks("f", "the body raised", [1])
    Traceback (most recent call last):
    RuntimeError: f: the body raised on rank(s) [1]; this rank stops too. See those ranks' tracebacks for the cause.
    """
    msg = (
        f"{caller}: {what} on rank(s) {list(ranks)}; this rank stops too. See those "
        "ranks' tracebacks for the cause."
    )
    raise RuntimeError(msg)


def make_dirs(caller: str, what: str, directory: Path) -> None:
    """Create ``directory`` and its parents, as an argument of ``caller`` names it.

    Raises:
        OSError: the directory cannot be created; the message names ``caller``,
            ``what`` (the argument, such as ``"output_trace_dir"``) and the path.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        msg = (
            f"{caller}: cannot create {what} {str(directory)!r}: {error}; pass a "
            "directory this process can create and write."
        )
        raise OSError(msg) from error
