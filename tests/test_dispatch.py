"""Dispatch mode (docs/loader.md#semantics-dispatch-mode): rank 0 reads, every rank
receives its rows.

Every scenario runs on real gloo processes; to pay for process start-up once per
world size, one worker runs all scenarios of a world size in turn (module-scoped
fixtures), and each test checks one scenario's results.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections import defaultdict
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import pytest
import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset

from funcaccel.context import DistributedContext
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.testing import run_ranks
from tests.fixtures import Indexed
from tests.fixtures import SizedStream
from tests.fixtures import Stream
from tests.fixtures import rank_ctx

# --------------------------------------------------------------------- datasets
# Indexed, Stream and SizedStream come from tests.fixtures.


class Pair(NamedTuple):
    features: torch.Tensor
    labels: torch.Tensor


def make_data(kind: str, n: int) -> Dataset[torch.Tensor]:
    return Indexed(n) if kind == "map" else SizedStream(n)


# ------------------------------------------------------------------- collates


def collate_with_names(items: list[torch.Tensor]) -> dict[str, Any]:
    return {"x": torch.stack(items), "name": [f"s{int(i)}" for i in items]}


def collate_ragged(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    # Base batch 3 (items 6, 7) has length 5, the others 3 (no fixed padding).
    length = 5 if int(items[0]) == 6 else 3
    return {"input_ids": torch.stack(items)[:, None].expand(-1, length)}


def collate_dtypes(items: list[torch.Tensor]) -> torch.Tensor:
    batch = torch.stack(items)  # base batch 3 (items 6, 7) is float, the others int
    return batch.float() if int(items[0]) == 6 else batch


def collate_keys(items: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"a" if int(items[0]) < 2 else "b": torch.stack(items)}


def collate_scalar(items: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(items).sum()


def collate_pair(items: list[torch.Tensor]) -> dict[str, Any]:
    batch = torch.stack(items)
    pair = Pair(batch[:, None].float().expand(-1, 3), batch * 10)
    return {"pair": pair, "ids": [batch]}


def collate_defaultdict(items: list[torch.Tensor]) -> defaultdict[str, Any]:
    batch = torch.stack(items)
    out: defaultdict[str, Any] = defaultdict(list)
    out["x"] = batch
    out["nested"] = OrderedDict(y=batch * 2)
    return out


def _describe_mappings(b: Any) -> dict[str, Any]:
    return {
        "type": type(b).__name__,
        "factory": getattr(b.default_factory, "__name__", None),
        "nested": type(b["nested"]).__name__,
        "x": b["x"].tolist(),
        "y": b["nested"]["y"].tolist(),
    }


def slice_rows(data: torch.Tensor, rows: slice) -> dict[str, Any]:
    return {"x": data[rows].tolist(), "rows": (rows.start, rows.stop)}


# --------------------------------------------------------------- the scenarios

# (n, bs, options): the dispatch cases of docs/loader.md#semantics-dispatch-mode.
TABLE_5: dict[str, tuple[int, int, dict[str, Any]]] = {
    "10-3-2": (10, 3, {}),
    "9-2-2": (9, 2, {}),
    "5-2-2-split": (5, 2, {"split_batches": True}),
    "10-4-2-split": (10, 4, {"split_batches": True}),
    "8-3-2-drop_last": (8, 3, {"drop_last": True}),
    "0-2-2": (0, 2, {}),
    "3-2-2-drop_last": (3, 2, {"drop_last": True}),
    "7-2-3": (7, 2, {}),
    "13-4-3": (13, 4, {}),
    "2-1-3": (2, 1, {}),
    "1-1-3": (1, 1, {}),
}


def _records(loader: Any, state: LoaderState | None = None) -> list[dict[str, Any]]:
    out = []
    for batch in iter_batches(loader, state or LoaderState()):
        data = (
            batch.data.tolist() if isinstance(batch.data, torch.Tensor) else batch.data
        )
        out.append(
            {
                "data": data,
                "index": batch.index,
                "is_last": batch.is_last,
                "remainder": batch.remainder,
                "state": batch.state.to_dict(),
            }
        )
    return out


def _table(ctx: DistributedContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (n, bs, options) in TABLE_5.items():
        if int(name.split("-")[2]) != ctx.num_processes:
            continue
        options = dict(options)
        drop_last = options.pop("drop_last", False)
        for kind in ("map", "iterable"):
            dataloader = DataLoader(
                make_data(kind, n), batch_size=bs, drop_last=drop_last
            )
            loader = shard_loader(ctx, dataloader, dispatch_batches=True, **options)
            out[f"{name}/{kind}"] = {
                "records": _records(loader),
                "plain": [x.tolist() for x in loader],
                "len": len(loader),
                "total": loader.total_batch_size,
            }
    return out


def _attempt(
    ctx: DistributedContext, dataloader: DataLoader[Any], **options: Any
) -> dict[str, Any]:
    """Iterate a dispatching loader; return what arrived before the error, and the error."""
    received: list[Any] = []
    try:
        for batch in iter_batches(
            shard_loader(ctx, dataloader, dispatch_batches=True, **options)
        ):
            received.append(batch.index)
    except Exception as error:  # the test checks the type on every rank
        return {
            "received": received,
            "type": type(error).__name__,
            "message": str(error),
        }
    return {"received": received, "type": None, "message": ""}


def _errors(ctx: DistributedContext) -> dict[str, Any]:
    out: dict[str, Any] = {
        "non-tensor": _attempt(
            ctx, DataLoader(Indexed(8), batch_size=2, collate_fn=collate_with_names)
        ),
        "non-tensor-split": _attempt(
            ctx,
            DataLoader(
                Indexed(8),
                batch_size=2 * ctx.num_processes,
                collate_fn=collate_with_names,
            ),
            split_batches=True,
        ),
        "shapes": _attempt(
            ctx, DataLoader(Indexed(12), batch_size=2, collate_fn=collate_ragged)
        ),
        "dtypes": _attempt(
            ctx, DataLoader(Indexed(12), batch_size=2, collate_fn=collate_dtypes)
        ),
        "keys": _attempt(
            ctx, DataLoader(Indexed(8), batch_size=2, collate_fn=collate_keys)
        ),
        "zero-d": _attempt(
            ctx, DataLoader(Indexed(8), batch_size=2, collate_fn=collate_scalar)
        ),
        "other": _attempt(ctx, DataLoader(Indexed(12, fail_at=9), batch_size=2)),
    }
    # The ranks are still in step: a normal epoch afterwards is whole.
    out["after"] = _records(
        shard_loader(ctx, DataLoader(Indexed(5), batch_size=1), dispatch_batches=True)
    )
    return out


EQUIVALENCE = [
    # n, bs, split, shuffle, kind
    (23, 3, False, True, "map"),
    (24, 4, False, False, "map"),
    (17, 6, True, True, "map"),
    (19, 2, False, False, "iterable"),
    (18, 6, True, False, "iterable"),
]


def _equivalence(ctx: DistributedContext) -> list[dict[str, Any]]:
    out = []
    for n, bs, split, shuffle, kind in EQUIVALENCE:
        runs = {}
        for dispatch in (False, True):
            dataloader = DataLoader(make_data(kind, n), batch_size=bs, shuffle=shuffle)
            loader = shard_loader(
                ctx, dataloader, split_batches=split, dispatch_batches=dispatch, seed=4
            )
            runs[str(dispatch)] = _records(loader)
        out.append(runs)
    return out


RESUME = [
    # kind, n, bs, split, stop (global batches consumed before the resume)
    ("map", 9, 2, False, 1),  # the last global batch needs the skipped first one
    ("map", 13, 2, False, 2),
    ("map", 21, 2, False, 2),
    ("map", 16, 6, True, 1),
    ("iterable", 9, 2, False, 1),
    ("iterable", 15, 6, True, 2),
    ("given", 9, 2, False, 1),  # a user's batch sampler: read once, head kept
    ("given", 21, 3, False, 2),
]


class ListBatches:
    """A user's batch sampler (used as it is): fixed index lists, with batch_size."""

    def __init__(self, n: int, batch_size: int) -> None:
        self.batches = [
            list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)
        ]
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        return iter([list(batch) for batch in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


def _resume_loader(
    ctx: DistributedContext, kind: str, n: int, bs: int, split: bool
) -> tuple[Any, Any]:
    data = make_data("map" if kind == "given" else kind, n)
    if kind == "given":
        dataloader = DataLoader(data, batch_sampler=ListBatches(n, bs))
    else:
        dataloader = DataLoader(data, batch_size=bs)
    return data, shard_loader(
        ctx, dataloader, split_batches=split, dispatch_batches=True
    )


def _resume(ctx: DistributedContext) -> list[dict[str, Any]]:
    out = []
    for kind, n, bs, split, stop in RESUME:
        full = _records(_resume_loader(ctx, kind, n, bs, split)[1])
        data, loader = _resume_loader(ctx, kind, n, bs, split)
        state = LoaderState.from_dict(full[stop - 1]["state"])
        resumed = _records(loader, state)
        fetched = data.fetched if isinstance(data, Indexed) else None
        out.append({"full": full, "resumed": resumed, "fetched": fetched})
    return out


def _structures(ctx: DistributedContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dispatch in (False, True):
        dataloader = DataLoader(Indexed(12), batch_size=2, collate_fn=collate_pair)
        batches = list(shard_loader(ctx, dataloader, dispatch_batches=dispatch))
        out[str(dispatch)] = [
            {
                "type": type(b["pair"]).__name__,
                "features": b["pair"].features.tolist(),
                "labels": b["pair"].labels.tolist(),
                "ids": [t.tolist() for t in b["ids"]],
            }
            for b in batches
        ]
    for dispatch in (False, True):
        dataloader = DataLoader(
            Indexed(12), batch_size=2, collate_fn=collate_defaultdict
        )
        batches = list(shard_loader(ctx, dataloader, dispatch_batches=dispatch))
        out[f"defaultdict-{dispatch}"] = [_describe_mappings(b) for b in batches]
    dataloader = DataLoader(Indexed(5), batch_size=2)
    out["slice_fn"] = list(
        shard_loader(ctx, dataloader, dispatch_batches=True, slice_fn=slice_rows)
    )
    return out


def _everything(ctx: DistributedContext) -> dict[str, Any]:
    return {
        "table": _table(ctx),
        "errors": _errors(ctx),
        "equivalence": _equivalence(ctx),
        "resume": _resume(ctx),
        "structures": _structures(ctx),
    }


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return run_ranks(_everything, 2, start_method="forkserver")


@pytest.fixture(scope="module")
def world3() -> list[dict[str, Any]]:
    return run_ranks(_everything, 3, start_method="forkserver")


@pytest.fixture
def worlds(
    world2: list[dict[str, Any]], world3: list[dict[str, Any]]
) -> dict[int, list[dict[str, Any]]]:
    return {2: world2, 3: world3}


# ------------------------------------------------------- the dispatch table

E: list[list[int]] = []
# name: (batches per rank, remainder of the last, gather_for_metrics of the last, len)
EXPECTED_5: dict[str, tuple[list[list[list[int]]], int | None, list[int], int]] = {
    "10-3-2": ([[[0, 1, 2], [6, 7]], [[3, 4, 5], [8, 9]]], 4, [6, 7, 8, 9], 2),
    "9-2-2": ([[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [0]]], 1, [8], 3),
    "7-2-3": ([[[0, 1], [6]], [[2, 3], [0]], [[4, 5], [1]]], 1, [6], 2),
    "13-4-3": ([[[0, 1, 2, 3], [12]], [[4, 5, 6, 7], [0]], [[8, 9, 10, 11], [1]]], 1, [12], 2),
    "5-2-2-split": ([[[0], [2], [4]], [[1], [3], [0]]], 1, [4], 3),
    "10-4-2-split": ([[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [9]]], 2, [8, 9], 3),
    "8-3-2-drop_last": ([[[0, 1, 2]], [[3, 4, 5]]], 6, [0, 1, 2, 3, 4, 5], 1),
    "2-1-3": ([[[0]], [[1]], [[0]]], 2, [0, 1], 1),
    "1-1-3": ([[[0]], [[0]], [[]]], 1, [0], 1),
    "0-2-2": ([E, E], None, [], 0),
    "3-2-2-drop_last": ([E, E], None, [], 0),
}  # fmt: skip


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("name", list(EXPECTED_5))
def test_dispatch_matches_spec_table(
    worlds: dict[int, list[dict[str, Any]]], name: str, kind: str
) -> None:
    n, bs, options = TABLE_5[name]
    p = int(name.split("-")[2])
    batches, remainder, gathered, length = EXPECTED_5[name]
    results = [rank["table"][f"{name}/{kind}"] for rank in worlds[p]]
    total = bs if options.get("split_batches") else bs * p
    for rank, result in enumerate(results):
        records = result["records"]
        assert [r["data"] for r in records] == batches[rank]
        assert result["plain"] == batches[rank]
        assert [r["index"] for r in records] == list(range(len(records)))
        assert [r["is_last"] for r in records] == [False] * (len(records) - 1) + [
            True
        ] * bool(records)
        assert [r["remainder"] for r in records] == [-1] * (len(records) - 1) + [
            remainder
        ] * bool(records)
        assert (result["len"], result["total"]) == (length, total)
    lasts = [result["records"][-1] for result in results if result["records"]]
    assert [i for last in lasts for i in last["data"]][: remainder or 0] == gathered


def test_dispatch_split_needs_a_multiple_of_the_world() -> None:
    with pytest.raises(
        ValueError, match=r"batch_size \(1\) must be a multiple of num_processes \(2\)"
    ):
        shard_loader(
            rank_ctx(2, 0),
            DataLoader(Indexed(3), batch_size=1),
            split_batches=True,
            dispatch_batches=True,
        )


def test_dispatch_len_needs_a_sized_dataset() -> None:
    loader = shard_loader(rank_ctx(2, 1), DataLoader(Stream(4), batch_size=2))
    assert loader.dispatch_batches and loader.total_batch_size == 4
    with pytest.raises(
        TypeError, match=r"ShardedLoader.__len__: the Stream has no len\(\)"
    ):
        len(loader)


# ------------------------------------------------------------------ errors


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize(
    ("scenario", "error", "received", "pattern"),
    [
        (
            "non-tensor",
            "TypeError",
            [],
            r"dispatch_batches=True can only send tensors, but leaf batch\['name'\]\[0\] of global batch 0 is a str \('s0'\)",
        ),
        (
            "non-tensor-split",
            "TypeError",
            [],
            r"leaf batch\['name'\]\[0\] of global batch 0 is a str",
        ),
        (
            "dtypes",
            "ValueError",
            [0],
            r"cannot concatenate the \d batches of global batch 1: leaf batch has dtypes torch\.\w+ and torch\.\w+; use a collate_fn that returns the same dtype",
        ),
        (
            "keys",
            "ValueError",
            [],
            r"the batches differ in structure: batch 0 is a dict with keys \['a'\] but batch 1 is a dict with keys \['b'\]",
        ),
        (
            "zero-d",
            "ValueError",
            [],
            r"cannot split leaf batch of global batch 0: it is a 0-d tensor",
        ),
    ],
)
def test_dispatch_errors_raise_on_every_rank(
    worlds: dict[int, list[dict[str, Any]]],
    p: int,
    scenario: str,
    error: str,
    received: list[int],
    pattern: str,
) -> None:
    results = [rank["errors"][scenario] for rank in worlds[p]]
    for result in results:
        assert result["type"] == error
        assert result["received"] == received
        assert result["message"].startswith("shard_loader: ")
        assert results[0]["message"] == result["message"]
    assert re.search(pattern, results[0]["message"]), results[0]["message"]


@pytest.mark.distributed
def test_dispatch_shape_mismatch_names_the_leaf_and_shapes_on_every_rank(
    worlds: dict[int, list[dict[str, Any]]],
) -> None:
    expected = (
        "shard_loader: dispatch_batches=True cannot concatenate the 2 batches of global "
        "batch 1: leaf batch['input_ids'] has shapes (2, 3) and (2, 5); use a collate_fn that "
        "pads to a fixed length, split_batches=True or dispatch_batches=False"
    )
    results = [rank["errors"]["shapes"] for rank in worlds[2]]
    assert results == [{"received": [0], "type": "ValueError", "message": expected}] * 2
    three = [rank["errors"]["shapes"] for rank in worlds[3]]
    assert {r["type"] for r in three} == {"ValueError"}
    assert all(r["received"] == [0] for r in three)
    message = expected.replace("the 2 batches", "the 3 batches")
    assert three[0]["message"] == message.replace(
        "(2, 3) and (2, 5)", "(2, 5) and (2, 3)"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3])
def test_dispatch_other_errors_reraise_on_rank0_and_report_elsewhere(
    worlds: dict[int, list[dict[str, Any]]], p: int
) -> None:
    results = [rank["errors"]["other"] for rank in worlds[p]]
    assert results[0]["type"] == "KeyError" and "no sample 9" in results[0]["message"]
    for result in results[1:]:
        assert result["type"] == "RuntimeError"
        assert (
            "shard_loader: rank 0 failed while reading global batch"
            in result["message"]
        )
        assert "KeyError: 'no sample 9'" in result["message"]
    # Batches before the failing one arrived everywhere (index 9 is in batch 4).
    assert all(r["received"] == results[0]["received"] for r in results)
    assert results[0]["received"] == list(range(4 // p))


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3])
def test_ranks_stay_in_step_after_dispatch_errors(
    worlds: dict[int, list[dict[str, Any]]], p: int
) -> None:
    # 5 samples, batch 1: the last global batch is padded from the first.
    expected = {
        2: [[[0], [2], [4]], [[1], [3], [0]]],
        3: [[[0], [3]], [[1], [4]], [[2], [0]]],
    }
    got = [[r["data"] for r in result["errors"]["after"]] for result in worlds[p]]
    assert got == expected[p]


# ------------------------------------------------- dispatch vs non-dispatch


def _real_samples(ranks: list[list[dict[str, Any]]]) -> list[int]:
    out: list[int] = []
    for j in range(max(len(r) for r in ranks)):
        items = [i for r in ranks if j < len(r) for i in r[j]["data"]]
        last = ranks[0][j]
        out += (
            items[: last["remainder"]]
            if last["is_last"] and last["remainder"] > 0
            else items
        )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("case", range(len(EQUIVALENCE)))
def test_dispatch_gives_the_same_samples_as_sharding(
    worlds: dict[int, list[dict[str, Any]]], p: int, case: int
) -> None:
    runs = [rank["equivalence"][case] for rank in worlds[p]]
    sharded, dispatched = [r["False"] for r in runs], [r["True"] for r in runs]
    for a, b in zip(sharded, dispatched, strict=True):
        assert len(a) == len(b)
        assert [r["data"] for r in a[:-1]] == [r["data"] for r in b[:-1]]
        assert [(r["index"], r["is_last"]) for r in a] == [
            (r["index"], r["is_last"]) for r in b
        ]
    n = EQUIVALENCE[case][0]
    assert sorted(_real_samples(sharded)) == list(range(n))
    assert _real_samples(sharded) == _real_samples(dispatched)


# ------------------------------------------------------------------ resume


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("case", range(len(RESUME)))
def test_dispatch_resume_continues_the_uninterrupted_epoch(
    worlds: dict[int, list[dict[str, Any]]], p: int, case: int
) -> None:
    kind, n, bs, split, stop = RESUME[case]
    for result in worlds[p]:
        assert (
            result["resume"][case]["resumed"] == result["resume"][case]["full"][stop:]
        )
    if kind == "iterable":
        return
    fetched = set(worlds[p][0]["resume"][case]["fetched"])
    size = bs if split else bs * p  # G: rows of a global batch
    last_rows = n % size or size
    assert set(range(stop * size, n)) <= fetched  # what is yielded is read
    assert not set(range(size, stop * size)) & fetched  # skipped: never read
    first = set(range(size))  # re-read only to pad the last global batch
    assert (first <= fetched) == (last_rows % p != 0)
    assert first <= fetched or not first & fetched


# -------------------------------------------------------------- structures


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3])
def test_dispatch_rebuilds_nested_batches(
    worlds: dict[int, list[dict[str, Any]]], p: int
) -> None:
    for result in worlds[p]:
        sharded, dispatched = (
            result["structures"]["False"],
            result["structures"]["True"],
        )
        assert all(b["type"] == "Pair" for b in dispatched)
        assert dispatched == sharded  # 12 samples: no padding anywhere


@pytest.mark.distributed
@pytest.mark.parametrize("p", [2, 3])
def test_dispatch_keeps_defaultdict_batches_as_sharding_does(
    worlds: dict[int, list[dict[str, Any]]], p: int
) -> None:
    for result in worlds[p]:
        sharded = result["structures"]["defaultdict-False"]
        dispatched = result["structures"]["defaultdict-True"]
        assert dispatched == sharded
        assert dispatched and all(
            (b["type"], b["factory"], b["nested"])
            == ("defaultdict", "list", "OrderedDict")
            for b in dispatched
        )


@pytest.mark.distributed
def test_dispatch_slice_fn_gets_the_global_batch_and_rows(
    worlds: dict[int, list[dict[str, Any]]],
) -> None:
    rank0, rank1 = (result["structures"]["slice_fn"] for result in worlds[2])
    assert rank0 == [{"x": [0, 1], "rows": (0, 2)}, {"x": [4], "rows": (0, 1)}]
    assert rank1 == [{"x": [2, 3], "rows": (2, 4)}, {"x": [0], "rows": (1, 2)}]
