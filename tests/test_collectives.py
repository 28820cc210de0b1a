"""Collectives: one-process identities and errors here; real gloo ranks below.

The distributed checks run in one worker per world size (``_scenarios``), which
records every result and every expected error, so each world size costs one spawn.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections import OrderedDict
from collections import defaultdict
from collections.abc import Callable
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset

from funcaccel.collectives import broadcast
from funcaccel.collectives import broadcast_object
from funcaccel.collectives import gather
from funcaccel.collectives import gather_for_metrics
from funcaccel.collectives import gather_object
from funcaccel.collectives import pad_across_processes
from funcaccel.collectives import pad_tensor
from funcaccel.collectives import reduce
from funcaccel.context import DistributedContext
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

ONE = DistributedContext()


class Pair(NamedTuple):
    x: Any
    y: Any


@dataclasses.dataclass(frozen=True)
class Batch:
    """Stands in for an ``iter_batches`` record: only what gather_for_metrics reads."""

    is_last: bool
    remainder: int


def assert_tree_equal(actual: Any, expected: Any) -> None:
    """Same container types, keys, dtypes and values all the way down."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        assert torch.equal(actual, expected), (actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_tree_equal(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_tree_equal(a, e)
    else:
        assert actual == expected


def nested(scale: int) -> dict[str, Any]:
    """A structure with every container kind funcaccel rebuilds."""
    return {
        "pair": Pair(torch.arange(3.0) * scale, [torch.tensor(scale)]),
        "od": OrderedDict(b=torch.ones(2, 2, dtype=torch.int64) * scale),
        "dd": defaultdict(list, {"c": (torch.tensor([True, False]),)}),
    }


def tensors_of(data: Any) -> list[torch.Tensor]:
    if isinstance(data, torch.Tensor):
        return [data]
    values = data.values() if isinstance(data, dict) else data
    return [t for v in values for t in tensors_of(v)]


# One process: identities, copies and argument errors ------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda d: gather(ONE, d),
        lambda d: broadcast(ONE, d),
        lambda d: pad_across_processes(ONE, d),
        lambda d: gather_for_metrics(ONE, d, batch=Batch(is_last=True, remainder=1)),
    ],
    ids=["gather", "broadcast", "pad", "gather_for_metrics"],
)
@pytest.mark.parametrize("data", [torch.arange(4), [torch.ones(3)], nested(2)])
def test_one_process_returns_the_input_itself(
    call: Callable[[Any], Any], data: Any
) -> None:
    assert call(data) is data


def test_one_process_gather_for_metrics_object_path_returns_the_input() -> None:
    data = ("a", "b", "c")
    assert gather_for_metrics(ONE, data, batch=Batch(is_last=True, remainder=1)) is data
    items = [torch.ones(2)]
    assert gather_for_metrics(ONE, items, use_gather_object=True) is items


@pytest.mark.parametrize("reduction", ["sum", "mean", "max"])
def test_one_process_reduce_returns_an_equal_copy(reduction: Any) -> None:
    data = nested(3)
    data["dd"] = {"c": (torch.tensor([0.5, 1.5]),)}
    data["od"]["b"] = data["od"]["b"].double()
    data["pair"] = Pair(data["pair"].x, [data["pair"].y[0].float()])
    before = copy.deepcopy(data)
    out = reduce(ONE, data, reduction=reduction)
    assert_tree_equal(out, before)
    for new, old in zip(tensors_of(out), tensors_of(data), strict=True):
        assert new.data_ptr() != old.data_ptr()
        new.add_(1)
    assert_tree_equal(data, before)


def test_one_process_reduce_rebuilds_every_container_kind() -> None:
    data = nested(1)
    out = reduce(ONE, data, reduction="sum")
    assert_tree_equal(out, data)
    assert out["dd"].default_factory is list
    assert out is not data and out["pair"] is not data["pair"]


def test_one_process_gather_object_returns_the_items() -> None:
    items = ["a", 1]
    assert gather_object(ONE, items) is items
    assert gather_object(ONE, ("a", 1)) == ["a", 1]
    assert broadcast_object(ONE, {"seed": 7}) == {"seed": 7}


BAD_LEAF = {"a": [torch.ones(1), "oops"]}


@pytest.mark.parametrize(
    "call",
    [
        lambda d: gather(ONE, d),
        lambda d: broadcast(ONE, d),
        lambda d: reduce(ONE, d, reduction="sum"),
        lambda d: pad_across_processes(ONE, d),
    ],
    ids=["gather", "broadcast", "reduce", "pad_across_processes"],
)
def test_non_tensor_leaf_is_a_type_error_naming_its_path(
    call: Callable[[Any], Any],
) -> None:
    pattern = (
        r"^\w+: data\['a'\]\[1\] must be a tensor .*; got 'oops' \(str\)\. Convert"
    )
    with pytest.raises(TypeError, match=pattern):
        call(BAD_LEAF)
    with pytest.raises(TypeError, match=r"data\.y must be a tensor .*; got 3 \(int\)"):
        call(Pair(torch.ones(1), 3))


@pytest.mark.parametrize("reduction", ["min", "SUM", "", 3, None])
def test_reduce_rejects_other_reductions(reduction: Any) -> None:
    with pytest.raises(ValueError, match=rf"^reduce: .*got {reduction!r}"):
        reduce(ONE, torch.ones(2), reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_reduce_mean_of_integers_is_a_type_error(dtype: torch.dtype) -> None:
    data = {"n": torch.ones(2, dtype=dtype)}
    with pytest.raises(TypeError, match=rf"^reduce: .*data\['n'\] of dtype {dtype}"):
        reduce(ONE, data, reduction="mean")
    assert_tree_equal(reduce(ONE, data, reduction="sum"), data)
    assert_tree_equal(reduce(ONE, data), data)  # "sum" by default, as Accelerate
    assert_tree_equal(reduce(ONE, data, reduction="none"), data)


def test_reduce_max_of_complex_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"reduction='max' is undefined"):
        reduce(ONE, torch.ones(2, dtype=torch.complex64), reduction="max")


