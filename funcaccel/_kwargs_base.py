"""The base of the option records and the value checks their ``__post_init__`` use.

``funcaccel.kwargs`` re-exports ``KwargsHandler``; the records live in ``kwargs.py``
and, for the profiler, in ``_profile_kwargs.py``, both built on this module.

>>> is_int(True), is_real(2), type_name(None)
(False, True, 'NoneType')
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import ClassVar

__all__ = ["KwargsHandler", "is_bool", "is_int", "is_real", "require_bool", "type_name"]


def is_bool(value: object) -> bool:
    return isinstance(value, bool)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_name(value: object) -> str:
    return type(value).__name__


def require_bool(owner: str, name: str, value: object) -> None:
    if not is_bool(value):
        msg = f"{owner}: {name} must be a bool; got {value!r} ({type_name(value)})."
        raise TypeError(msg)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KwargsHandler:
    """Base of the option records: ``to_kwargs()`` returns the non-default fields."""

    _NOT_FORWARDED: ClassVar[frozenset[str]] = frozenset()

    def to_kwargs(self) -> dict[str, Any]:
        """Return a new dict of the fields whose value differs from its default.

        Fields are listed in declaration order; nothing is read from the
        environment and nothing derived is added. The record is left unchanged.
        """
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            if field.name in self._NOT_FORWARDED:
                continue
            if field.default is not dataclasses.MISSING:
                default: object = field.default
            elif field.default_factory is not dataclasses.MISSING:
                default = field.default_factory()
            else:  # pragma: no cover - every handler field has a default
                default = dataclasses.MISSING
            value = getattr(self, field.name)
            if value != default:
                out[field.name] = value
        return out
