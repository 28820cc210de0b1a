"""``KwargsHandler``, the base of the option records.

``funcaccel.kwargs`` re-exports it; the records live in ``_handlers.py`` and, for
the profiler, in ``_profile.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any
from typing import ClassVar

from funcaccel._checks import check_bool

__all__ = ["KwargsHandler", "check_flags"]


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


def check_flags(owner: str, record: object, names: Iterable[str]) -> None:
    """Check that each field of ``record`` named in ``names`` is a bool."""
    for name in names:
        check_bool(owner, name, getattr(record, name))