@pytest.mark.parametrize(
    ("from_process", "error", "pattern"),
    [
        (1, ValueError, r"\(1\) must be in \[0, num_processes=1\)"),
        (-1, ValueError, r"\(-1\)"),
        (True, TypeError, "must be an int"),
        ("0", TypeError, "got '0'"),
    ],
)
def test_broadcast_checks_from_process(
    from_process: Any, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=rf"^broadcast: from_process.*{pattern}"):
        broadcast(ONE, torch.ones(1), from_process=from_process)
    with pytest.raises(error, match=rf"^broadcast_object: from_process.*{pattern}"):
        broadcast_object(ONE, 1, from_process=from_process)


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"dim": -1}, ValueError, r"dim must be >= 0; got -1"),
        ({"dim": 1.0}, TypeError, r"dim must be an int; got 1\.0 \(float\)"),
        ({"dim": True}, TypeError, r"dim must be an int; got True \(bool\)"),
        ({"pad_index": "x"}, TypeError, r"pad_index must be a number; got 'x'"),
        ({"pad_first": 1}, TypeError, r"pad_first must be a bool; got 1 \(int\)"),
        (
            {"pad_index": 0.5, "data": torch.ones(2, dtype=torch.int32)},
            ValueError,
            r"pad_index 0\.5 cannot be stored in a torch\.int32 leaf \(leaf 0, shape \(2,\)\)",
        ),
    ],
)
def test_pad_across_processes_checks_its_options(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    data = kwargs.pop("data", torch.ones(2))
    with pytest.raises(error, match=rf"^pad_across_processes: {pattern}"):
        pad_across_processes(ONE, data, **kwargs)
    # A fractional pad_index suits a floating leaf, and a leaf without dim 1.
    assert pad_across_processes(ONE, torch.ones(2), pad_index=0.5) is not None
    mixed = {"f": torch.ones(2, 2), "i": torch.ones(2, dtype=torch.int32)}
    assert pad_across_processes(ONE, mixed, dim=1, pad_index=0.5) is mixed


@pytest.mark.parametrize(
    ("data", "dim", "shapes", "fix"),
    [
        (
            torch.ones(2, 3),
            5,
            "(2, 3)",
            "pass a dim below 2 (the most dims any leaf has)",
        ),
        (
            torch.ones(2, 3),
            2,
            "(2, 3)",
            "pass a dim below 2 (the most dims any leaf has)",
        ),
        (
            {
                "a": [torch.ones(4), torch.ones(4)],
                "b": Pair(torch.ones(1, 2), torch.ones(3)),
            },
            2,
            "(4,), (1, 2), (3,)",
            "pass a dim below 2 (the most dims any leaf has)",
        ),
        (
            [torch.ones(n, n) for n in range(1, 50)] + [torch.ones(1, 1, 1)],
            3,
            "(1, 1), (2, 2), (3, 3), ...",
            "pass a dim below 3 (the most dims any leaf has)",
        ),
        (
            {"loss": torch.tensor(0.5), "n": torch.tensor(3)},
            0,
            "()",
            "0-d leaves have no dim to pad: reshape them to 1-d first (t.reshape(1))",
        ),
    ],
    ids=["2d-dim5", "2d-dim2", "nested", "many-shapes", "0d"],
)
def test_pad_across_processes_refuses_a_dim_no_leaf_has(
    data: Any, dim: int, shapes: str, fix: str
) -> None:
    before = copy.deepcopy(data)
    with pytest.raises(ValueError) as caught:
        pad_across_processes(ONE, data, dim=dim)
    assert str(caught.value) == (
        f"pad_across_processes: dim ({dim}) is not a dimension of any leaf; got "
        f"leaf shapes {shapes}; {fix}."
    )
    assert_tree_equal(data, before)


def test_pad_across_processes_passes_a_structure_without_leaves() -> None:
    empty: dict[str, list[torch.Tensor]] = {"a": []}
    assert pad_across_processes(ONE, empty, dim=3) is empty


@pytest.mark.parametrize("obj", [{"a": 1}, "ab", 3, torch.ones(2)])
def test_gather_object_needs_a_list_or_tuple(obj: Any) -> None:
    with pytest.raises(
        TypeError, match=r"^gather_object: obj must be a list or tuple.*\[obj\]"
    ):
        gather_object(ONE, obj)


@pytest.mark.parametrize(
    ("data", "kwargs"),
    [({"a": "text"}, {}), (torch.ones(2), {"use_gather_object": True})],
)
def test_gather_for_metrics_object_path_needs_a_list(data: Any, kwargs: Any) -> None:
    with pytest.raises(TypeError, match=r"^gather_for_metrics: data must be a list"):
        gather_for_metrics(ONE, data, **kwargs)


@pytest.mark.parametrize(
    ("batch", "error", "pattern"),
    [
        (object(), TypeError, r"is_last=None, remainder=None"),
        (SimpleNamespace(is_last=1, remainder=2), TypeError, r"is_last=1"),
        (Batch(is_last=True, remainder=True), TypeError, r"remainder=True"),
        (
            Batch(is_last=True, remainder=-2),
            ValueError,
            r"remainder must be >= -1; got -2",
        ),
    ],
)
def test_gather_for_metrics_checks_the_batch(
    batch: Any, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=rf"^gather_for_metrics: .*{pattern}"):
        gather_for_metrics(ONE, torch.ones(2), batch=batch)


@pytest.mark.parametrize(
    "call",
    [
        lambda c: gather(c, torch.ones(1)),
        lambda c: gather_object(c, [1]),
        lambda c: broadcast(c, torch.ones(1)),
        lambda c: broadcast_object(c, 1),
        lambda c: reduce(c, torch.ones(1), reduction="sum"),
        lambda c: pad_across_processes(c, torch.ones(1)),
        lambda c: gather_for_metrics(c, torch.ones(1)),
    ],
)
def test_several_processes_without_a_group_is_a_runtime_error(
    call: Callable[[DistributedContext], Any],
) -> None:
    ctx = rank_ctx(4, 2)
    with pytest.raises(
        RuntimeError, match=r"^\w+: ctx has num_processes=4 but no default"
    ):
        call(ctx)


# pad_tensor: the pure padding arithmetic --------------------------------------------


@pytest.mark.parametrize(
    ("tensor", "size", "kwargs", "expected"),
    [
        (torch.tensor([4]), 3, {}, [4, 0, 0]),
        (torch.tensor([4]), 3, {"pad_first": True}, [0, 0, 4]),
        (torch.tensor([1, 2, 3]), 3, {}, [1, 2, 3]),
        (torch.tensor([[1], [2]]), 2, {"dim": 1, "pad_index": 9}, [[1, 9], [2, 9]]),
        (torch.tensor([0.5]), 2, {"pad_index": -0.25}, [0.5, -0.25]),
        (torch.tensor([True]), 2, {}, [True, False]),
    ],
)
def test_pad_tensor_table(
    tensor: torch.Tensor, size: int, kwargs: dict[str, Any], expected: list[Any]
) -> None:
    out = pad_tensor(tensor, size, **kwargs)
    assert out.dtype == tensor.dtype
    assert out.tolist() == expected


def test_pad_tensor_returns_the_tensor_itself_when_long_enough() -> None:
    tensor = torch.arange(3)
    assert pad_tensor(tensor, 3) is tensor


@pytest.mark.parametrize(
    ("tensor", "size", "kwargs", "error", "pattern"),
    [
        ([1], 2, {}, TypeError, r"must be a torch\.Tensor; got \[1\] \(list\)"),
        (
            torch.ones(2),
            1,
            {},
            ValueError,
            r"size must be >= 2 \(dim 0's size\); got 1\.$",
        ),
        (
            torch.ones(2),
            3,
            {"dim": 1},
            ValueError,
            r"dim \(1\) must be in \[0, tensor\.ndim=1\); pass a dim the tensor's "
            r"shape \(2,\) has\.$",
        ),
        (
            torch.tensor(1.0),
            3,
            {},
            ValueError,
            r"dim \(0\) must be in \[0, tensor\.ndim=0\)",
        ),
        (
            torch.ones(2, dtype=torch.int64),
            3,
            {"pad_index": 0.5},
            ValueError,
            r"0\.5 cannot be stored in a torch\.int64",
        ),
        (
            torch.ones(2),
            3,
            {"pad_index": None},
            TypeError,
            r"pad_index must be a number",
        ),
    ],
)
def test_pad_tensor_errors(
    tensor: Any, size: int, kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=rf"^pad_tensor: .*{pattern}"):
        pad_tensor(tensor, size, **kwargs)


@given(
    shape=st.lists(st.integers(0, 4), min_size=1, max_size=4),
    data=st.data(),
    extra=st.integers(0, 3),
    pad_index=st.integers(-3, 3),
    pad_first=st.booleans(),
    floating=st.booleans(),
)
def test_pad_tensor_matches_numpy_pad(
    shape: list[int],
    data: st.DataObject,
    extra: int,
    pad_index: int,
    pad_first: bool,
    floating: bool,
) -> None:
    dim = data.draw(st.integers(0, len(shape) - 1))
    tensor = torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape)
    tensor = tensor.double() if floating else tensor
    before = tensor.clone()
    width = [(0, 0)] * len(shape)
    width[dim] = (extra, 0) if pad_first else (0, extra)
    expected = np.pad(tensor.numpy(), width, constant_values=pad_index)
    out = pad_tensor(
        tensor, shape[dim] + extra, dim=dim, pad_index=pad_index, pad_first=pad_first
    )
    assert out.dtype == tensor.dtype
    np.testing.assert_array_equal(out.numpy(), expected)
    assert torch.equal(tensor, before)


