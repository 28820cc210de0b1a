"""shard_loader, iter_batches and LoaderState.

The rules: docs/loader.md#semantics-building-a-sharded-loader,
docs/loader.md#semantics-resuming-from-a-loaderstate and
docs/loader.md#semantics-epoch-order-and-rng-synchronisation.

Sharding is pure, so most tests build every rank's loader in this process with a
hand-made context; only RNG synchronisation (and a worker-process run) needs real
gloo processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import OrderedDict
from collections import defaultdict
from collections.abc import Iterator
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any
from typing import NamedTuple

import pytest
import torch
from hypothesis import assume
from hypothesis import given
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity
from torch.utils.data import BatchSampler
from torch.utils.data import DataLoader
from torch.utils.data import Dataset
from torch.utils.data import IterableDataset
from torch.utils.data import RandomSampler
from torch.utils.data import Sampler
from torch.utils.data import SequentialSampler
from torch.utils.data import SubsetRandomSampler
from torch.utils.data import TensorDataset
from torch.utils.data import get_worker_info

from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.loader import Batch
from funcaccel.loader import LoaderState
from funcaccel.loader import ShardedLoader
from funcaccel.loader import _indices
from funcaccel.loader import _state
from funcaccel.loader import iter_batches
from funcaccel.loader import send_to_device
from funcaccel.loader import shard_loader
from funcaccel.loader._setup import kept_settings
from funcaccel.testing import run_ranks
from tests.fixtures import Indexed
from tests.fixtures import SizedStream
from tests.fixtures import Stream
from tests.fixtures import rank_ctx

# --------------------------------------------------------------------------- helpers


def make_data(kind: str, n: int) -> Dataset[torch.Tensor]:
    if kind == "map":
        return Indexed(n)
    return SizedStream(n) if kind == "iterable" else Stream(n)


def as_lists(batches: Sequence[Batch]) -> list[list[int]]:
    return [batch.data.tolist() for batch in batches]


def all_ranks(
    p: int, make: Any, state: LoaderState | None = None, **options: Any
) -> list[list[Batch]]:
    """Every rank's records for one epoch; ``make()`` builds a fresh DataLoader."""
    out = []
    for rank in range(p):
        loader = shard_loader(rank_ctx(p, rank), make(), **options)
        out.append(list(iter_batches(loader, state or LoaderState())))
    return out


def seeded_order(n: int, seed: int, **options: Any) -> list[int]:
    """The order torch's own RandomSampler draws with a generator seeded ``seed``."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return list(RandomSampler(range(n), generator=generator, **options))


# ------------- the table of docs/loader.md#semantics-building-a-sharded-loader

F, T = False, True
TABLE_4 = [
    # id, n, bs, p, kind, options, batches per rank, is_last per rank, len, G, remainder
    ("10-3-2-map-even", 10, 3, 2, "map", {}, [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]], [[F, T], [F, T]], [2, 2], 6, 4),
    ("10-3-2-iterable", 10, 3, 2, "iterable", {}, [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]], [[F, T], [F, T]], [2, 2], 6, 4),
    ("10-3-2-map-drop_last", 10, 3, 2, "map", {"drop_last": True}, [[[0, 1, 2]], [[3, 4, 5]]], [[T], [T]], [1, 1], 6, -1),
    ("10-3-2-iterable-drop_last", 10, 3, 2, "iterable", {"drop_last": True}, [[[0, 1, 2]], [[3, 4, 5]]], [[T], [T]], [1, 1], 6, -1),
    ("12-3-2-map-even", 12, 3, 2, "map", {}, [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 11]]], [[F, T], [F, T]], [2, 2], 6, 0),
    ("9-4-2-map-split", 9, 4, 2, "map", {"split_batches": True}, [[[0, 1], [4, 5], [8, 0]], [[2, 3], [6, 7], [1, 2]]], [[F, F, T], [F, F, T]], [3, 3], 4, 1),
    ("9-4-2-iterable-split", 9, 4, 2, "iterable", {"split_batches": True}, [[[0, 1], [4, 5], [8, 0]], [[2, 3], [6, 7], [1, 2]]], [[F, F, T], [F, F, T]], [3, 3], 4, 1),
    ("7-2-3-map-uneven", 7, 2, 3, "map", {"even_batches": False}, [[[0, 1], [6]], [[2, 3]], [[4, 5]]], [[F, T], [T], [T]], [2, 1, 1], 6, 1),
    ("2-3-2-iterable", 2, 3, 2, "iterable", {}, [[[0, 1, 0]], [[1, 0, 1]]], [[T], [T]], [1, 1], 6, 2),
    ("5-2-1-map", 5, 2, 1, "map", {}, [[[0, 1], [2, 3], [4]]], [[F, F, T]], [3], 2, 1),
    ("5-2-1-iterable", 5, 2, 1, "iterable", {}, [[[0, 1], [2, 3], [4]]], [[F, F, T]], [3], 2, 1),
    ("0-2-2-map", 0, 2, 2, "map", {}, [[], []], [[], []], [0, 0], 4, None),
    ("0-2-2-iterable", 0, 2, 2, "iterable", {}, [[], []], [[], []], [0, 0], 4, None),
]  # fmt: skip


@pytest.mark.parametrize(
    (
        "n",
        "bs",
        "p",
        "kind",
        "options",
        "batches",
        "lasts",
        "lengths",
        "total",
        "remainder",
    ),
    [row[1:] for row in TABLE_4],
    ids=[row[0] for row in TABLE_4],
)
def test_shard_loader_matches_spec_table(
    n: int,
    bs: int,
    p: int,
    kind: str,
    options: dict[str, Any],
    batches: list[list[list[int]]],
    lasts: list[list[bool]],
    lengths: list[int],
    total: int,
    remainder: int | None,
) -> None:
    drop_last = options.pop("drop_last", False)
    for rank in range(p):
        loader = shard_loader(
            rank_ctx(p, rank),
            DataLoader(make_data(kind, n), batch_size=bs, drop_last=drop_last),
            dispatch_batches=False,
            **options,
        )
        records = list(iter_batches(loader))
        assert as_lists(records) == batches[rank]
        assert [r.is_last for r in records] == lasts[rank]
        assert [r.index for r in records] == list(range(len(records)))
        assert len(loader) == lengths[rank]
        assert loader.total_batch_size == total
        assert all(r.remainder == remainder for r in records)
        assert [x.tolist() for x in loader] == batches[rank]  # the drop-in path


@pytest.mark.parametrize("p", [1, 2, 3])
def test_unsized_stream_reports_observed_remainder_on_last_batch(p: int) -> None:
    n, bs = 10, 3
    for rank in range(p):
        loader = shard_loader(
            rank_ctx(p, rank),
            DataLoader(Stream(n), batch_size=bs),
            dispatch_batches=False,
        )
        sized = shard_loader(
            rank_ctx(p, rank),
            DataLoader(SizedStream(n), batch_size=bs),
            dispatch_batches=False,
        )
        records, expected = list(iter_batches(loader)), list(iter_batches(sized))
        assert as_lists(records) == as_lists(expected)
        assert [r.remainder for r in records[:-1]] == [-1] * (len(records) - 1)
        assert records[-1].remainder == n % (bs * p) == expected[-1].remainder
        assert [x.tolist() for x in loader] == as_lists(expected)
        with pytest.raises(
            TypeError, match=r"ShardedLoader.__len__: the Stream has no len\(\)"
        ):
            len(loader)


def test_unsized_stream_with_drop_last_has_no_remainder() -> None:
    loader = shard_loader(
        rank_ctx(2, 1),
        DataLoader(Stream(10), batch_size=3, drop_last=True),
        dispatch_batches=False,
    )
    records = list(iter_batches(loader))
    assert as_lists(records) == [[3, 4, 5]]
    assert [r.remainder for r in records] == [-1]


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("bs", [1, 2, 3])
@pytest.mark.parametrize("even_batches", [False, True])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_one_process_yields_the_original_batches(
    kind: str, bs: int, drop_last: bool, even_batches: bool
) -> None:
    def make() -> DataLoader[torch.Tensor]:
        return DataLoader(make_data(kind, 7), batch_size=bs, drop_last=drop_last)

    loader = shard_loader(rank_ctx(1), make(), even_batches=even_batches)
    expected = [batch.tolist() for batch in make()]
    assert [x.tolist() for x in loader] == expected
    assert as_lists(list(iter_batches(loader))) == expected
    assert len(loader) == len(make())
    assert loader.total_batch_size == bs
    assert loader.dispatch_batches is False


class GetItems(Dataset[tuple[int, str]]):
    """A dataset with ``__getitems__``, logging every read."""

    def __init__(self, n: int, reads: list[object]) -> None:
        self.n, self.reads = n, reads

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[int, str]:
        self.reads.append(index)
        if index == 13:
            raise KeyError(index)
        return index, f"s{index}"

    def __getitems__(self, indices: list[int]) -> list[tuple[int, str]]:
        self.reads.append(tuple(indices))
        return [self[i] for i in indices]


class PlainItems(GetItems):
    __getitems__ = None  # type: ignore[assignment]  # torch's fetcher skips it


def plain(batch: object) -> object:
    """``batch`` with its tensors as lists, for comparing with ``==``."""
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if isinstance(batch, (list, tuple)):
        return [plain(item) for item in batch]
    return batch


@pytest.mark.parametrize("items", [GetItems, PlainItems])
@pytest.mark.parametrize(
    "options",
    [
        {"batch_size": 3},
        {"batch_size": 4, "drop_last": True, "collate_fn": list},
        {"batch_size": None},
        {"batch_size": None, "collate_fn": repr},
        {"batch_sampler": [[5, 0], [2], [7, 1, 3]]},
        {"sampler": [6, 2, 4, 0], "batch_size": 3},
    ],
)
def test_one_process_reads_exactly_as_the_dataloader_does(
    items: type[GetItems], options: dict[str, Any]
) -> None:
    # With no workers the loader reads in this process without torch's loader
    # iterator: the same batches from the same dataset calls, in the same order.
    want_reads: list[object] = []
    want = [plain(b) for b in DataLoader(items(10, want_reads), **options)]
    got_reads: list[object] = []
    loader = shard_loader(rank_ctx(1), DataLoader(items(10, got_reads), **options))
    assert [plain(b) for b in loader] == want
    assert got_reads == want_reads
    got_reads.clear()
    assert [plain(batch.data) for batch in iter_batches(loader)] == want
    assert got_reads == want_reads


@pytest.mark.parametrize("batch_size", [3, None])
def test_a_dataset_error_reaches_the_caller_unchanged(batch_size: int | None) -> None:
    failing = DataLoader(GetItems(14, []), batch_size=batch_size)
    with pytest.raises(KeyError, match="13"):
        list(failing)
    with pytest.raises(KeyError, match="13"):
        list(shard_loader(rank_ctx(1), failing))


class StopsAtFour(Dataset[int]):
    """A dataset whose ``__getitem__`` raises StopIteration past index 3."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, index: int) -> int:
        if index > 3:
            raise StopIteration
        return index


