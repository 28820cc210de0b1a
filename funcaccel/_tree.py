"""The one walker over nested batches, used by device placement, dispatch and collectives.

A batch is a tree. Its containers (nodes) are, by the same rules everywhere:

- any ``Mapping`` (``dict``, ``OrderedDict``, ``defaultdict``, ``UserDict`` and
  other subclasses), walked in its own key order;
- ``list`` and ``tuple`` (and their subclasses), named tuples by field;
- dataclass instances, by their ``init`` fields.

Everything else is a leaf: tensors, numbers, strings, ``None``, any other object.
What a leaf may be is up to the caller (the collectives and dispatch accept only
tensors and say which leaf is not; placement moves tensors and objects with a
``.to`` method and keeps the rest).

A rebuilt tree has new containers of the original types: a ``defaultdict`` keeps its
``default_factory``, a named tuple or a dataclass its type, a mapping or list
subclass its type and attributes (it is copied, then refilled). ``flatten`` also
returns a ``TreeSpec``, the structure without its leaves, which is a picklable
value that ranks can send and compare; ``unflatten`` builds a tree from it alone.

A leaf's path is how a user reaches it from the root: ``batch['x'][0]``,
``batch.field``.

>>> spec, leaves = flatten({"x": (1, 2), "y": 3})
>>> leaves
[1, 2, 3]
>>> leaf_paths({"x": (1, 2), "y": 3}, "batch")
["batch['x'][0]", "batch['x'][1]", "batch['y']"]
>>> unflatten(spec, [10, 20, 30])
{'x': (10, 20), 'y': 30}
>>> tree_map(lambda v: v * 2, [1, {"a": 2}])
[2, {'a': 4}]
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any
from typing import Final
from typing import Literal
from typing import TypeVar

import torch

__all__ = [
    "TreeSpec",
    "flatten",
    "is_node",
    "leaf_paths",
    "rebuild",
    "spec_paths",
    "tree_map",
    "unflatten",
]

T = TypeVar("T")

NodeKind = Literal["leaf", "mapping", "list", "tuple", "namedtuple", "dataclass"]

# Exact types that are always leaves or always nodes, tested before the slower
# isinstance checks against ABCs: a batch may hold thousands of atoms.
_ATOMS: Final = frozenset(
    {
        int,
        float,
        complex,
        bool,
        str,
        bytes,
        type(None),
        torch.Tensor,
        torch.nn.Parameter,
    }
)
_PLAIN_NODES: Final = frozenset({dict, list, tuple})


@dataclass(frozen=True, slots=True)
class TreeSpec:
    """The container structure of a tree, without its leaves (picklable, comparable).

    ``container`` is the node's type, ``keys`` its mapping keys or dataclass field
    names, ``factory`` a ``defaultdict``'s ``default_factory``.
    """

    kind: NodeKind
    container: type | None = None
    keys: tuple[Any, ...] = ()
    children: tuple[TreeSpec, ...] = ()
    factory: Callable[[], Any] | None = None

    def describe(self) -> str:
        """Say what this structure is, for error messages.

        >>> flatten({"a": 1, "b": [2, 3]})[0].describe()
        "a dict with keys ['a', 'b']"
        """
        name = self.container.__name__ if self.container else ""
        if self.kind == "leaf":
            return "a leaf"
        if self.kind in ("mapping", "dataclass"):
            return f"a {name} with keys {list(self.keys)}"
        return f"a {name} of {len(self.children)}"


_LEAF: Final = TreeSpec("leaf")


def is_node(data: object) -> bool:
    """Return whether ``data`` is a container the walker descends into.

    >>> is_node([1]), is_node((1,)), is_node({"a": 1}), is_node("ab"), is_node(1)
    (True, True, True, False, False)
    """
    kind = type(data)
    if kind in _ATOMS:
        return False
    if kind in _PLAIN_NODES:
        return True
    if isinstance(data, torch.Tensor):  # a tensor subclass
        return False
    return isinstance(data, (Mapping, list, tuple)) or (
        dataclasses.is_dataclass(data) and not isinstance(data, type)
    )


def _children(data: Any) -> tuple[NodeKind, tuple[Any, ...], list[Any]]:
    """Return a node's kind, its keys (or ``()``) and its children, in order."""
    if isinstance(data, Mapping):
        keys = tuple(data.keys())
        return "mapping", keys, [data[key] for key in keys]
    if isinstance(data, tuple):
        fields = getattr(type(data), "_fields", None)
        if fields is not None:
            return "namedtuple", tuple(fields), list(data)
        return "tuple", (), list(data)
    if isinstance(data, list):
        return "list", (), list(data)
    names = tuple(f.name for f in dataclasses.fields(data) if f.init)
    return "dataclass", names, [getattr(data, name) for name in names]