# Real gloo ranks ----------------------------------------------------------------------

# Per-rank batches from docs/loader.md#semantics-building-a-sharded-loader and
# docs/loader.md#semantics-dispatch-mode (one list per rank), the remainder, and
# the epoch gather_for_metrics must give back: (name, world, batches, remainder, epoch).
METRIC_CASES: list[tuple[str, int, list[list[list[int]]], int, list[int]]] = [
    (
        "map 10,3",
        2,
        [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]],
        4,
        list(range(10)),
    ),
    ("map 9,5", 2, [[[0, 1, 2, 3, 4]], [[5, 6, 7, 8, 0]]], 9, list(range(9))),
    (
        "map 12,3 full",
        2,
        [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 11]]],
        0,
        list(range(12)),
    ),
    ("map 10,3 drop_last", 2, [[[0, 1, 2]], [[3, 4, 5]]], -1, list(range(6))),
    (
        "split 9,4",
        2,
        [[[0, 1], [4, 5], [8, 0]], [[2, 3], [6, 7], [1, 2]]],
        1,
        list(range(9)),
    ),
    (
        "dispatch 10,3",
        2,
        [[[0, 1, 2], [6, 7]], [[3, 4, 5], [8, 9]]],
        4,
        list(range(10)),
    ),
    (
        "dispatch 9,2",
        2,
        [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [0]]],
        1,
        list(range(9)),
    ),
    ("dispatch 5,2 split", 2, [[[0], [2], [4]], [[1], [3], [0]]], 1, list(range(5))),
    (
        "map 10,2",
        3,
        [[[0, 1], [6, 7]], [[2, 3], [8, 9]], [[4, 5], [0, 1]]],
        4,
        list(range(10)),
    ),
    (
        "dispatch 7,2",
        3,
        [[[0, 1], [6]], [[2, 3], [0]], [[4, 5], [1]]],
        1,
        list(range(7)),
    ),
    (
        "dispatch 13,4",
        3,
        [[[0, 1, 2, 3], [12]], [[4, 5, 6, 7], [0]], [[8, 9, 10, 11], [1]]],
        1,
        list(range(13)),
    ),
    ("dispatch 2,1", 3, [[[0]], [[1]], [[0]]], 2, [0, 1]),
    ("dispatch 1,1 degenerate", 3, [[[0]], [[0]], [[]]], 1, [0]),
]