def test_a_stop_iteration_from_the_dataset_ends_the_epoch_as_in_a_dataloader() -> None:
    plain = DataLoader(StopsAtFour(), batch_size=3, collate_fn=list)
    loader = shard_loader(rank_ctx(1), plain)
    assert list(plain) == [[0, 1, 2]]
    assert list(loader) == [[0, 1, 2]]
    records = list(iter_batches(loader))
    assert [r.data for r in records] == [[0, 1, 2]]
    assert records[-1].is_last


def test_a_timeout_without_workers_fails_as_the_dataloader_fails() -> None:
    plain = DataLoader(Indexed(5), batch_size=2, timeout=5)
    with pytest.raises(AssertionError, match="timeout == 0"):
        list(plain)
    with pytest.raises(AssertionError, match="timeout == 0"):
        list(shard_loader(rank_ctx(1), plain))


def test_reads_are_labelled_in_a_profile_as_torch_labels_them() -> None:
    loader = shard_loader(rank_ctx(1), DataLoader(GetItems(7, []), batch_size=2))
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]) as prof:
        batches = list(loader)
    labels = [event.name for event in prof.events()]
    assert len(batches) == 4
    assert labels.count("enumerate(DataLoader)#ShardedLoader.__next__") == 4
    assert [plain(b) for b in loader] == [plain(b) for b in batches]  # unprofiled


def test_reading_in_process_and_in_workers_give_the_same_shards() -> None:
    for rank in (0, 1):
        loaders = [
            shard_loader(
                rank_ctx(2, rank),
                DataLoader(
                    GetItems(11, []), batch_size=2, shuffle=True, num_workers=workers
                ),
                seed=5,
            )
            for workers in (0, 1)
        ]
        in_process, in_worker = (
            [plain(b.data) for b in iter_batches(x)] for x in loaders
        )
        assert in_process == in_worker
        assert len(in_process) == 3


# ---------- docs/loader.md#semantics-epoch-order-and-rng-synchronisation


def test_seeded_shuffle_matches_the_spec_example_and_torch() -> None:
    order = seeded_order(8, 42)
    # docs/loader.md#semantics-epoch-order-and-rng-synchronisation, 'Shuffling'
    assert order == [6, 3, 0, 7, 2, 1, 4, 5]  # checked against torch

    def make() -> DataLoader[torch.Tensor]:
        return DataLoader(Indexed(8), batch_size=2, shuffle=True)

    one = shard_loader(rank_ctx(1), make(), seed=42)
    assert [x.tolist() for x in one] == [[6, 3], [0, 7], [2, 1], [4, 5]]
    assert as_lists(list(iter_batches(one))) == [[6, 3], [0, 7], [2, 1], [4, 5]]
    one.set_epoch(0)
    assert [x.tolist() for x in one] == [[6, 3], [0, 7], [2, 1], [4, 5]]  # replay
    two = [as_lists(records) for records in all_ranks(2, make, seed=42)]
    assert two == [[[6, 3], [2, 1]], [[0, 7], [4, 5]]]
    epoch_1 = seeded_order(8, 43)
    assert as_lists(list(iter_batches(one, LoaderState(epoch=1)))) == [
        epoch_1[i : i + 2] for i in range(0, 8, 2)
    ]


