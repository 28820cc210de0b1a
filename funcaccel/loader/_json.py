"""The one check a stream's state passes before it goes into a ``LoaderState``.

A ``LoaderState`` is written into a checkpoint's JSON manifest, so a stream's
``state_dict()`` travels in it only as JSON values, copied so that the stream
moving on cannot change a state already handed out.
"""

from __future__ import annotations

import math
from typing import Any

from funcaccel._checks import fail_type

__all__ = ["json_copy"]

_WHAT = "JSON values (str, int, finite float, bool, None, lists, dicts with str keys)"


def json_copy(caller: str, name: str, value: object) -> Any:
    """Return a deep copy of ``value``; ``TypeError`` naming the part that is not JSON.

    >>> json_copy("f", "state", {"shard": 1, "seen": [2, None]})
    {'shard': 1, 'seen': [2, None]}
    >>> json_copy("f", "state", {"t": (1, 2)})
    Traceback (most recent call last):
    ...
    TypeError: f: state['t'] must be JSON values (str, int, finite float, bool, None, lists, dicts with str keys); got (1, 2) (tuple). Give the dataset a state_dict() of JSON values.
    """
    if value is None or type(value) in (str, bool, int):
        return value
    if type(value) is float and math.isfinite(value):
        return value
    if type(value) is list:
        items: list[Any] = value
        return [json_copy(caller, f"{name}[{i}]", v) for i, v in enumerate(items)]
    if type(value) is dict and all(type(k) is str for k in value):
        pairs: dict[str, Any] = value
        return {k: json_copy(caller, f"{name}[{k!r}]", v) for k, v in pairs.items()}
    hint = "Give the dataset a state_dict() of JSON values."
    fail_type(caller, name, value, _WHAT, hint)