def rank_rows(rank: int) -> torch.Tensor:
    """Rank r's rows for gather: r + 1 rows of 2 values, rank 1 has none at world 3."""
    rows = 0 if rank == 1 else rank + 1
    return torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2) + 100 * rank


def pad_case(case: int, rank: int) -> torch.Tensor:
    """A seeded random tensor per (case, rank) for pad_across_processes."""
    gen = torch.Generator().manual_seed(1000 * case + rank)
    shape = torch.randint(0, 4, (3,), generator=gen).tolist()
    return torch.randint(1, 9, shape, generator=gen)


def _checked(call: Callable[..., Any], data: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``call(data, ...)``; fail if ``data`` changed; return the result or error."""
    before = copy.deepcopy(data)
    try:
        result: Any = call(data, *args, **kwargs)
    except (TypeError, ValueError) as error:
        result = (type(error).__name__, str(error))
    assert_tree_equal(data, before)
    return result


def _scenarios(ctx: DistributedContext, guard: float | None) -> dict[str, Any]:
    ctx = dataclasses.replace(ctx, collective_timeout=guard)
    rank, world = ctx.process_index, ctx.num_processes
    out: dict[str, Any] = {}

    def run(name: str, fn: Callable[..., Any], data: Any, **kwargs: Any) -> None:
        out[name] = _checked(lambda d: fn(ctx, d, **kwargs), data)

    # gather
    run("gather spec", gather, torch.tensor([[1, 2], [3], [4, 5, 6]][rank]))
    run(
        "gather rows",
        gather,
        {"rows": rank_rows(rank), "zero_d": torch.tensor(rank * 1.5)},
    )
    run("gather nested", gather, nested(rank))
    dtypes = [
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.bool,
    ]
    run("gather dtypes", gather, [torch.arange(rank + 1).to(d) for d in dtypes])
    run("gather non-contiguous", gather, torch.arange(12.0).reshape(3, 4).t()[rank:])
    run("gather dim1 mismatch", gather, {"x": torch.ones(2, 3 + rank)})
    run(
        "gather dtype mismatch",
        gather,
        [torch.ones(1, dtype=torch.float64 if rank else torch.float32)],
    )
    run("gather structure mismatch", gather, {f"k{rank}": torch.ones(1)})
    run("gather bad leaf", gather, [torch.ones(1), "x"])
    run("gather after errors", gather, torch.tensor([rank]))
    # gather_object
    run("gather_object spec", gather_object, [["a"], ["b", "c"], []][rank])
    run("gather_object tuple", gather_object, (rank, {"r": rank}))
    run("gather_object dict", gather_object, {"r": rank} if rank == 1 else [rank])
    # broadcast
    for src in range(world):
        run(f"broadcast {src}", broadcast, nested(rank + 1), from_process=src)
        run(
            f"broadcast_object {src}",
            broadcast_object,
            {"from": rank},
            from_process=src,
        )
    src_data = torch.arange(3.0)
    out["broadcast aliasing"] = (
        broadcast(ctx, src_data).data_ptr() != src_data.data_ptr()
    )
    run("broadcast shape mismatch", broadcast, torch.ones(2 + rank))
    run("broadcast out of range", broadcast, torch.ones(1), from_process=world)
    # reduce
    spec = [[1.0, 4.0], [3.0, 2.0], [5.0, -1.0]][rank]
    for reduction in ("sum", "mean", "max"):
        run(
            f"reduce {reduction}",
            reduce,
            {"v": torch.tensor(spec), "s": (torch.tensor(rank * 2.0),)},
            reduction=reduction,
        )
    run("reduce int sum", reduce, torch.tensor([rank, -rank]), reduction="sum")
    run("reduce int max", reduce, torch.tensor([rank, -rank]), reduction="max")
    run("reduce int mean", reduce, torch.tensor([rank]), reduction="mean")
    run("reduce shape mismatch", reduce, torch.ones(1 + rank), reduction="sum")
    run("reduce none", reduce, torch.tensor([rank + 1.0]), reduction="none")
    run("reduce default", reduce, torch.tensor([rank + 1.0]))
    run("reduce unknown", reduce, torch.ones(1), reduction="min")
    # pad_across_processes
    pad_spec = torch.tensor([[1, 2, 3], [4], [5, 6]][rank])
    run("pad spec", pad_across_processes, pad_spec)
    run("pad spec first", pad_across_processes, pad_spec, pad_first=True)
    run(
        "pad dim1",
        pad_across_processes,
        {"a": torch.ones(2, rank + 1), "low": torch.ones(3)},
        dim=1,
        pad_index=-1,
    )
    run(
        "pad mixed ndim",
        pad_across_processes,
        torch.ones([2, 2 + rank] if rank != 1 else [7]),
        dim=1,
    )
    run("pad structure mismatch", pad_across_processes, [torch.ones(1)] * (rank + 1))
    # No leaf on any rank has dim: every rank refuses, after the shape exchange.
    run(
        "pad no leaf has dim",
        pad_across_processes,
        {"a": torch.ones(2, 1 + rank), "b": torch.ones(3)},
        dim=5,
    )
    run(
        "pad no leaf has dim, ndims differ",
        pad_across_processes,
        torch.ones(2) if rank == 0 else torch.tensor(1.0),
        dim=1,
    )
    out["pad after no dim"] = gather(ctx, torch.tensor([rank]))
    # Only the shorter ranks would pad: the longest must refuse as well.
    run(
        "pad fractional int",
        pad_across_processes,
        {"f": torch.ones(2), "i": torch.ones(world - rank, dtype=torch.int64)},
        pad_index=0.5,
    )
    grad = {"w": torch.ones(rank + 1, 2, requires_grad=True)}
    out["grad inputs"] = [
        _checked(lambda d: gather(ctx, d), grad),
        _checked(
            lambda d: reduce(ctx, d, reduction="sum"),
            {"w": torch.ones(2, requires_grad=True)},
        ),
        _checked(lambda d: broadcast(ctx, d), {"w": torch.ones(2, requires_grad=True)}),
    ]
    out["grad pad"] = _checked(lambda d: pad_across_processes(ctx, d), grad)[
        "w"
    ].detach()
    for case in range(12):
        run(
            f"pad random {case}",
            pad_across_processes,
            pad_case(case, rank),
            dim=case % 3,
            pad_index=case - 5,
            pad_first=case % 2 == 1,
        )
    # gather_for_metrics over whole epochs
    for name, case_world, batches, remainder, _ in METRIC_CASES:
        if case_world != world:
            continue
        mine = batches[rank]
        for form in ("tensor", "dict", "objects", "use_gather_object", "batch=None"):
            got: list[Any] = []
            for step, rows in enumerate(mine):
                batch = Batch(is_last=step == len(mine) - 1, remainder=remainder)
                tensor = torch.tensor(rows, dtype=torch.int64)
                if form == "tensor":
                    got += _checked(
                        lambda d, b=batch: gather_for_metrics(ctx, d, batch=b), tensor
                    ).tolist()
                elif form == "dict":
                    res = _checked(
                        lambda d, b=batch: gather_for_metrics(ctx, d, batch=b),
                        {"pred": tensor, "label": Pair(tensor * 10, tensor.float())},
                    )
                    assert torch.equal(res["label"].x, res["pred"] * 10)
                    assert torch.equal(res["label"].y, res["pred"].float())
                    got += res["pred"].tolist()
                elif form == "objects":
                    got += _checked(
                        lambda d, b=batch: gather_for_metrics(ctx, d, batch=b),
                        [f"s{v}" for v in rows],
                    )
                elif form == "use_gather_object":
                    items = _checked(
                        lambda d, b=batch: gather_for_metrics(
                            ctx, d, batch=b, use_gather_object=True
                        ),
                        list(tensor),
                    )
                    got += [int(t) for t in items]
                else:
                    got += gather_for_metrics(ctx, tensor, batch=None).tolist()
            out[f"metrics {name} {form}"] = got
    out["metrics bad object data"] = _checked(
        lambda d: gather_for_metrics(ctx, d, batch=None),
        {"s": "x"} if rank == 0 else ["x"],
    )
    # gather_for_metrics without batch=: refused on every rank, before any exchange
    # (a later collective still works, so nothing was left half-sent).
    for form, data in (("tensor", torch.arange(3)), ("objects", ["a"])):
        out[f"metrics no batch {form}"] = _checked(
            lambda d: gather_for_metrics(ctx, d), data
        )
    out["metrics after no batch"] = gather(ctx, torch.tensor([rank]))
    out["metrics loaders"] = _metrics_over_loaders(ctx)
    return out


class _Stream(IterableDataset[torch.Tensor]):
    """The stream 0..n-1, without ``len()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor(i) for i in range(self.n))