@pytest.mark.parametrize(
    "sampler_options",
    [
        {},
        {"replacement": True},
        {"num_samples": 13},
        {"replacement": True, "num_samples": 70},
    ],
)
@pytest.mark.parametrize("epoch", [0, 3])
def test_seeded_shuffle_draws_as_torch_random_sampler(
    sampler_options: dict[str, Any], epoch: int
) -> None:
    dataset = Indexed(9)
    sampler = RandomSampler(dataset, **sampler_options)
    loader = shard_loader(
        rank_ctx(1), DataLoader(dataset, batch_size=4, sampler=sampler), seed=7
    )
    torch.manual_seed(epoch)  # the global RNG must not matter
    got = [
        i
        for batch in iter_batches(loader, LoaderState(epoch=epoch))
        for i in batch.data.tolist()
    ]
    assert got == seeded_order(9, 7 + epoch, **sampler_options)
    assert len(loader) == -(-len(sampler) // 4)


def test_epoch_order_is_the_same_for_every_world_size() -> None:
    order = seeded_order(24, 5 + 2)

    def make() -> DataLoader[torch.Tensor]:
        return DataLoader(Indexed(24), batch_size=2, shuffle=True)

    for p in (1, 2, 3, 4):
        ranks = all_ranks(p, make, LoaderState(epoch=2), seed=5)
        rounds = zip(*(as_lists(records) for records in ranks), strict=True)
        assert [i for r in rounds for batch in r for i in batch] == order


def test_each_iteration_starts_the_next_epoch_as_a_dataloader_reshuffles() -> None:
    loader = shard_loader(
        rank_ctx(1), DataLoader(Indexed(6), batch_size=6, shuffle=True), seed=3
    )
    assert loader.epoch == 0
    epochs = [[x.tolist() for x in loader] for _ in range(3)]
    assert epochs == [[seeded_order(6, 3 + e)] for e in range(3)]
    assert loader.epoch == 3
    # iter_batches is a function of its arguments: it neither reads nor moves it.
    assert as_lists(list(iter_batches(loader))) == epochs[0]
    assert loader.epoch == 3
    # The counter moves when an iteration starts, so a loop cut short (a break,
    # a peek with next(iter(loader))) is still followed by a new order.
    next(iter(loader))
    assert loader.epoch == 4
    loader.set_epoch(4)
    assert loader.epoch == 4
    assert [x.tolist() for x in loader] == [seeded_order(6, 7)]
    assert loader.epoch == 5
    with pytest.raises(
        ValueError, match=r"ShardedLoader.set_epoch: epoch \(-1\) must be >= 0"
    ):
        loader.set_epoch(-1)
    with pytest.raises(
        TypeError, match=r"ShardedLoader.set_epoch: epoch must be an int; got '2'"
    ):
        loader.set_epoch("2")  # type: ignore[arg-type]


@given(st.lists(st.one_of(st.none(), st.integers(0, 5), st.just("break")), max_size=8))
def test_drop_in_epochs_follow_one_counter(calls: list[int | str | None]) -> None:
    """``None`` is a whole ``for`` loop, ``"break"`` a loop cut after one batch, and
    an int a ``set_epoch``; a model counter predicts every order."""
    loader = shard_loader(
        rank_ctx(2, 1), DataLoader(Indexed(8), batch_size=2, shuffle=True), seed=9
    )
    expected_epoch = 0
    for call in calls:
        if isinstance(call, int):
            loader.set_epoch(call)
            expected_epoch = call
            continue
        order = seeded_order(8, 9 + expected_epoch)
        mine = [order[2:4], order[6:8]]  # rank 1 of 2
        if call == "break":
            for x in loader:
                assert x.tolist() == mine[0]
                break
        else:
            assert [x.tolist() for x in loader] == mine
        expected_epoch += 1
        assert loader.epoch == expected_epoch


class EpochSampler(SequentialSampler):
    """A custom sampler that records ``set_epoch``."""

    def __init__(self, data_source: Indexed) -> None:
        super().__init__(data_source)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class EpochIndexed(Indexed):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


def test_set_epoch_reaches_sampler_and_dataset_at_each_epoch_start() -> None:
    dataset = EpochIndexed(4)
    sampler = EpochSampler(dataset)
    loader = shard_loader(
        rank_ctx(2, 1), DataLoader(dataset, batch_size=2, sampler=sampler)
    )
    assert (sampler.epochs, dataset.epochs) == ([], [])
    list(iter_batches(loader, LoaderState(epoch=3)))
    loader.set_epoch(5)
    list(loader)
    assert sampler.epochs == [3, 5]
    assert dataset.epochs == [3, 5]


class GeneratorStream(IterableDataset[torch.Tensor]):
    """A stream shuffled by its own ``generator`` attribute (no ``set_epoch``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.generator = torch.Generator()

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.randperm(self.n, generator=self.generator))


@pytest.mark.parametrize("epoch", [0, 2])
def test_iterable_dataset_generator_is_reseeded_with_seed_plus_epoch(
    epoch: int,
) -> None:
    expected = torch.randperm(6, generator=torch.Generator().manual_seed(10 + epoch))
    ranks = [
        list(iter_batches(loader, LoaderState(epoch=epoch)))
        for loader in (
            shard_loader(
                rank_ctx(2, rank),
                DataLoader(GeneratorStream(6), batch_size=3),
                seed=10,
                dispatch_batches=False,
            )
            for rank in (0, 1)
        )
    ]
    assert as_lists(ranks[0]) + as_lists(ranks[1]) == [
        expected[:3].tolist(),
        expected[3:].tolist(),
    ]


# -------------------- docs/loader.md#semantics-resuming-from-a-loaderstate


def test_resume_worked_example_across_world_sizes() -> None:
    def make(bs: int) -> Any:
        return lambda: DataLoader(Indexed(10), batch_size=bs)

    first = all_ranks(2, make(2))
    assert [as_lists(r) for r in first] == [
        [[0, 1], [4, 5], [8, 9]],
        [[2, 3], [6, 7], [0, 1]],
    ]
    state = first[0][0].state
    assert state == LoaderState(epoch=0, global_batches=1, global_batch_size=4)
    assert first[1][0].state == state
    resumed = [as_lists(r) for r in all_ranks(2, make(2), state)]
    assert resumed == [[[4, 5], [8, 9]], [[6, 7], [0, 1]]]
    assert [as_lists(r) for r in all_ranks(1, make(2), state)] == [
        [[4, 5], [6, 7], [8, 9]]
    ]
    four = [as_lists(r) for r in all_ranks(4, make(1), state)]
    assert four == [[[4], [8]], [[5], [9]], [[6], [0]], [[7], [1]]]
    loader = shard_loader(rank_ctx(4, 0), DataLoader(Indexed(10), batch_size=2))
    message = (
        r"iter_batches: the samples state counts \(global_batches \* global_batch_size\)"
        r" must be a multiple of this loader's total_batch_size \(8\); got 4\. Resume "
        r"at an epoch start"
    )
    with pytest.raises(ValueError, match=message):
        iter_batches(loader, state)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    ("p", "options"),
    [(1, {}), (2, {}), (3, {"even_batches": False}), (2, {"split_batches": True})],
)
def test_resume_fetches_no_skipped_sample(
    p: int, options: dict[str, Any], shuffle: bool
) -> None:
    for rank in range(p):
        dataset = Indexed(37)
        loader = shard_loader(
            rank_ctx(p, rank),
            DataLoader(dataset, batch_size=4, shuffle=shuffle),
            seed=1,
            **options,
        )
        full = list(iter_batches(loader))
        assert len(dataset.fetched) == sum(len(b.data) for b in full)
        dataset.fetched.clear()
        resumed = list(iter_batches(loader, full[1].state))
        yielded = [i for batch in resumed for i in batch.data.tolist()]
        assert yielded and sorted(dataset.fetched) == sorted(
            yielded
        )  # nothing else read
        assert as_lists(resumed) == as_lists(full[2:])


def _same_records(a: Sequence[Batch], b: Sequence[Batch]) -> None:
    assert as_lists(a) == as_lists(b)
    keys = [(r.index, r.is_last, r.remainder, r.epoch, r.state) for r in a]
    assert keys == [(r.index, r.is_last, r.remainder, r.epoch, r.state) for r in b]


@pytest.mark.parametrize("kind", ["map", "iterable", "unsized"])
@pytest.mark.parametrize("stop", [0, 1, 2, 3, 4])
def test_resume_continues_the_uninterrupted_epoch(kind: str, stop: int) -> None:
    def loader(rank: int) -> ShardedLoader:
        dataloader = DataLoader(make_data(kind, 29), batch_size=2)
        return shard_loader(rank_ctx(3, rank), dataloader, dispatch_batches=False)

    for rank in range(3):
        full = list(iter_batches(loader(rank)))
        state = full[stop - 1].state if stop else LoaderState()
        _same_records(list(iter_batches(loader(rank), state)), full[stop:])


def test_skip_applies_to_one_call_and_exactly_at_the_end_yields_nothing() -> None:
    loader = shard_loader(rank_ctx(2, 0), DataLoader(Indexed(10), batch_size=2))
    # 10 samples in global batches of 4: 3 global batches; 3 of them consumed is
    # "epoch finished", which yields nothing.
    assert (
        list(iter_batches(loader, LoaderState(global_batches=3, global_batch_size=4)))
        == []
    )
    full = list(iter_batches(loader))
    assert full[-1].state == LoaderState(epoch=1)
    assert as_lists(list(iter_batches(loader, full[0].state))) == as_lists(full[1:])
    assert as_lists(list(iter_batches(loader, LoaderState(epoch=1)))) == as_lists(full)


def past_the_end(state: LoaderState | None, skip: int, batches: int) -> str:
    """The start of the error for a state ``skip`` global batches (of 4) in."""
    named = "the state" if state is None else repr(state)
    return re.escape(
        f"iter_batches: {named} is {skip} global batches of 4 samples into epoch 0, "
        f"past the end of the epoch: this loader's epoch has {batches} global batches "
        "(len(loader) on rank 0). Resume from a state this loader saved (batch.state), "
        f"from LoaderState(epoch=0, global_batches={batches}) at the most, or from "
        "LoaderState(epoch=1) to start the next epoch."
    )


@pytest.mark.parametrize("kind", ["map", "iterable", "stream"])
def test_a_state_past_the_end_is_an_error_naming_it_and_the_length(kind: str) -> None:
    # 10 samples, bs=2, 2 ranks: G=4, 3 global batches per epoch.
    for rank in (0, 1):
        loader = shard_loader(
            rank_ctx(2, rank),
            DataLoader(make_data(kind, 10), batch_size=2),
            dispatch_batches=False,
        )
        at_end = LoaderState(global_batches=3, global_batch_size=4)
        assert list(iter_batches(loader, at_end)) == []  # the epoch finished
        beyond = LoaderState(global_batches=4, global_batch_size=4)
        # Sized data is refused at the call; an unsized stream once the skip finds
        # it ended early.
        named = None if kind == "stream" else beyond
        with pytest.raises(ValueError, match=past_the_end(named, 4, 3)):
            list(iter_batches(loader, beyond))
        # Counted in another G: 4 global batches of 2 samples are 2 of 4, within.
        assert len(list(iter_batches(loader, replace_g(beyond, 2)))) == 1


def replace_g(state: LoaderState, size: int) -> LoaderState:
    return dataclasses.replace(state, global_batch_size=size)


@given(
    kind=st.sampled_from(["map", "iterable", "stream"]),
    n=st.integers(0, 13),
    bs=st.integers(1, 4),
    p=st.integers(1, 3),
    even_batches=st.booleans(),
    drop_last=st.booleans(),
    extra=st.integers(-3, 3),
)
def test_resume_raises_past_the_end_and_yields_the_rest_up_to_it(
    kind: str,
    n: int,
    bs: int,
    p: int,
    even_batches: bool,
    drop_last: bool,
    extra: int,
) -> None:
    def make() -> DataLoader[torch.Tensor]:
        return DataLoader(make_data(kind, n), batch_size=bs, drop_last=drop_last)

    options: dict[str, Any] = {"even_batches": even_batches, "dispatch_batches": False}
    full = all_ranks(p, make, **options)
    epoch = max(len(batches) for batches in full)  # global batches: rank 0's count
    consumed = epoch + extra
    assume(consumed >= 0)
    state = LoaderState(global_batches=consumed, global_batch_size=bs * p)
    for rank in range(p):
        loader = shard_loader(rank_ctx(p, rank), make(), **options)
        if consumed > epoch:
            with pytest.raises(ValueError, match=r"past the end of the epoch"):
                list(iter_batches(loader, state))
        else:
            resumed = list(iter_batches(loader, state))
            assert as_lists(resumed) == as_lists(full[rank][consumed:])


@st.composite
def resume_cases(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["map", "iterable"]))
    n = draw(st.integers(0, 60))
    drop_last = draw(st.booleans())

    def world() -> tuple[int, int, bool, bool]:
        p = draw(st.integers(1, 4))
        split = draw(st.booleans())
        bs = draw(st.integers(1, 4)) * (p if split else 1)
        return p, bs, split, draw(st.booleans())

    first = world()
    g1 = first[1] if first[2] else first[1] * first[0]
    whole = n // g1 if drop_last else -(-n // g1)
    stop = draw(st.integers(1, max(whole - 1, 1)))
    consumed = stop * g1
    p2, split2 = draw(st.integers(1, 4)), draw(st.booleans())
    sizes = [
        g // (1 if split2 else p2)
        for g in range(1, consumed + 1)
        if consumed % g == 0 and g % p2 == 0
    ]
    bs2 = draw(st.sampled_from(sizes)) if sizes else None
    return {
        "kind": kind,
        "n": n,
        "drop_last": drop_last,
        "first": first,
        "second": (p2, bs2, split2, draw(st.booleans())),
        "stop": stop,
        "whole": whole,
        "shuffle": kind == "map" and draw(st.booleans()),
    }


def _global_order(ranks: list[list[Batch]]) -> list[int]:
    """Concatenate the ranks' batches round by round; drop the last round's padding."""
    rounds = max((len(r) for r in ranks), default=0)
    order: list[int] = []
    for j in range(rounds):
        round_items = [i for r in ranks if j < len(r) for i in r[j].data.tolist()]
        final = ranks[0][j]  # rank 0 has the most batches, so it is in every round
        if final.is_last and final.remainder > 0:
            round_items = round_items[: final.remainder]
        order += round_items
    return order


@given(resume_cases())
def test_resume_on_another_world_size_continues_the_global_order(
    case: dict[str, Any],
) -> None:
    n, kind, drop_last, stop = case["n"], case["kind"], case["drop_last"], case["stop"]
    if case["whole"] < 2 or case["second"][1] is None:
        return  # nothing to resume in the middle of, or no batch size divides it

    def run(
        world: tuple[int, int, bool, bool], state: LoaderState
    ) -> list[list[Batch]]:
        p, bs, split, even = world

        def make() -> DataLoader[torch.Tensor]:
            return DataLoader(
                make_data(kind, n),
                batch_size=bs,
                drop_last=drop_last,
                shuffle=case["shuffle"],
            )

        return all_ranks(
            p,
            make,
            state,
            split_batches=split,
            even_batches=even,
            dispatch_batches=False,
            seed=9,
        )

    order = seeded_order(n, 9) if case["shuffle"] else list(range(n))
    before = [r[:stop] for r in run(case["first"], LoaderState())]
    state = before[0][-1].state
    assert _global_order(before) == order[: len(_global_order(before))]
    p2, bs2, split2, _ = case["second"]
    g2 = bs2 if split2 else bs2 * p2
    after = run(case["second"], state)
    end = n // g2 * g2 if drop_last else n
    assert _global_order(before) + _global_order(after) == order[:end]
    whole = run(case["second"], LoaderState())
    skipped = state.global_batches * state.global_batch_size // g2
    for resumed, uninterrupted in zip(after, whole, strict=True):
        _same_records(resumed, uninterrupted[skipped:])


def test_dynamic_batch_sampler_resumes_in_its_own_batches() -> None:
    batches = [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]
    loader = shard_loader(
        rank_ctx(2, 1), DataLoader(Indexed(11), batch_sampler=batches)
    )
    records = list(iter_batches(loader))
    assert as_lists(records) == [
        [3],
        [6, 7, 8, 9],
        [0, 1, 2],
    ]  # looped back, whole batch
    assert loader.total_batch_size is None
    assert [r.remainder for r in records] == [-1, -1, -1]
    assert records[0].state == LoaderState(
        epoch=0, global_batches=1, global_batch_size=0
    )
    assert as_lists(list(iter_batches(loader, records[0].state))) == as_lists(
        records[1:]
    )
    with pytest.raises(
        ValueError,
        match=r"iter_batches: state\.global_batch_size must be 0 for a loader with a "
        r"dynamic batch sampler \(no total_batch_size\); got 4\.",
    ):
        iter_batches(loader, LoaderState(global_batches=1, global_batch_size=4))
    assert batches == [[0, 1, 2], [3], [4, 5], [6, 7, 8, 9], [10]]


# ------------------------------------------------------------------- LoaderState


@given(st.integers(0, 2**40), st.integers(0, 2**40), st.integers(0, 2**20))
def test_loader_state_round_trips_through_json(
    epoch: int, done: int, size: int
) -> None:
    state = LoaderState(epoch=epoch, global_batches=done, global_batch_size=size)
    assert LoaderState.from_dict(state.to_dict()) == state
    assert LoaderState.from_dict(json.loads(json.dumps(state.to_dict()))) == state


@pytest.mark.parametrize("field", ["epoch", "global_batches", "global_batch_size"])
def test_loader_state_rejects_bad_fields(field: str) -> None:
    with pytest.raises(ValueError, match=rf"LoaderState: {field} \(-2\) must be >= 0"):
        LoaderState(**{field: -2})
    with pytest.raises(
        TypeError, match=rf"LoaderState: {field} must be an int; got 1.5"
    ):
        LoaderState(**{field: 1.5})  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=rf"LoaderState: {field} must be an int; got True"
    ):
        LoaderState(**{field: True})
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(LoaderState(), field, 1)  # noqa: B010


def test_loader_state_from_dict_rejects_other_shapes() -> None:
    with pytest.raises(TypeError, match=r"LoaderState.from_dict: data must be a dict"):
        LoaderState.from_dict([("epoch", 1)])
    with pytest.raises(ValueError, match=r"got \['epoch'\]"):
        LoaderState.from_dict({"epoch": 1})
    extra = {**LoaderState().to_dict(), "step": 3}
    with pytest.raises(ValueError, match=r"the keys of data must be exactly \["):
        LoaderState.from_dict(extra)
    assert extra["step"] == 3 and len(extra) == 4  # not modified


def test_batch_state_after_each_batch() -> None:
    records = list(
        iter_batches(
            shard_loader(rank_ctx(3, 2), DataLoader(Indexed(20), batch_size=3)),
            LoaderState(epoch=4),
        )
    )
    assert [r.state for r in records] == [
        LoaderState(epoch=4, global_batches=1, global_batch_size=9),
        LoaderState(epoch=4, global_batches=2, global_batch_size=9),
        LoaderState(epoch=5),
    ]
    assert [r.epoch for r in records] == [4, 4, 4]


# ------------------------------------------------------- the caller's objects


def test_the_callers_loader_sampler_and_lists_are_not_modified() -> None:
    dataset = Indexed(10)
    dataloader = DataLoader(dataset, batch_size=3, shuffle=True)
    attributes = dict(vars(dataloader))
    sampler_attributes = dict(vars(dataloader.sampler))
    batch_sampler = dataloader.batch_sampler
    rng_types: list[Any] = ["generator"]
    for rank in range(2):
        loader = shard_loader(rank_ctx(2, rank), dataloader, rng_types=rng_types)
        list(iter_batches(loader))
        list(loader)
    assert rng_types == ["generator"]
    assert vars(dataloader) == attributes
    assert vars(dataloader.sampler) == sampler_attributes
    assert dataloader.batch_sampler is batch_sampler
    assert isinstance(loader.rng_types, tuple) and loader.rng_types == ("generator",)


class Tagged(Dataset[dict[str, Any]]):
    """Items say which worker read them, and whether worker_init_fn ran there."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = "main"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = get_worker_info()
        workers = -1 if info is None else info.num_workers
        return {"index": index, "pid": os.getpid(), "workers": workers, "tag": self.tag}


def tag_worker(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.tag = f"init-{worker_id}"  # type: ignore[attr-defined]


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    return {key: [row[key] for row in rows] for key in rows[0]}


@pytest.mark.parametrize(
    ("kind", "p", "dispatch"),
    [
        ("map", 1, False),
        ("map", 2, False),
        ("map", 2, True),
        ("iterable", 1, False),
        ("iterable", 2, False),
        ("iterable", 2, True),
        ("unsized", 2, False),
    ],
)
def test_kept_dataloader_settings_reach_the_inner_loader(
    kind: str, p: int, dispatch: bool
) -> None:
    dataloader = DataLoader(
        make_data(kind, 8),
        batch_size=2,
        num_workers=2,
        collate_fn=collate_rows,
        pin_memory=True,
        timeout=30.0,
        worker_init_fn=tag_worker,
        multiprocessing_context="fork",
        prefetch_factor=3,
        persistent_workers=True,
        pin_memory_device="",
        in_order=False,
    )
    kept = kept_settings(dataloader)
    assert set(kept) == {
        "num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
        "multiprocessing_context", "prefetch_factor", "persistent_workers",
        "pin_memory_device", "in_order",
    }  # fmt: skip
    assert kept["in_order"] is False and kept["prefetch_factor"] == 3
    loader = shard_loader(rank_ctx(p, 0), dataloader, dispatch_batches=dispatch)
    inner = loader._setup.inner
    assert inner is not None and inner is not dataloader
    got = kept_settings(inner)
    if kind == "unsized":  # the collate_fn is wrapped to count the stream
        assert got.pop("collate_fn").collate_fn is collate_rows
        kept.pop("collate_fn")
    assert got == kept
    assert inner.generator is not dataloader.generator


def test_worker_settings_work_across_epochs() -> None:
    dataloader = DataLoader(
        Tagged(8),
        batch_size=2,
        num_workers=2,
        collate_fn=collate_rows,
        worker_init_fn=tag_worker,
        persistent_workers=True,
    )
    loader = shard_loader(rank_ctx(2, 0), dataloader, put_on_device=False)
    epochs = []
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        epochs.append(list(loader))
    assert (
        [b["index"] for b in epochs[0]]
        == [[0, 1], [4, 5]]
        == [b["index"] for b in epochs[1]]
    )
    assert all(w == 2 for b in epochs[0] for w in b["workers"])
    assert all(t.startswith("init-") for b in epochs[0] for t in b["tag"])
    pids = [{p for b in batches for p in b["pid"]} for batches in epochs]
    assert pids[0] == pids[1] and os.getpid() not in pids[0]  # persistent workers


def test_pin_memory_is_kept() -> None:
    loader = shard_loader(
        rank_ctx(1), DataLoader(Indexed(4), batch_size=2, pin_memory=True)
    )
    if torch.accelerator.is_available():  # pinned for real
        batches = list(loader)
        assert all(x.is_pinned() for x in batches)
    else:  # torch says it cannot pin, which shows the setting arrived
        with pytest.warns(UserWarning, match="pin_memory"):
            batches = list(loader)
    assert [x.tolist() for x in batches] == [[0, 1], [2, 3]]


# ------------------------------------------------------------ device placement


def test_put_on_device_moves_batches_to_ctx_device() -> None:
    meta = DistributedContext(device=torch.device("meta"))
    dataloader = DataLoader(
        Tagged(4),
        batch_size=2,
        collate_fn=lambda rows: (
            torch.tensor([r["index"] for r in rows]),
            [r["tag"] for r in rows],
        ),
    )
    moved = list(iter_batches(shard_loader(meta, dataloader)))
    assert [b.data[0].device.type for b in moved] == ["meta", "meta"]
    assert [b.data[1] for b in moved] == [["main", "main"]] * 2
    kept = list(shard_loader(meta, dataloader, put_on_device=False))
    assert [b[0].tolist() for b in kept] == [[0, 1], [2, 3]]
    unmoved = iter_batches(shard_loader(meta, dataloader, put_on_device=False))
    assert [(b.data[0].tolist(), b.is_last) for b in unmoved] == [
        ([0, 1], False),
        ([2, 3], True),
    ]
    stream = DataLoader(Stream(5), batch_size=2)
    for put in (False, True):
        counted = list(iter_batches(shard_loader(meta, stream, put_on_device=put)))
        assert [b.data.device.type for b in counted] == ["meta" if put else "cpu"] * 3
        assert [b.remainder for b in counted] == [-1, -1, 1]
    assert (
        list(shard_loader(meta, dataloader, non_blocking=True))[0][0].device.type
        == "meta"
    )


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        ("map", {}),
        ("iterable", {"dispatch_batches": False}),
        ("iterable", {"dispatch_batches": True}),
        ("map", {"dispatch_batches": True}),
    ],
)
@pytest.mark.parametrize("bs", [1, 3])
def test_split_batches_needs_a_multiple_of_the_world(
    kind: str, options: dict[str, Any], bs: int
) -> None:
    message = (
        rf"shard_loader: batch_size \({bs}\) must be a multiple of num_processes \(2\) "
        rf"when split_batches=True; use a batch size divisible by 2 or split_batches=False."
    )
    with pytest.raises(ValueError, match=message):
        shard_loader(
            rank_ctx(2, 0),
            DataLoader(make_data(kind, 6), batch_size=bs),
            split_batches=True,
            **options,
        )


