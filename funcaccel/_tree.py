"""Walk the nested tensors the collectives take: leaf paths, leaves, rebuilt copies.

Data is a tensor or a nested list / tuple / named tuple / mapping of tensors. A leaf's
path is how a user would reach it from ``data`` (``data['x'][0]``, ``data.field``);
any other leaf is a ``TypeError`` naming that path. Rebuilding keeps the structure in
new containers: named tuples and dict subclasses as their own type, a
``defaultdict`` with its factory, other mappings as a ``dict``.

Two other walkers in the package look alike but follow other rules, so they are
kept apart: ``funcaccel._dispatch.flatten`` accepts any leaf, joins paths with
dots and returns a picklable ``TreeSpec`` that ranks compare; ``_placement._send``
keeps non-tensor leaves, moves objects with ``.to`` and rebuilds dataclasses.

>>> paths, leaves = tensor_leaves({"x": [torch.tensor(1)]}, "f", rows=True)
>>> paths, leaves
(["data['x'][0]"], [tensor([1])])
>>> rebuild({"x": [torch.tensor(1)]}, [torch.tensor(2)])
{'x': [tensor(2)]}
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from collections.abc import Mapping
from typing import Any
from typing import TypeVar

import torch

__all__ = ["is_tensor_tree", "rebuild", "tensor_leaves"]

T = TypeVar("T")


def _flatten(data: object, caller: str, path: str = "data") -> list[tuple[str, Any]]:
    """Return ``(path, leaf)`` pairs in a fixed order; raise on a non-tensor leaf."""
    if isinstance(data, torch.Tensor):
        return [(path, data)]
    if isinstance(data, Mapping):
        items = [(f"{path}[{k!r}]", v) for k, v in data.items()]
    elif isinstance(data, tuple) and hasattr(data, "_fields"):
        items = [(f"{path}.{f}", v) for f, v in zip(data._fields, data, strict=True)]
    elif isinstance(data, (list, tuple)):
        items = [(f"{path}[{i}]", v) for i, v in enumerate(data)]
    else:
        msg = f"{caller}: {path} is a {type(data).__name__} ({data!r:.60}); data must be a tensor or a list / tuple / dict of tensors; convert the leaf with torch.as_tensor or use gather_object for arbitrary objects."
        raise TypeError(msg)
    return [pair for p, v in items for pair in _flatten(v, caller, p)]


def tensor_leaves(
    data: object, caller: str, *, rows: bool = False
) -> tuple[list[str], list[torch.Tensor]]:
    """Return the leaf paths and leaves; with ``rows``, 0-d leaves as shape ``[1]``."""
    pairs = _flatten(data, caller)
    leaves = [t.reshape(1) if rows and t.ndim == 0 else t for _, t in pairs]
    return [p for p, _ in pairs], leaves


def _rebuild(data: Any, leaves: Iterator[torch.Tensor]) -> Any:
    """Return ``data``'s structure (new containers) holding the next ``leaves``."""
    if isinstance(data, torch.Tensor):
        return next(leaves)
    if isinstance(data, Mapping):
        pairs = [(k, _rebuild(v, leaves)) for k, v in data.items()]
        if isinstance(data, defaultdict):
            return defaultdict(data.default_factory, pairs)
        return type(data)(pairs) if isinstance(data, dict) else dict(pairs)
    items = [_rebuild(v, leaves) for v in data]
    return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)


def rebuild(data: T, leaves: list[torch.Tensor]) -> T:
    """Return ``data``'s structure holding ``leaves``, in ``tensor_leaves`` order."""
    rebuilt: T = _rebuild(data, iter(leaves))
    return rebuilt


def is_tensor_tree(data: object) -> bool:
    """Return whether every leaf of ``data`` is a tensor."""
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(is_tensor_tree(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(is_tensor_tree(v) for v in data)
    return False