# mode: the batch sizes tried with every n in 0..13. The two default paths (map-style
# data, and dispatch for iterable data) get the whole grid; the others one size.
LOADER_MODES: dict[str, tuple[int, ...]] = {
    "map": (1, 2, 3, 4),
    "dispatch": (1, 2, 3, 4),
    "map split": (3,),
    "iterable": (3,),
    "stream": (3,),
}


def _metrics_over_loaders(ctx: DistributedContext) -> dict[str, list[int]]:
    """Every case of ``LOADER_MODES``: the epoch that gather_for_metrics gives back.

    A fixed grid rather than Hypothesis: every rank must run the same cases in the
    same order, and each case costs a few collectives.
    """
    world = ctx.num_processes
    out: dict[str, list[int]] = {}
    for mode, sizes in LOADER_MODES.items():
        for n in range(14):
            for bs in sizes:
                size = bs * world if mode == "map split" else bs
                data: Any = list(range(n)) if mode.startswith("map") else _Stream(n)
                loader = shard_loader(
                    ctx,
                    DataLoader(data, batch_size=size),
                    split_batches=mode == "map split",
                    dispatch_batches=mode == "dispatch",
                )
                got: list[int] = []
                for batch in iter_batches(loader):
                    got += gather_for_metrics(ctx, batch.data, batch=batch).tolist()
                out[f"{mode} n={n} bs={size}"] = got
    return out