def test_split_batches_needs_a_known_batch_size() -> None:
    dataloader = DataLoader(Indexed(6), batch_sampler=[[0, 1], [2, 3, 4, 5]])
    with pytest.raises(ValueError, match=r"batch_size \(None\) must be a multiple"):
        shard_loader(rank_ctx(1), dataloader, split_batches=True)


def test_unbatched_loader_works_alone_and_needs_dispatch_when_sharded() -> None:
    dataloader = DataLoader(Indexed(3), batch_size=None)
    assert [x.tolist() for x in shard_loader(rank_ctx(1), dataloader)] == [0, 1, 2]
    assert len(shard_loader(rank_ctx(1), dataloader)) == 3
    with pytest.raises(
        ValueError,
        match=r"shard_loader: the DataLoader's batch_size must be set \(not None\) to "
        r"shard batches across 2 processes; got None\. Pass a batch_size",
    ):
        shard_loader(rank_ctx(2, 0), dataloader)


@pytest.mark.parametrize(
    ("arguments", "error", "pattern"),
    [
        ({"ctx": "cpu"}, TypeError, r"shard_loader: ctx must be a DistributedContext"),
        (
            {"dataloader": [1, 2]},
            TypeError,
            r"shard_loader: dataloader must be a torch.utils.data.DataLoader; got \[1, 2\]",
        ),
        (
            {"split_batches": 1},
            TypeError,
            r"shard_loader: split_batches must be True or False; got 1",
        ),
        (
            {"put_on_device": None},
            TypeError,
            r"shard_loader: put_on_device must be True or False",
        ),
        (
            {"even_batches": "yes"},
            TypeError,
            r"shard_loader: even_batches must be True or False",
        ),
        (
            {"non_blocking": 0},
            TypeError,
            r"shard_loader: non_blocking must be True or False",
        ),
        (
            {"dispatch_batches": "auto"},
            TypeError,
            r"shard_loader: dispatch_batches must be None, True or False",
        ),
        ({"seed": 1.0}, TypeError, r"shard_loader: seed must be an int; got 1.0"),
        ({"seed": -1}, ValueError, r"shard_loader: seed \(-1\) must be >= 0"),
        ({"seed": 2**63}, ValueError, r"shard_loader: seed must be < 2\*\*63; got 9"),
        (
            {"slice_fn": 3},
            TypeError,
            r"shard_loader: slice_fn must be None or a callable",
        ),
        (
            {"rng_types": "torch"},
            TypeError,
            r"shard_loader: rng_types must be a list of names",
        ),
        (
            {"rng_types": ["torch", "numpy"]},
            ValueError,
            r"in rng_types must be one of 'torch', 'cuda', 'generator'; got 'numpy'\.",
        ),
        (
            {"rng_types": ["cuda"]},
            ValueError,
            r"rng_types must be free of 'cuda' when ctx.device is cpu; got \['cuda'\]",
        ),
        (
            {"dispatch_batches": True, "put_on_device": False},
            ValueError,
            r"put_on_device must be True when dispatch_batches=True \(rank 0 sends ",
        ),
    ],
)
def test_shard_loader_rejects_bad_arguments(
    arguments: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    call: dict[str, Any] = {
        "ctx": rank_ctx(2, 0),
        "dataloader": DataLoader(Indexed(4), batch_size=2),
        **arguments,
    }
    with pytest.raises(error, match=pattern):
        shard_loader(call.pop("ctx"), call.pop("dataloader"), **call)


def _seeded(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize(
    ("make", "owner"),
    [
        (lambda g: {"shuffle": True, "generator": g}, "the DataLoader"),
        (lambda g: {"generator": g}, "the DataLoader"),  # it would seed the workers
        (
            lambda g: {"sampler": RandomSampler(range(6), generator=g)},
            "the DataLoader's RandomSampler",
        ),
    ],
    ids=["shuffle", "sequential", "sampler"],
)
def test_a_generator_the_loader_would_ignore_is_refused(
    make: Any, owner: str, p: int
) -> None:
    for seed in (4, 5):  # two seeds must not silently give one order
        generator = _seeded(seed)
        state = generator.get_state()
        options = make(generator)
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"shard_loader: {owner} has a generator (initial seed {seed}), which "
                "a sharded loader does not use: it draws each epoch's order, and the "
                "workers' base seed, from seed + epoch, so that every rank and world "
                "size agree. Drop generator= there and pass the seed to shard_loader "
                f"instead (seed={seed})."
            ),
        ):
            shard_loader(rank_ctx(p), DataLoader(Indexed(6), batch_size=2, **options))
        assert torch.equal(generator.get_state(), state)  # not consumed


