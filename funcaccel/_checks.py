"""Argument checks that several public modules share, so none imports another's privates.

Each check takes the public function's name for its message and raises the
``TypeError`` or ``ValueError`` that function documents; nothing here changes its
inputs.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import TypeVar

import torch

from funcaccel.context import DistributedContext

__all__ = [
    "as_tuple_of",
]

T = TypeVar("T")


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
            msg = f"{caller}: {name} is an empty sequence; pass at least one {kind.__name__}."
            raise ValueError(msg)
        for item in items:
            if not isinstance(item, kind):
                msg = (
                    f"{caller}: every item of {name} must be {_a(kind.__name__)}; got "
                    f"{item!r} ({type(item).__name__})."
                )
                raise TypeError(msg)
        return items
    msg = (
        f"{caller}: {name} must be {_a(kind.__name__)} or a sequence of them; got "
        f"{value!r} ({type(value).__name__})."
    )
    raise TypeError(msg)


def _a(word: str) -> str:
    """Return ``word`` with its indefinite article, for messages."""
    return f"an {word}" if word[:1].lower() in "aeiou" else f"a {word}"


def _check_ctx(ctx: object, caller: str) -> None:
    if not isinstance(ctx, DistributedContext):
        msg = (
            f"{caller}: ctx must be a DistributedContext; got {type(ctx).__name__}. "
            "Build one with build_context()."
        )
        raise TypeError(msg)


def _check_norm(caller: str, name: str, value: object) -> None:
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        msg = f"{caller}: {name} must be a number; got {value!r} ({type(value).__name__})."
        raise TypeError(msg)
    if math.isnan(float(value)) or value <= 0:
        msg = f"{caller}: {name} must be > 0; got {value!r}. Use e.g. 1.0."
        raise ValueError(msg)


def _check_scaler(scaler: object, caller: str) -> None:
    if not isinstance(scaler, torch.amp.GradScaler):
        msg = (
            f"{caller}: scaler must be a torch.amp.GradScaler or None; got "
            f"{scaler!r} ({type(scaler).__name__}). Build one with build_grad_scaler."
        )
        raise TypeError(msg)


def _check_bool(caller: str, name: str, value: object) -> None:
    if type(value) is not bool:
        msg = (
            f"{caller}: {name} must be a bool; got {value!r} ({type(value).__name__})."
        )
        raise TypeError(msg)