Results = tuple[int, list[dict[str, Any]]]


@pytest.fixture(
    scope="module",
    params=[(2, None), (3, None), (2, 60.0), (3, 60.0)],
    ids=["world2", "world3", "world2-guarded", "world3-guarded"],
)
def dist_results(request: pytest.FixtureRequest) -> Results:
    """Each rank's ``_scenarios`` results, from one run per world size and guard.

    With the guard on (``collective_timeout``) every call, the failing ones
    included, must give exactly what it gives with the guard off.
    """
    world, guard = request.param
    return world, run_ranks(_scenarios, world, guard, start_method="forkserver")


def on_every_rank(results: Results, name: str) -> Any:
    """The value all ranks returned for ``name`` (they must agree)."""
    _, per_rank = results
    first = per_rank[0][name]
    for other in per_rank[1:]:
        assert_tree_equal(other[name], first)
    return first


def cat_ranks(world: int, leaf: Callable[[int], torch.Tensor]) -> torch.Tensor:
    return torch.cat([leaf(r).reshape(-1, *leaf(r).shape[1:]) for r in range(world)])


@pytest.mark.distributed
def test_gather_concatenates_in_rank_order(dist_results: Results) -> None:
    world, _ = dist_results
    spec = on_every_rank(dist_results, "gather spec")
    assert spec.tolist() == [1, 2, 3, 4, 5, 6][: 3 if world == 2 else 6]
    rows = on_every_rank(dist_results, "gather rows")
    assert_tree_equal(rows["rows"], cat_ranks(world, rank_rows))
    assert_tree_equal(rows["zero_d"], torch.tensor([r * 1.5 for r in range(world)]))
    expected_t = torch.arange(12.0).reshape(3, 4).t()
    non_contiguous = on_every_rank(dist_results, "gather non-contiguous")
    assert_tree_equal(non_contiguous, torch.cat([expected_t[r:] for r in range(world)]))


@pytest.mark.distributed
def test_gather_keeps_structure_and_dtypes(dist_results: Results) -> None:
    world, _ = dist_results
    parts = [nested(r) for r in range(world)]
    expected = {
        "pair": Pair(
            cat_ranks(world, lambda r: parts[r]["pair"].x),
            [torch.stack([parts[r]["pair"].y[0] for r in range(world)])],
        ),
        "od": OrderedDict(b=cat_ranks(world, lambda r: parts[r]["od"]["b"])),
        "dd": defaultdict[str, Any](
            list, {"c": (cat_ranks(world, lambda r: parts[r]["dd"]["c"][0]),)}
        ),
    }
    got = on_every_rank(dist_results, "gather nested")
    assert_tree_equal(got, expected)
    assert got["dd"].default_factory is list
    dtypes = on_every_rank(dist_results, "gather dtypes")
    lengths = torch.cat([torch.arange(r + 1) for r in range(world)])
    assert [t.dtype for t in dtypes] == [
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.bool,
    ]
    for tensor in dtypes:
        assert torch.equal(tensor, lengths.to(tensor.dtype))


@pytest.mark.distributed
def test_gather_mismatch_is_a_value_error_on_every_rank(dist_results: Results) -> None:
    world, _ = dist_results
    kind, msg = on_every_rank(dist_results, "gather dim1 mismatch")
    listing = ", ".join(
        f"rank {r}: \\(2, {3 + r}\\) torch.float32" for r in range(world)
    )
    assert kind == "ValueError"
    assert re.match(
        rf"gather: data\['x'\] must have .*every dim but 0 on every rank; got {listing}\.",
        msg,
    )
    kind, msg = on_every_rank(dist_results, "gather dtype mismatch")
    assert (
        kind == "ValueError"
        and "rank 0: (1,) torch.float32, rank 1: (1,) torch.float64" in msg
    )
    kind, msg = on_every_rank(dist_results, "gather structure mismatch")
    assert (
        kind == "ValueError"
        and "different structure" in msg
        and "rank 1: [\"data['k1']\"]" in msg
    )
    kind, msg = on_every_rank(dist_results, "pad structure mismatch")
    assert kind == "ValueError"
    assert msg.startswith("pad_across_processes: data has a different structure")
    kind, msg = on_every_rank(dist_results, "gather bad leaf")
    assert kind == "TypeError"
    assert msg.startswith("gather: data[1] must be a tensor (in a list / tuple / dict)")
    assert on_every_rank(dist_results, "gather after errors").tolist() == list(
        range(world)
    )


@pytest.mark.distributed
def test_gather_object_flattens_in_rank_order(dist_results: Results) -> None:
    world, _ = dist_results
    assert on_every_rank(dist_results, "gather_object spec") == ["a", "b", "c"]
    expected = [item for r in range(world) for item in (r, {"r": r})]
    assert on_every_rank(dist_results, "gather_object tuple") == expected
    kind, msg = on_every_rank(dist_results, "gather_object dict")
    assert kind == "TypeError"
    assert msg.startswith(
        "gather_object: obj must be a list or tuple on every rank; got rank 1: dict"
    )