def test_a_generator_seed_too_large_for_seed_is_not_suggested() -> None:
    with pytest.raises(
        ValueError,
        match=r"pass the seed to shard_loader instead \(a seed below 2\*\*63\)",
    ):
        shard_loader(
            rank_ctx(1),
            DataLoader(
                Indexed(6), batch_size=2, shuffle=True, generator=_seeded(2**63)
            ),
        )


def test_a_custom_sampler_keeps_its_own_generator() -> None:
    sampler = SubsetRandomSampler(list(range(6)), generator=_seeded(3))
    loader = shard_loader(
        rank_ctx(1), DataLoader(Indexed(6), batch_size=6, sampler=sampler)
    )
    expected = list(SubsetRandomSampler(list(range(6)), generator=_seeded(3)))
    assert [x.tolist() for x in loader] == [expected]


def test_iter_batches_rejects_bad_arguments() -> None:
    loader = shard_loader(rank_ctx(1), DataLoader(Indexed(4), batch_size=2))
    with pytest.raises(
        TypeError, match=r"iter_batches: loader must be a ShardedLoader"
    ):
        iter_batches(DataLoader(Indexed(4)))  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"iter_batches: state must be a LoaderState; got \{'epoch': 0\}",
    ):
        iter_batches(loader, {"epoch": 0})  # type: ignore[arg-type]


