"""Tests for ``funcaccel._tree``: the one walker behind placement, dispatch and collectives."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections import OrderedDict
from collections import UserDict
from collections import defaultdict
from typing import Any
from typing import NamedTuple

import torch
from hypothesis import given
from hypothesis import strategies as st

from funcaccel import DistributedContext
from funcaccel import gather
from funcaccel import send_to_device
from funcaccel._tree import flatten
from funcaccel._tree import is_node
from funcaccel._tree import leaf_paths
from funcaccel._tree import rebuild
from funcaccel._tree import tree_map
from funcaccel._tree import unflatten


class Pair(NamedTuple):
    first: Any
    second: Any


@dataclasses.dataclass(frozen=True)
class Record:
    a: Any
    b: Any = None


class Seen:
    """A leaf (not a container) marking that ``tree_map`` visited a leaf."""

    def __init__(self, leaf: Any) -> None:
        self.leaf = leaf

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Seen) and other.leaf == self.leaf

    __hash__ = None  # type: ignore[assignment]


class Tagged(dict[str, Any]):
    """A dict subclass with an attribute a constructor would not restore."""

    tag = "class"


def _defaultdict(pairs: dict[str, Any]) -> defaultdict[str, Any]:
    out: defaultdict[str, Any] = defaultdict(list)
    out.update(pairs)
    return out


leaves = st.one_of(st.integers(), st.text(max_size=3), st.none())
keys = st.text(max_size=2)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(keys, children, max_size=3).map(OrderedDict),
        st.dictionaries(keys, children, max_size=3).map(_defaultdict),
        st.tuples(children, children).map(lambda t: Pair(*t)),
        st.tuples(children, children).map(lambda t: Record(*t)),
    ),
    max_leaves=12,
)


def _same_types(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` have the same containers, types and factories throughout."""
    if type(a) is not type(b):
        return False
    if isinstance(a, defaultdict) and a.default_factory is not b.default_factory:
        return False
    if is_node(a):
        _, left = flatten(a)
        _, right = flatten(b)
        children_a = (
            list(a.values())
            if isinstance(a, dict)
            else (
                [getattr(a, f.name) for f in dataclasses.fields(a)]
                if dataclasses.is_dataclass(a)
                else list(a)
            )
        )
        children_b = (
            list(b.values())
            if isinstance(b, dict)
            else (
                [getattr(b, f.name) for f in dataclasses.fields(b)]
                if dataclasses.is_dataclass(b)
                else list(b)
            )
        )
        return len(left) == len(right) and all(
            _same_types(x, y) for x, y in zip(children_a, children_b, strict=True)
        )
    return True


@given(trees)
def test_unflatten_of_flatten_rebuilds_the_same_tree(tree: Any) -> None:
    spec, flat = flatten(tree)
    rebuilt = unflatten(spec, flat)
    assert rebuilt == tree and _same_types(rebuilt, tree)
    assert flatten(rebuilt)[0] == spec
    assert pickle.loads(pickle.dumps(spec)) == spec  # ranks send specs


@given(trees)
def test_tree_map_and_rebuild_keep_structure_and_leave_the_input_alone(
    tree: Any,
) -> None:
    before = copy.deepcopy(tree)
    mapped = tree_map(lambda leaf: Seen(leaf), tree)
    assert tree == before
    assert (
        unflatten(flatten(tree)[0], [Seen(leaf) for leaf in flatten(tree)[1]]) == mapped
    )
    assert _same_types(rebuild(tree, flatten(tree)[1]), tree)
    assert len(leaf_paths(tree, "batch")) == len(flatten(tree)[1])


def test_leaf_paths_say_how_to_reach_each_leaf() -> None:
    tree = {"x": [1, Pair(2, Record(a=3))], "y": (4,)}
    assert leaf_paths(tree, "batch") == [
        "batch['x'][0]",
        "batch['x'][1].first",
        "batch['x'][1].second.a",
        "batch['x'][1].second.b",
        "batch['y'][0]",
    ]


def test_rebuild_keeps_defaultdict_factory_and_subclass_attributes() -> None:
    dd: defaultdict[str, list[int]] = defaultdict(list, {"a": [1]})
    tagged = Tagged(k=1)
    tagged.tag = "instance"
    tree: dict[str, Any] = {"dd": dd, "t": tagged}
    out = rebuild(tree, [2, 3])
    assert isinstance(out["dd"], defaultdict)
    assert out["dd"] == {"a": [2]} and out["dd"].default_factory is list
    assert out["dd"] is not dd and dd["a"] == [1]
    assert (
        type(out["t"]) is Tagged and out["t"]["k"] == 3 and out["t"].tag == "instance"
    )


def test_other_mappings_are_nodes_and_other_objects_are_leaves() -> None:
    batch = UserDict({"ids": torch.ones(2)})
    spec, flat = flatten(batch)
    assert spec.kind == "mapping" and len(flat) == 1
    rebuilt = unflatten(spec, [torch.zeros(2)])
    assert type(rebuilt) is UserDict and torch.equal(rebuilt["ids"], torch.zeros(2))
    assert not is_node(torch.ones(1)) and not is_node("ab") and not is_node(object())


def test_placement_and_gather_treat_a_defaultdict_batch_alike() -> None:
    batch = _defaultdict({"x": torch.arange(3), "inner": OrderedDict(y=torch.ones(2))})
    moved = send_to_device(batch, "cpu")
    gathered = gather(DistributedContext(), batch)
    for out in (moved, gathered):
        assert type(out) is defaultdict and out.default_factory is list
        assert type(out["inner"]) is OrderedDict
        assert torch.equal(out["x"], torch.arange(3))
    assert moved is not batch and moved["inner"] is not batch["inner"]