@pytest.mark.distributed
def test_broadcast_copies_from_the_source_rank(dist_results: Results) -> None:
    world, _ = dist_results
    for src in range(world):
        assert_tree_equal(
            on_every_rank(dist_results, f"broadcast {src}"), nested(src + 1)
        )
        assert on_every_rank(dist_results, f"broadcast_object {src}") == {"from": src}
    assert on_every_rank(dist_results, "broadcast aliasing") is True
    kind, msg = on_every_rank(dist_results, "broadcast shape mismatch")
    assert kind == "ValueError" and msg.startswith(
        "broadcast: data must have the same dtype and the shape"
    )
    assert "rank 0: (2,) torch.float32, rank 1: (3,) torch.float32" in msg
    kind, msg = on_every_rank(dist_results, "broadcast out of range")
    assert (
        kind == "ValueError"
        and f"({world}) must be in [0, num_processes={world})" in msg
    )


# What "reduce {reduction}" must return, written out: rank r gives
# v = [[1, 4], [3, 2], [5, -1]][r] and s = (2r,); with two ranks this is the example
# of docs/collectives.md#semantics-collectives-rank-by-rank.
REDUCED: dict[tuple[int, str], tuple[list[float], float]] = {
    (2, "sum"): ([4.0, 6.0], 2.0),
    (2, "mean"): ([2.0, 3.0], 1.0),
    (2, "max"): ([3.0, 4.0], 2.0),
    (3, "sum"): ([9.0, 5.0], 6.0),
    (3, "mean"): ([3.0, 5.0 / 3.0], 2.0),
    (3, "max"): ([5.0, 4.0], 4.0),
}


@pytest.mark.distributed
@pytest.mark.parametrize("reduction", ["sum", "mean", "max"])
def test_reduce_is_element_wise_over_ranks(
    dist_results: Results, reduction: str
) -> None:
    world, _ = dist_results
    v, s = REDUCED[world, reduction]
    got = on_every_rank(dist_results, f"reduce {reduction}")
    assert_tree_equal(got, {"v": torch.tensor(v), "s": (torch.tensor(s),)})


@pytest.mark.distributed
def test_reduce_integers_and_errors(dist_results: Results) -> None:
    world, _ = dist_results
    total = sum(range(world))
    assert_tree_equal(
        on_every_rank(dist_results, "reduce int sum"), torch.tensor([total, -total])
    )
    assert_tree_equal(
        on_every_rank(dist_results, "reduce int max"), torch.tensor([world - 1, 0])
    )
    kind, msg = on_every_rank(dist_results, "reduce int mean")
    assert kind == "TypeError" and msg.startswith(
        "reduce: reduction='mean' is undefined for data of dtype torch.int64"
    )
    kind, msg = on_every_rank(dist_results, "reduce shape mismatch")
    assert kind == "ValueError" and "rank 1: (2,) torch.float32" in msg
    # Accelerate's default and its "none" are the sum: 1 + 2 (+ 3) on every rank.
    summed = float(world * (world + 1) // 2)
    assert_tree_equal(
        on_every_rank(dist_results, "reduce none"), torch.tensor([summed])
    )
    assert_tree_equal(
        on_every_rank(dist_results, "reduce default"), torch.tensor([summed])
    )
    kind, msg = on_every_rank(dist_results, "reduce unknown")
    assert kind == "ValueError" and "got 'min'" in msg


@pytest.mark.distributed
def test_pad_across_processes_spec_example(dist_results: Results) -> None:
    world, per_rank = dist_results
    longest = 3
    data = [[1, 2, 3], [4], [5, 6]]
    for rank in range(world):
        row = data[rank]
        fill = [0] * (longest - len(row))
        assert per_rank[rank]["pad spec"].tolist() == row + fill
        assert per_rank[rank]["pad spec first"].tolist() == fill + row
    assert per_rank[1]["pad spec"].tolist() == [4, 0, 0]
    assert per_rank[1]["pad spec first"].tolist() == [0, 0, 4]


@pytest.mark.distributed
def test_pad_across_processes_refuses_a_fractional_int_fill_on_every_rank(
    dist_results: Results,
) -> None:
    kind, msg = on_every_rank(dist_results, "pad fractional int")
    assert kind == "ValueError"
    assert msg.startswith("pad_across_processes: pad_index 0.5 cannot be stored")
    assert "(leaf 1," in msg


@pytest.mark.distributed
def test_pad_across_processes_other_dims_and_low_rank_leaves(
    dist_results: Results,
) -> None:
    world, per_rank = dist_results
    for rank in range(world):
        got = per_rank[rank]["pad dim1"]
        expected = torch.full((2, world), -1.0)
        expected[:, : rank + 1] = 1.0
        assert_tree_equal(got, {"a": expected, "low": torch.ones(3)})
        mixed = per_rank[rank]["pad mixed ndim"]
        if rank == 1:
            assert_tree_equal(mixed, torch.ones(7))
        else:
            widest = 2 + (world - 1 if world == 3 else 0)
            expected_mixed = torch.zeros(2, widest)
            expected_mixed[:, : 2 + rank] = 1.0
            assert_tree_equal(mixed, expected_mixed)


@pytest.mark.distributed
def test_pad_across_processes_refuses_a_dim_no_leaf_has_on_every_rank(
    dist_results: Results,
) -> None:
    world, _ = dist_results
    kind, msg = on_every_rank(dist_results, "pad no leaf has dim")
    shapes = "(2, 1), (2, 2), (3,)" if world == 2 else "(2, 1), (2, 2), (2, 3), ..."
    assert (kind, msg) == (
        "ValueError",
        "pad_across_processes: dim (5) is not a dimension of any leaf; got leaf "
        f"shapes {shapes}; pass a dim below 2 (the most dims any leaf has).",
    )
    kind, msg = on_every_rank(dist_results, "pad no leaf has dim, ndims differ")
    assert (kind, msg) == (
        "ValueError",
        "pad_across_processes: dim (1) is not a dimension of any leaf; got leaf "
        "shapes (2,), (); pass a dim below 1 (the most dims any leaf has).",
    )
    # Nothing was left half-sent: the next collective pairs up on every rank.
    assert on_every_rank(dist_results, "pad after no dim").tolist() == list(
        range(world)
    )


@pytest.mark.distributed
def test_tensors_that_require_grad_are_accepted(dist_results: Results) -> None:
    world, per_rank = dist_results
    gathered, summed, broadcast_ = on_every_rank(dist_results, "grad inputs")
    rows = sum(r + 1 for r in range(world))
    assert_tree_equal(gathered, {"w": torch.ones(rows, 2)})
    assert_tree_equal(summed, {"w": torch.full((2,), float(world))})
    assert_tree_equal(broadcast_, {"w": torch.ones(2)})
    for rank in range(world):
        padded = torch.zeros(world, 2)
        padded[: rank + 1] = 1.0
        assert_tree_equal(per_rank[rank]["grad pad"], padded)


@pytest.mark.distributed
def test_pad_across_processes_random_shapes_match_numpy(dist_results: Results) -> None:
    world, per_rank = dist_results
    for case in range(12):
        dim, pad_index, pad_first = case % 3, case - 5, case % 2 == 1
        inputs = [pad_case(case, r) for r in range(world)]
        longest = max(t.shape[dim] for t in inputs)
        for rank, tensor in enumerate(inputs):
            width = [(0, 0)] * 3
            extra = longest - tensor.shape[dim]
            width[dim] = (extra, 0) if pad_first else (0, extra)
            expected = np.pad(tensor.numpy(), width, constant_values=pad_index)
            np.testing.assert_array_equal(
                per_rank[rank][f"pad random {case}"].numpy(), expected
            )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "form", ["tensor", "dict", "objects", "use_gather_object", "batch=None"]
)
def test_gather_for_metrics_drops_the_looped_back_samples(
    dist_results: Results, form: str
) -> None:
    world, _ = dist_results
    cases = [c for c in METRIC_CASES if c[1] == world]
    assert len(cases) >= 5
    for name, _, batches, _, epoch in cases:
        got = on_every_rank(dist_results, f"metrics {name} {form}")
        if form == "objects":
            assert got == [f"s{v}" for v in epoch], name
        elif form == "batch=None":
            steps = range(len(batches[0]))
            untrimmed = [v for i in steps for rank in batches for v in rank[i]]
            assert got == untrimmed, name
        else:
            assert got == epoch, name