def test_default_dispatch_follows_the_dataset_kind() -> None:
    assert shard_loader(
        rank_ctx(2, 1), DataLoader(SizedStream(4), batch_size=2)
    ).dispatch_batches
    assert not shard_loader(
        rank_ctx(2, 1), DataLoader(SizedStream(4), batch_size=2), put_on_device=False
    ).dispatch_batches
    assert not shard_loader(
        rank_ctx(2, 1), DataLoader(Indexed(4), batch_size=2)
    ).dispatch_batches
    assert shard_loader(
        rank_ctx(2, 1), DataLoader(Indexed(4), batch_size=2), dispatch_batches=True
    ).dispatch_batches
    one = shard_loader(
        rank_ctx(1), DataLoader(SizedStream(4), batch_size=2), dispatch_batches=True
    )
    assert not one.dispatch_batches and [x.tolist() for x in one] == [[0, 1], [2, 3]]


def test_loader_properties_and_repr() -> None:
    dataloader = DataLoader(Indexed(4), batch_size=2)
    loader = shard_loader(
        rank_ctx(2, 1), dataloader, split_batches=True, seed=5, even_batches=False
    )
    assert loader.dataloader is dataloader and loader.dataset is dataloader.dataset
    assert loader.ctx == rank_ctx(2, 1)
    assert (
        loader.split_batches,
        loader.even_batches,
        loader.put_on_device,
        loader.seed,
    ) == (True, False, True, 5)
    assert loader.rng_types == ()
    assert (
        repr(loader)
        == "ShardedLoader(rank=1/2, total_batch_size=2, epoch=0, dispatch_batches=False)"
    )


# --------------------------------------------------- real processes (gloo)


