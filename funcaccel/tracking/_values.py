"""The values trackers accept and the checks every tracker shares.

``MetricValue`` / ``ConfigValue``, ``normalize_metrics`` / ``normalize_config`` and
the step and finished-tracker checks; ``funcaccel.tracking`` re-exports the public
names.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Final
from typing import TypeAlias

import torch

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import summary
from funcaccel._checks import type_name

__all__ = [
    "ConfigValue",
    "MetricValue",
    "normalize_config",
    "normalize_metrics",
]

MetricValue: TypeAlias = float | int | str
"""A value ``Tracker.log`` accepts.

The rules: docs/tracking.md#semantics-trackers-and-gating.
"""

ConfigValue: TypeAlias = bool | str | float | int | None
"""A value ``Tracker.store_init_configuration`` accepts.

The rules: docs/tracking.md#semantics-trackers-and-gating.
"""

_ONE_NUMBER: Final = (
    "Log a single number, such as tensor.mean(), or one tensor per key."
)
_MSG_FINISHED: Final = (
    "{owner}.{method}: the tracker was finished; build a new {owner} to record more "
    "(a file tracker appends to its file)."
)


def _scalar_from_tensor(
    caller: str, key: str, value: torch.Tensor
) -> bool | int | float:
    if value.numel() != 1:
        fail_value(caller, f"value {key!r}", value, "one number", _ONE_NUMBER)
    item = value.item()
    if isinstance(item, complex):
        fail_type(caller, f"value {key!r}", value, "a real number, not a complex one")
    return item


def _check_key(caller: str, key: object) -> str:
    hint = "Name each value with a string such as 'loss'."
    return check_type(caller, "every key", key, str, hint=hint)


def check_mapping(caller: str, name: str, values: object) -> Mapping[object, object]:
    what = "a mapping such as {'loss': 0.5}"
    return check_type(caller, name, values, Mapping, what=what)


def normalize_metrics(
    values: Mapping[str, object], *, caller: str = "normalize_metrics"
) -> dict[str, bool | int | float | str]:
    """Return a new dict of plain metric values; ``values`` is left unchanged.

    Python and NumPy numbers become ``int``/``float`` (``bool`` stays ``bool``),
    one-element tensors become their ``item()``, strings stay strings.

    Args:
        values: metric names to values.
        caller: the name error messages start with.

    Raises:
        TypeError: ``values`` is not a mapping, a key is not a str, or a value is
            of another type.
        ValueError: a tensor with other than one element.

    >>> normalize_metrics({"loss": torch.tensor([0.5]), "epoch": 2, "tag": "a"})
    {'loss': 0.5, 'epoch': 2, 'tag': 'a'}
    """
    out: dict[str, bool | int | float | str] = {}
    for key, value in check_mapping(caller, "values", values).items():
        name = _check_key(caller, key)
        if isinstance(value, (bool, str)):
            out[name] = value
        elif isinstance(value, torch.Tensor):
            out[name] = _scalar_from_tensor(caller, name, value)
        elif isinstance(value, numbers.Integral):
            out[name] = int(value)
        elif isinstance(value, numbers.Real):
            out[name] = float(value)
        else:
            what = "an int, float, str, bool or one-element tensor"
            fail_type(caller, f"value {name!r}", value, what)
    return out


def normalize_config(
    values: Mapping[str, object], *, caller: str = "normalize_config"
) -> dict[str, ConfigValue]:
    """Return a new dict of plain configuration values; ``values`` is left unchanged.

    Accepts what ``normalize_metrics`` accepts, plus ``None``.

    Raises:
        TypeError: ``values`` is not a mapping, a key is not a str, or a value is
            of another type (convert it, e.g. ``str(betas)``).
        ValueError: a tensor with other than one element.

    >>> normalize_config({"lr": 3e-4, "scheduler": None, "amp": True})
    {'lr': 0.0003, 'scheduler': None, 'amp': True}
    """
    mapping = check_mapping(caller, "values", values)
    out: dict[str, ConfigValue] = {}
    for key, value in mapping.items():
        name = _check_key(caller, key)
        if value is None:
            out[name] = None
            continue
        try:
            out.update(normalize_metrics({name: value}, caller=caller))
        except TypeError:
            msg = (
                f"{caller}: configuration value {name!r} is {summary(value)} "
                f"({type_name(value)}); store a bool, str, int, float or None "
                f"(for example str({name}))."
            )
            raise TypeError(msg) from None
    return out


def check_step(caller: str, step: object) -> None:
    if step is None:
        return
    check_type(caller, "step", step, int, what="an int or None")
    check_int(caller, "step", step, 0)


def check_open(owner: str, method: str, finished: bool) -> None:
    if finished:
        raise ValueError(_MSG_FINISHED.format(owner=owner, method=method))