@pytest.mark.distributed
def test_gather_for_metrics_spec_last_batch(dist_results: Results) -> None:
    world, _ = dist_results
    if world == 2:
        # map-style n=10, bs=3: last global batch [6, 7, 8, 9, 0, 1] -> [6, 7, 8, 9]
        assert on_every_rank(dist_results, "metrics map 10,3 batch=None")[6:] == [
            6,
            7,
            8,
            9,
            0,
            1,
        ]
        assert on_every_rank(dist_results, "metrics map 10,3 tensor")[6:] == [
            6,
            7,
            8,
            9,
        ]
        assert on_every_rank(dist_results, "metrics dispatch 5,2 split tensor")[4:] == [
            4
        ]
    else:
        assert on_every_rank(dist_results, "metrics dispatch 7,2 tensor")[6:] == [6]
        assert on_every_rank(dist_results, "metrics dispatch 13,4 tensor")[12:] == [12]
    kind, msg = on_every_rank(dist_results, "metrics bad object data")
    assert kind == "TypeError" and msg.startswith(
        "gather_for_metrics: data must be a list or tuple on every rank; got rank 0: dict"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("form", ["tensor", "objects"])
def test_gather_for_metrics_without_batch_is_an_error_on_every_rank(
    dist_results: Results, form: str
) -> None:
    world, _ = dist_results
    outcome = on_every_rank(dist_results, f"metrics no batch {form}")
    assert isinstance(outcome, tuple), f"no error; gathered {outcome!r}"
    kind, msg = outcome
    assert kind == "TypeError"
    assert msg.startswith(
        f"gather_for_metrics: batch= is missing; with num_processes={world} an "
        "evened-out loader repeats samples"
    )
    assert "pass batch=batch (the record, not batch.data)" in msg
    assert "pass batch=None only when data holds no looped-back samples" in msg
    assert on_every_rank(dist_results, "metrics after no batch").tolist() == list(
        range(world)
    )


@pytest.mark.distributed
@pytest.mark.parametrize("mode", list(LOADER_MODES))
def test_gather_for_metrics_counts_every_sample_exactly_once(
    dist_results: Results, mode: str
) -> None:
    """n in 0..13 (bs 1..4): the gathered epoch is 0..n-1, no duplicate, none lost."""
    world, _ = dist_results
    epochs = on_every_rank(dist_results, "metrics loaders")
    cases = {k: v for k, v in epochs.items() if k.startswith(f"{mode} n=")}
    assert len(cases) == 14 * len(LOADER_MODES[mode])
    for name, got in cases.items():
        n = int(name.split("n=")[1].split()[0])
        assert got == list(range(n)), (world, name)