def _rng_and_workers(ctx: DistributedContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    torch.manual_seed(100 + ctx.process_index)  # differently seeded ranks
    plain = shard_loader(ctx, DataLoader(Indexed(8), batch_size=2))
    next(iter(plain))
    out["unsynced"] = torch.rand(1).item()
    for dispatch in (False, True):
        torch.manual_seed(100 + ctx.process_index)
        synced = shard_loader(
            ctx,
            DataLoader(Indexed(8), batch_size=2),
            rng_types=("torch",),
            dispatch_batches=dispatch,
        )
        next(iter(iter_batches(synced)))
        out[f"synced-{dispatch}"] = torch.rand(1).item()
    # A sampler with its own generator, seeded differently per rank: the shards only
    # partition the data when "generator" is synchronised from rank 0.
    generator = torch.Generator()
    generator.manual_seed(ctx.process_index)
    sampler = SubsetRandomSampler(list(range(12)), generator=generator)
    loader = shard_loader(
        ctx,
        DataLoader(Indexed(12), batch_size=3, sampler=sampler),
        rng_types=["generator"],
    )
    out["subset"] = [i for batch in loader for i in batch.tolist()]
    # "fork": the default start method in these workers is the fork server, which
    # would re-import torch for the loader's workers (tens of seconds on CI).
    workers = DataLoader(
        Indexed(10),
        batch_size=3,
        shuffle=True,
        num_workers=2,
        multiprocessing_context="fork",
    )
    out["workers"] = [x.tolist() for x in shard_loader(ctx, workers, seed=42)]
    return out


@pytest.mark.distributed
def test_rng_sync_and_worker_processes_over_gloo() -> None:
    rank0, rank1 = run_ranks(_rng_and_workers, 2, start_method="forkserver")
    assert rank0["unsynced"] != rank1["unsynced"]  # the control
    assert rank0["synced-False"] == rank1["synced-False"]
    assert rank0["synced-True"] == rank1["synced-True"]
    assert sorted(rank0["subset"] + rank1["subset"]) == list(range(12))
    order = seeded_order(10, 42)
    expected = [
        [order[0:3], order[6:9]],
        [order[3:6], [order[9], *order[0:2]]],
    ]
    assert [rank0["workers"], rank1["workers"]] == expected


def _outcome(call: Any) -> Any:
    """``call()``'s value, or the type and text of the error it raised."""
    try:
        return call()
    except (TypeError, ValueError, RuntimeError) as error:
        return (type(error).__name__, str(error))


def _seams(ctx: DistributedContext) -> dict[str, Any]:
    """What a script ported from Accelerate could get silently wrong, per rank."""
    world = ctx.num_processes
    out: dict[str, Any] = {}
    # Drop-in iteration over epochs, as in `for epoch in range(3): for x in loader`.
    shuffled = shard_loader(
        ctx,
        DataLoader(Indexed(10), batch_size=2, shuffle=True),
        seed=7,
        rng_types=["torch"],
    )
    out["epochs"] = [[x.tolist() for x in shuffled] for _ in range(3)]
    out["epoch after"] = shuffled.epoch
    # A generator given to the DataLoader.
    for seed in (4, 5):
        out[f"generator {seed}"] = _outcome(
            lambda s=seed: repr(
                shard_loader(
                    ctx,
                    DataLoader(
                        Indexed(6), batch_size=2, shuffle=True, generator=_seeded(s)
                    ),
                )
            )
        )
    # Resume states up to and past the end: ranks of different lengths (uneven),
    # an unsized stream that rank 0 dispatches, and sized data rank 0 dispatches.
    loaders = {
        "uneven": shard_loader(
            ctx, DataLoader(Indexed(7), batch_size=2), even_batches=False
        ),
        "dispatch stream": shard_loader(ctx, DataLoader(Stream(10), batch_size=2)),
        "dispatch sized": shard_loader(
            ctx, DataLoader(Indexed(10), batch_size=2), dispatch_batches=True
        ),
    }
    for name, loader in loaders.items():
        for consumed in range(5):
            state = LoaderState(global_batches=consumed, global_batch_size=2 * world)
            out[f"{name} {consumed}"] = _outcome(
                lambda lo=loader, st=state: as_lists(list(iter_batches(lo, st)))
            )
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_a_ported_loop_gets_the_right_numbers_or_an_error_on_every_rank(
    world: int,
) -> None:
    ranks = run_ranks(_seams, world, start_method="forkserver")

    def make() -> DataLoader[torch.Tensor]:
        return DataLoader(Indexed(10), batch_size=2, shuffle=True)

    # Each `for` loop is the next epoch: the order iter_batches gives epoch e.
    for epoch in range(3):
        expected = all_ranks(world, make, LoaderState(epoch=epoch), seed=7)
        for rank, got in enumerate(ranks):
            assert got["epochs"][epoch] == as_lists(expected[rank]), (rank, epoch)
    first = [got["epochs"] for got in ranks]
    assert first[0][0] != first[0][1] != first[0][2] != first[0][0]
    assert all(got["epoch after"] == 3 for got in ranks)
    # The generator is refused on every rank, naming the seed to pass instead.
    for seed in (4, 5):
        for got in ranks:
            assert isinstance(got[f"generator {seed}"], tuple), got[f"generator {seed}"]
            kind, message = got[f"generator {seed}"]
            assert kind == "ValueError"
            assert message.startswith(
                f"shard_loader: the DataLoader has a generator (initial seed {seed}), "
                "which a sharded loader does not use"
            )
            assert message.endswith(f"(seed={seed}).")
    # Resume: up to the end, the rest of the uninterrupted epoch; past it, an error
    # on every rank.
    sizes = {"uneven": 7, "dispatch stream": 10, "dispatch sized": 10}
    lengths = {
        "uneven": -(-4 // world),  # 4 base batches, rank 0 has the most
        "dispatch stream": -(-5 // world),  # 5 base batches, p per global batch
        "dispatch sized": -(-5 // world),
    }
    for name, length in lengths.items():
        n = sizes[name]
        for consumed in range(5):
            outcomes = [got[f"{name} {consumed}"] for got in ranks]
            if consumed <= length:
                assert all(isinstance(o, list) for o in outcomes), (name, outcomes)
                if name == "uneven":
                    full = all_ranks(
                        world,
                        lambda: DataLoader(Indexed(n), batch_size=2),
                        even_batches=False,
                    )
                    assert outcomes == [as_lists(r[consumed:]) for r in full]
                continue
            state = LoaderState(global_batches=consumed, global_batch_size=2 * world)
            named = "the state" if name == "dispatch stream" else repr(state)
            expected_text = (
                f"iter_batches: {named} is {consumed} global batches of {2 * world} "
                f"samples into epoch 0, past the end of the epoch: this loader's "
                f"epoch has {length} global batches (len(loader) on rank 0)."
            )
            for rank, outcome in enumerate(outcomes):
                kind, message = outcome
                # Dispatch: rank 0 finds the end while reading and raises; the
                # others get its error as a RuntimeError instead of waiting.
                relayed = name == "dispatch stream" and rank > 0
                assert kind == ("RuntimeError" if relayed else "ValueError")
                assert expected_text in message, (name, rank, message)


class WorkerSeed(Dataset[int]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> int:
        return torch.initial_seed()


def test_loader_seeds_workers_per_epoch_not_from_the_global_rng() -> None:
    loader = shard_loader(
        rank_ctx(1),
        DataLoader(WorkerSeed(), batch_size=2, num_workers=1, collate_fn=list),
        seed=11,
    )
    torch.manual_seed(5)  # the workers' seeds must not depend on it
    seeds = [
        list(iter_batches(loader, LoaderState(epoch=e)))[0].data for e in (0, 0, 1)
    ]
    assert seeds[0] == seeds[1] != seeds[2]
    after = torch.get_rng_state()
    # The global generator moved only by a DataLoader's draw per iter():
    # docs/loader.md#draws-from-torchs-global-generator.
    torch.manual_seed(5)
    for _ in range(3):
        torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(torch.get_rng_state(), after)


# ------------------------------------------------------------- send_to_device

META = torch.device("meta")


class Point(NamedTuple):
    x: torch.Tensor
    label: str


@dataclasses.dataclass(frozen=True)
class Sample:
    features: torch.Tensor
    meta: dict[str, Any]
    derived: int = dataclasses.field(init=False, default=7)


class Movable:
    """An object with its own ``.to``, recording the calls."""

    def __init__(self, *, accepts_non_blocking: bool) -> None:
        self.accepts = accepts_non_blocking
        self.calls: list[tuple[Any, ...]] = []

    def to(self, device: torch.device, **kwargs: Any) -> str:
        if kwargs and not self.accepts:
            raise TypeError("to() got an unexpected keyword argument 'non_blocking'")
        self.calls.append((device, *kwargs.items()))
        return f"moved to {device}"


class Rows(list[Any]):
    """A list subclass with a constructor of its own."""

    def __init__(self, name: str, items: Sequence[Any]) -> None:
        super().__init__(items)
        self.name = name


def test_send_to_device_rebuilds_containers_and_moves_tensors() -> None:
    tensor = torch.arange(3)
    factory: defaultdict[str, list[int]] = defaultdict(list)
    factory["t"] = tensor  # type: ignore[assignment]
    batch: dict[str, Any] = {
        "tuple": (tensor, "a"),
        "point": Point(tensor, "p"),
        "ordered": OrderedDict(t=tensor),
        "factory": factory,
        "frozen": MappingProxyType({"t": tensor}),
        "sample": Sample(tensor, {"t": tensor}),
        "rows": Rows("r", [tensor, 1]),
        "other": [None, 3.5, "s"],
    }
    moved = send_to_device(batch, META)
    assert moved["tuple"][0].device == META and moved["tuple"][1] == "a"
    assert type(moved["point"]) is Point and moved["point"].x.device == META
    assert (
        type(moved["ordered"]) is OrderedDict and moved["ordered"]["t"].device == META
    )
    assert (
        moved["factory"].default_factory is list
        and moved["factory"]["t"].device == META
    )
    assert (
        type(moved["frozen"]) is MappingProxyType
        and moved["frozen"]["t"].device == META
    )
    assert (
        moved["sample"].features.device == META
        and moved["sample"].meta["t"].device == META
    )
    assert moved["sample"].derived == 7
    assert type(moved["rows"]) is Rows and moved["rows"].name == "r"
    assert moved["rows"][0].device == META and moved["rows"][1] == 1
    assert moved["other"] == [None, 3.5, "s"]
    # The input is unchanged.
    assert batch["tuple"][0] is tensor and batch["rows"][0] is tensor
    assert factory["t"] is tensor and batch["sample"].features is tensor


@pytest.mark.parametrize("accepts", [True, False])
def test_send_to_device_calls_to_on_other_objects(accepts: bool) -> None:
    obj = Movable(accepts_non_blocking=accepts)
    blocking_result: Any = send_to_device([obj], "meta")
    assert blocking_result == ["moved to meta"]
    result: Any = send_to_device({"o": obj}, "meta", non_blocking=True)
    assert result == {"o": "moved to meta"}
    blocking = (META,)
    assert obj.calls == [
        blocking,
        (META, ("non_blocking", True)) if accepts else blocking,
    ]


def test_send_to_device_rejects_bad_arguments() -> None:
    with pytest.raises(
        TypeError,
        match=r"send_to_device: device must be a torch.device or a str; got 0",
    ):
        send_to_device(torch.zeros(1), 0)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"send_to_device: non_blocking must be a bool; got 1"
    ):
        send_to_device(torch.zeros(1), "cpu", non_blocking=1)  # type: ignore[arg-type]


nested = st.recursive(
    st.one_of(
        st.integers(),
        st.text(max_size=2),
        st.none(),
        st.integers(0, 3).map(lambda k: torch.arange(k)),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
    ),
    max_leaves=10,
)


def _shape(data: Any) -> Any:
    """The structure with tensors replaced by their device and values."""
    if isinstance(data, torch.Tensor):
        return ("tensor", data.device.type, tuple(data.shape))
    if isinstance(data, dict):
        return {k: _shape(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_shape(v) for v in data)
    return data


@given(nested, st.booleans())
def test_send_to_device_keeps_structure_and_input(
    data: Any, non_blocking: bool
) -> None:
    before = _shape(data)
    moved = send_to_device(data, META, non_blocking=non_blocking)
    assert _shape(data) == before  # unchanged input
    expected = json.loads(json.dumps(before).replace('"cpu"', '"meta"'))
    assert json.loads(json.dumps(_shape(moved))) == expected


@given(
    n=st.integers(1, 70),
    num_samples=st.none() | st.integers(1, 150),
    replacement=st.booleans(),
    seed=st.integers(0, 2**32),
)
def test_seeded_order_is_torch_random_sampler_order(
    n: int, num_samples: int | None, replacement: bool, seed: int
) -> None:
    sampler = RandomSampler(range(n), replacement=replacement, num_samples=num_samples)
    expected = seeded_order_of_torch(n, seed, replacement, num_samples)
    assert _indices.seeded_order(sampler, seed) == expected


def seeded_order_of_torch(
    n: int, seed: int, replacement: bool, num_samples: int | None
) -> list[int]:
    generator = torch.Generator()
    generator.manual_seed(seed)
    sampler = RandomSampler(
        range(n), replacement=replacement, num_samples=num_samples, generator=generator
    )
    return list(sampler)


def test_make_batch_builds_the_same_record_as_batch() -> None:
    made = _state.make_batch([1], 3, False, 4, 2, None)
    built = Batch(
        data=[1], index=3, is_last=False, remainder=4, epoch=2, total_batch_size=None
    )
    assert made == built and repr(made) == repr(built) and made.state == built.state
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.index = 5  # type: ignore[misc]


ORACLE_GRID = [
    (n, bs, p, split, even, drop_last, kind)
    for n in (0, 1, 7, 10, 13)
    for bs in (1, 2, 4)
    for p in (2, 3)
    for split in (False, True)
    for even in (False, True)
    for drop_last in (False, True)
    for kind in ("map", "iterable")
    if not (split and bs % p) and not (kind == "iterable" and not even)
]


@pytest.mark.parametrize(
    ("n", "bs", "p", "split", "even", "drop_last", "kind"), ORACLE_GRID
)
def test_same_batches_as_accelerate(
    n: int, bs: int, p: int, split: bool, even: bool, drop_last: bool, kind: str
) -> None:
    """Optional: Accelerate 1.15's loaders yield the same batches.

    The rules: docs/loader.md#semantics-building-a-sharded-loader.
    """
    oracle = pytest.importorskip("accelerate.data_loader")
    for rank in range(p):
        theirs = oracle.prepare_data_loader(
            DataLoader(make_data(kind, n), batch_size=bs, drop_last=drop_last),
            device=torch.device("cpu"),
            num_processes=p,
            process_index=rank,
            split_batches=split,
            put_on_device=False,
            even_batches=even,
            dispatch_batches=False,
        )
        ours = shard_loader(
            rank_ctx(p, rank),
            DataLoader(make_data(kind, n), batch_size=bs, drop_last=drop_last),
            split_batches=split,
            even_batches=even,
            dispatch_batches=False,
        )
        assert [x.tolist() for x in ours] == [x.tolist() for x in theirs]


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 42])
def test_same_shuffled_order_as_accelerate_seedable_sampler(p: int, seed: int) -> None:
    """Optional: Accelerate 1.15's seedable sampler draws the same epochs."""
    oracle = pytest.importorskip("accelerate.data_loader")
    for rank in range(p):
        theirs = oracle.prepare_data_loader(
            DataLoader(Indexed(11), batch_size=2, shuffle=True),
            device=torch.device("cpu"),
            num_processes=p,
            process_index=rank,
            put_on_device=False,
            use_seedable_sampler=True,
            data_seed=seed,
        )
        ours = shard_loader(
            rank_ctx(p, rank),
            DataLoader(Indexed(11), batch_size=2, shuffle=True),
            seed=seed,
        )
        for epoch in (0, 1, 2):
            theirs.set_epoch(epoch)
            ours.set_epoch(epoch)
            assert [x.tolist() for x in ours] == [x.tolist() for x in theirs]


# ------------------------------------------------------------ with a GPU only

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_batches_reach_the_gpu_from_pinned_memory() -> None:
    ctx = DistributedContext(device=torch.device("cuda", 0))
    dataloader = DataLoader(Indexed(5), batch_size=2, pin_memory=True)
    loader = shard_loader(ctx, dataloader, non_blocking=True, rng_types=("cuda",))
    got = [(x.device.type, x.tolist()) for x in loader]
    assert got == [("cuda", [0, 1]), ("cuda", [2, 3]), ("cuda", [4])]


def _on_gpu(ctx: DistributedContext) -> dict[str, Any]:
    ctx = dataclasses.replace(
        ctx, device=torch.device("cuda", 0), distributed_type=DistributedType.MULTI_GPU
    )
    torch.manual_seed(10 + ctx.process_index)
    torch.cuda.manual_seed(20 + ctx.process_index)
    loader = shard_loader(
        ctx, DataLoader(Indexed(8), batch_size=2), rng_types=("torch", "cuda")
    )
    first = next(iter_batches(loader))
    out: dict[str, Any] = {
        "device": str(first.data.device),
        "rand": (torch.rand(1).item(), torch.rand(1, device="cuda").item()),
    }
    for kind, data in (("map", Indexed(9)), ("iterable", SizedStream(9))):
        dataloader = DataLoader(data, batch_size=2, pin_memory=True)
        dispatched = shard_loader(
            ctx, dataloader, dispatch_batches=True, non_blocking=True
        )
        out[kind] = [
            (b.data.device.type, b.data.tolist(), b.remainder)
            for b in iter_batches(dispatched)
        ]
    return out


@needs_cuda
@pytest.mark.distributed
def test_cuda_rng_sync_and_dispatch_onto_the_gpu_over_gloo() -> None:
    ranks = run_ranks(_on_gpu, 2, start_method="forkserver")
    assert ranks[0]["rand"] == ranks[1]["rand"]
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:0"]
    expected = [[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [0]]]
    for rank, result in enumerate(ranks):
        for kind in ("map", "iterable"):
            assert [row[1] for row in result[kind]] == expected[rank]
            assert [(row[0], row[2]) for row in result[kind]] == [
                ("cuda", -1),
                ("cuda", -1),
                ("cuda", 1),
            ]


# ------------------------------------------ a BatchSampler given as the sampler


def _as_sampler(n: int, bs: int, *, shuffle: bool, drop_last: bool) -> DataLoader[Any]:
    """``DataLoader(sampler=BatchSampler(...), batch_size=None)``: whole index lists."""
    data = TensorDataset(torch.arange(n) * 10)
    inner: Sampler[int] = RandomSampler(data) if shuffle else SequentialSampler(data)
    return DataLoader(data, sampler=BatchSampler(inner, bs, drop_last), batch_size=None)


@pytest.mark.parametrize("p", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(
    "options",
    [{}, {"split_batches": True}, {"even_batches": False}],
    ids=["even", "split", "uneven"],
)
@given(n=st.integers(0, 13), drop_last=st.booleans(), k=st.integers(1, 3))
def test_a_batch_sampler_given_as_sampler_shards_like_batch_size(
    p: int, shuffle: bool, options: dict[str, Any], n: int, drop_last: bool, k: int
) -> None:
    assume(n > 0 or not shuffle)  # torch's RandomSampler refuses empty data
    bs = k * p if options.get("split_batches") else k
    plain = TensorDataset(torch.arange(n) * 10)
    for rank in range(p):
        ctx = rank_ctx(p, rank)
        given_loader = shard_loader(
            ctx,
            _as_sampler(n, bs, shuffle=shuffle, drop_last=drop_last),
            seed=3,
            **options,
        )
        reference = shard_loader(
            ctx,
            DataLoader(plain, batch_size=bs, shuffle=shuffle, drop_last=drop_last),
            seed=3,
            **options,
        )
        assert given_loader.total_batch_size == reference.total_batch_size
        for epoch in (0, 1):
            state = LoaderState(epoch=epoch)
            got = [b.data[0].tolist() for b in iter_batches(given_loader, state)]
            want = [b.data[0].tolist() for b in iter_batches(reference, state)]
            assert got == want
            remainders = [b.remainder for b in iter_batches(given_loader, state)]
            assert remainders == [b.remainder for b in iter_batches(reference, state)]
        assert len(given_loader) == len(reference)


def test_a_batch_sampler_given_as_sampler_with_a_generator_is_refused() -> None:
    data = TensorDataset(torch.arange(4))
    sampler = BatchSampler(
        RandomSampler(data, generator=torch.Generator().manual_seed(5)), 2, False
    )
    with pytest.raises(ValueError, match=r"pass the seed to shard_loader instead"):
        shard_loader(rank_ctx(2, 0), DataLoader(data, sampler=sampler, batch_size=None))