def flatten(data: object) -> tuple[TreeSpec, list[Any]]:
    """Split ``data`` into its structure and its leaves, in walking order."""
    leaves: list[Any] = []
    spec = _flatten(data, leaves)
    return spec, leaves


def _flatten(data: object, leaves: list[Any]) -> TreeSpec:
    if not is_node(data):
        leaves.append(data)
        return _LEAF
    kind, keys, children = _children(data)
    factory = data.default_factory if isinstance(data, defaultdict) else None
    specs = tuple(_flatten(child, leaves) for child in children)
    return TreeSpec(kind, type(data), keys, specs, factory)


def leaf_paths(data: object, root: str) -> list[str]:
    """Return the path of every leaf of ``data``, in ``flatten`` order."""
    return spec_paths(flatten(data)[0], root)


def spec_paths(spec: TreeSpec, root: str) -> list[str]:
    """Return the path of every leaf of a tree of structure ``spec``."""
    paths: list[str] = []
    _paths(spec, root, paths)
    return paths


def _paths(spec: TreeSpec, path: str, out: list[str]) -> None:
    if spec.kind == "leaf":
        out.append(path)
        return
    for position, child in enumerate(spec.children):
        if spec.kind == "mapping":
            step = f"[{spec.keys[position]!r}]"
        elif spec.kind in ("namedtuple", "dataclass"):
            step = f".{spec.keys[position]}"
        else:
            step = f"[{position}]"
        _paths(child, path + step, out)


def unflatten(spec: TreeSpec, leaves: list[Any]) -> Any:
    """Build a tree of ``spec``'s structure holding ``leaves`` (no template needed)."""
    return _unflatten(spec, iter(leaves))


def _unflatten(spec: TreeSpec, leaves: Iterator[Any]) -> Any:
    if spec.kind == "leaf":
        return next(leaves)
    items = [_unflatten(child, leaves) for child in spec.children]
    container: Any = spec.container
    if spec.kind == "mapping":
        pairs = dict(zip(spec.keys, items, strict=True))
        if issubclass(container, defaultdict):
            built = container(spec.factory)
            built.update(pairs)
            return built
        return container(pairs)
    if spec.kind == "namedtuple":
        return container(*items)
    if spec.kind == "dataclass":
        return container(**dict(zip(spec.keys, items, strict=True)))
    return container(items)


def tree_map(fn: Callable[[Any], Any], data: T) -> T:
    """Return ``data`` rebuilt with ``fn`` applied to every leaf; ``data`` is unchanged."""
    mapped: T = _map(fn, data)
    return mapped


def _map(fn: Callable[[Any], Any], data: Any) -> Any:
    # The common containers are tested by exact type first: placement runs this
    # once per batch in the loader's hot path.
    kind = type(data)
    if kind is tuple or kind is list:
        items = [_map(fn, item) if is_node(item) else fn(item) for item in data]
        return items if kind is list else tuple(items)
    if kind is dict:
        return {
            key: _map(fn, value) if is_node(value) else fn(value)
            for key, value in data.items()
        }
    if not is_node(data):
        return fn(data)
    node, keys, children = _children(data)
    return _refill(data, node, keys, [_map(fn, child) for child in children])


def rebuild(data: T, leaves: list[Any]) -> T:
    """Return ``data``'s structure (new containers) holding ``leaves`` in order."""
    it = iter(leaves)
    rebuilt: T = _rebuild(data, it)
    return rebuilt


def _rebuild(data: Any, leaves: Iterator[Any]) -> Any:
    if not is_node(data):
        return next(leaves)
    node, keys, children = _children(data)
    return _refill(data, node, keys, [_rebuild(child, leaves) for child in children])


def _refill(
    template: Any, node: NodeKind, keys: tuple[Any, ...], items: list[Any]
) -> Any:
    """Return a new container like ``template`` holding ``items``."""
    kind: Any = type(template)
    if node == "mapping":
        if kind is dict:
            return dict(zip(keys, items, strict=True))
        if isinstance(template, MutableMapping):
            # A copy keeps what a constructor might not (defaultdict's factory, a
            # subclass's attributes); every key is then replaced.
            new_map = copy.copy(template)
            for key, item in zip(keys, items, strict=True):
                new_map[key] = item
            return new_map
        return kind(dict(zip(keys, items, strict=True)))
    if node == "namedtuple":
        return kind(*items)
    if node == "tuple":
        return tuple(items) if kind is tuple else kind(items)
    if node == "list":
        if kind is list:
            return items
        # A list subclass may take other constructor arguments: copy, then refill.
        new_list = copy.copy(template)
        new_list[:] = items
        return new_list
    return dataclasses.replace(template, **dict(zip(keys, items, strict=True)))
