"""The tensor leaves of the data a collective moves, with the path of each.

The data is walked by the package's one tree walker (``funcaccel._tree``); a
collective moves tensors only, so any other leaf is a ``TypeError`` that names its
path (``data['x'][0]``, ``data.field``).

>>> import torch
>>> paths, leaves = tensor_leaves({"x": [torch.tensor(1)]}, "f", rows=True)
>>> paths, leaves
(["data['x'][0]"], [tensor([1])])
"""

from __future__ import annotations

from typing import Final

import torch

from funcaccel._checks import fail_type
from funcaccel._tree import flatten
from funcaccel._tree import spec_paths

__all__ = ["is_tensor_tree", "tensor_leaves"]

_FIX: Final = (
    "Convert the leaf with torch.as_tensor, or use gather_object for arbitrary objects."
)


def tensor_leaves(
    data: object, caller: str, *, rows: bool = False
) -> tuple[list[str], list[torch.Tensor]]:
    """Return the leaf paths and leaves; with ``rows``, 0-d leaves as shape ``[1]``.

    Raises:
        TypeError: a leaf is not a tensor (the message names its path).
    """
    spec, leaves = flatten(data)
    paths = spec_paths(spec, "data")
    for path, leaf in zip(paths, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            fail_type(caller, path, leaf, "a tensor (in a list / tuple / dict)", _FIX)
    tensors: list[torch.Tensor] = [
        t.reshape(1) if rows and t.ndim == 0 else t for t in leaves
    ]
    return paths, tensors


def is_tensor_tree(data: object) -> bool:
    """Return whether every leaf of ``data`` is a tensor.

    >>> is_tensor_tree({"a": [torch.ones(1)]}), is_tensor_tree([torch.ones(1), "x"])
    (True, False)
    """
    return all(isinstance(leaf, torch.Tensor) for leaf in flatten(data)[1])
