"""Tests for ``funcaccel.sharding``: the rules and tables, errors and properties.

The rules are docs/sharding.md#semantics-sharding-a-batch-sampler and
docs/sharding.md#semantics-sharding-an-iterable-dataset.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from collections import Counter
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from types import ModuleType
from typing import Any
from typing import overload

import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset
from torch.utils.data import SequentialSampler
from torch.utils.data import TensorDataset

from funcaccel.sharding import ShardedBatchSampler
from funcaccel.sharding import ShardedIterableDataset
from funcaccel.sharding import shard_batch_sampler
from funcaccel.sharding import shard_iterable_dataset
from tests.strategies import ListBatchSampler
from tests.strategies import ShardCase
from tests.strategies import dynamic_batches
from tests.strategies import shard_cases

Batches = list[list[int]]


def sequential_base(
    n: int, batch_size: int, *, drop_last: bool = False
) -> BatchSampler:
    return BatchSampler(SequentialSampler(range(n)), batch_size, drop_last)


def all_ranks(
    base: Iterable[Sequence[int]],
    num_processes: int,
    *,
    split_batches: bool = False,
    even_batches: bool = True,
) -> list[ShardedBatchSampler]:
    return [
        shard_batch_sampler(
            base,
            num_processes=num_processes,
            process_index=rank,
            split_batches=split_batches,
            even_batches=even_batches,
        )
        for rank in range(num_processes)
    ]


def spec_shards(
    batches: Batches,
    batch_size: int | None,
    num_processes: int,
    *,
    split_batches: bool,
    even_batches: bool,
    drop_last: bool,
) -> list[Batches]:
    """The batch-sampler rules, transcribed literally over materialised base batches.

    The test oracle: docs/sharding.md#semantics-sharding-a-batch-sampler.
    """
    p, k = num_processes, len(batches)
    out: list[Batches] = [[] for _ in range(p)]

    def full(batch: list[int]) -> bool:
        return batch_size is None or len(batch) == batch_size

    if split_batches:
        assert batch_size is not None
        width = batch_size // p
        for batch in batches:
            if full(batch):
                piece = batch
            elif even_batches:
                pad = batch_size - len(batch)
                piece = batch + list(itertools.islice(itertools.cycle(batches[0]), pad))
            else:
                piece = batch
            for i in range(p):
                if len(piece) > i * width:
                    out[i].append(piece[i * width : (i + 1) * width])
        return out
    rounds = k // p
    if k > 0 and k % p == 0 and not full(batches[-1]):
        rounds -= 1
    for r in range(rounds):
        for i in range(p):
            out[i].append(batches[r * p + i])
    tail = batches[rounds * p :]
    if not tail or drop_last:
        return out
    if not even_batches:
        for i, batch in enumerate(tail):
            out[i].append(batch)
        return out
    head = batches[: min(p, k)]
    if batch_size is None:
        for j in range(p):
            out[j].append(
                tail[j] if j < len(tail) else head[(j - len(tail)) % len(head)]
            )
        return out
    fill = itertools.cycle([index for batch in head for index in batch])
    for j in range(p):
        if j < len(tail) and full(tail[j]):
            out[j].append(tail[j])
        elif j < len(tail):
            draw = batch_size - len(tail[j])
            out[j].append(tail[j] + [next(fill) for _ in range(draw)])
        else:
            out[j].append([next(fill) for _ in range(batch_size)])
    return out


# --- docs/sharding.md#worked-examples-batch-sampler-rank-by-rank, row by row ----

# mode -> (even_batches, drop_last) pairs it stands for
MODES: dict[str, list[tuple[bool, bool]]] = {
    "even": [(True, False)],
    "uneven": [(False, False)],
    "drop_last": [(True, True), (False, True)],
    "any": [(True, False), (False, False), (True, True), (False, True)],
}

# (n, bs, p, split_batches, mode, batches per rank); len per rank = batches listed
TABLE_2_1: list[tuple[int, int, int, bool, str, list[Batches]]] = [
    (10, 3, 2, False, "even", [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]),
    (10, 3, 2, False, "uneven", [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]),
    (10, 3, 2, False, "drop_last", [[[0, 1, 2]], [[3, 4, 5]]]),
    (12, 3, 2, False, "even", [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 10, 11]]]),
    (9, 2, 2, False, "even", [[[0, 1], [4, 5], [8, 0]], [[2, 3], [6, 7], [1, 2]]]),
    (8, 2, 3, False, "even", [[[0, 1], [6, 7]], [[2, 3], [0, 1]], [[4, 5], [2, 3]]]),
    (7, 2, 3, False, "even", [[[0, 1], [6, 0]], [[2, 3], [1, 2]], [[4, 5], [3, 4]]]),
    (7, 2, 3, False, "uneven", [[[0, 1], [6]], [[2, 3]], [[4, 5]]]),
    (
        13,
        2,
        4,
        False,
        "even",
        [[[0, 1], [8, 9]], [[2, 3], [10, 11]], [[4, 5], [12, 0]], [[6, 7], [1, 2]]],
    ),
    (2, 3, 2, False, "even", [[[0, 1, 0]], [[1, 0, 1]]]),
    (2, 3, 2, False, "uneven", [[[0, 1]], []]),
    (2, 3, 2, False, "drop_last", [[], []]),
    (1, 4, 4, False, "even", [[[0, 0, 0, 0]]] * 4),
    (
        3,
        8,
        4,
        False,
        "even",
        [
            [[0, 1, 2, 0, 1, 2, 0, 1]],
            [[2, 0, 1, 2, 0, 1, 2, 0]],
            [[1, 2, 0, 1, 2, 0, 1, 2]],
            [[0, 1, 2, 0, 1, 2, 0, 1]],
        ],
    ),
    (0, 2, 3, False, "any", [[], [], []]),
    (5, 2, 1, False, "even", [[[0, 1], [2, 3], [4, 0]]]),
    (5, 2, 1, False, "uneven", [[[0, 1], [2, 3], [4]]]),
    (10, 4, 2, True, "even", [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]),
    (10, 4, 2, True, "uneven", [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7]]]),
    (10, 4, 2, True, "drop_last", [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]),
    (9, 4, 2, True, "even", [[[0, 1], [4, 5], [8, 0]], [[2, 3], [6, 7], [1, 2]]]),
    (3, 4, 4, True, "even", [[[0]], [[1]], [[2]], [[0]]]),
    (3, 4, 4, True, "uneven", [[[0]], [[1]], [[2]], []]),
    (6, 4, 2, True, "drop_last", [[[0, 1]], [[2, 3]]]),
    (2, 4, 2, True, "even", [[[0, 1]], [[0, 1]]]),
    (1, 2, 2, True, "uneven", [[[0]], []]),
    (5, 2, 1, True, "even", [[[0, 1], [2, 3], [4, 0]]]),
    (0, 4, 2, True, "any", [[], []]),  # not in the table: empty base, split
]

TABLE_2_1_CASES = [
    pytest.param(
        n,
        bs,
        p,
        split,
        even,
        drop,
        expected,
        id=f"{n}-{bs}-{p}-{'split-' * split}{mode}-even={even}",
    )
    for n, bs, p, split, mode, expected in TABLE_2_1
    for even, drop in MODES[mode]
]


@pytest.mark.parametrize(
    ("n", "bs", "p", "split", "even", "drop_last", "expected"), TABLE_2_1_CASES
)
def test_shard_batch_sampler_matches_spec_table(
    n: int,
    bs: int,
    p: int,
    split: bool,
    even: bool,
    drop_last: bool,
    expected: list[Batches],
) -> None:
    base = sequential_base(n, bs, drop_last=drop_last)
    shards = all_ranks(base, p, split_batches=split, even_batches=even)
    assert [list(shard) for shard in shards] == expected
    assert [len(shard) for shard in shards] == [len(batches) for batches in expected]
    # A second epoch is identical: the shard keeps no iteration state.
    assert [list(shard) for shard in shards] == expected


@pytest.mark.parametrize("bs", [3, 1])
def test_shard_batch_sampler_split_needs_batch_size_multiple_of_p(bs: int) -> None:
    msg = (
        f"shard_batch_sampler: batch_size ({bs}) must be a multiple of num_processes (2) "
        f"when split_batches=True; use a batch size divisible by 2 or split_batches=False."
    )
    with pytest.raises(ValueError) as info:
        shard_batch_sampler(
            sequential_base(10, bs),
            num_processes=2,
            process_index=0,
            split_batches=True,
        )
    assert str(info.value) == msg


def test_sharded_batch_sampler_constructor_validates_too() -> None:
    with pytest.raises(ValueError, match=r"^ShardedBatchSampler: batch_size \(3\)"):
        ShardedBatchSampler(
            batch_sampler=sequential_base(10, 3),
            num_processes=2,
            process_index=0,
            split_batches=True,
        )


@pytest.mark.parametrize(
    ("num_processes", "process_index", "error", "pattern"),
    [
        (0, 0, ValueError, r"num_processes \(0\) must be >= 1"),
        (-2, 0, ValueError, r"num_processes \(-2\) must be >= 1"),
        (2, -1, ValueError, r"process_index \(-1\) must be >= 0"),
        (4, 4, ValueError, r"process_index \(4\) must be in \[0, num_processes=4\)"),
        (2.0, 0, TypeError, r"num_processes must be an int; got 2\.0"),
        (True, 0, TypeError, r"num_processes must be an int; got True"),
        (2, "1", TypeError, r"process_index must be an int; got '1'"),
    ],
)
def test_shard_functions_reject_bad_world(
    num_processes: Any, process_index: Any, error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=r"^shard_batch_sampler: " + pattern):
        shard_batch_sampler(
            sequential_base(4, 2),
            num_processes=num_processes,
            process_index=process_index,
        )
    with pytest.raises(error, match=r"^shard_iterable_dataset: " + pattern):
        shard_iterable_dataset(
            range(4),
            num_processes=num_processes,
            process_index=process_index,
        )


def test_shard_batch_sampler_rejects_bad_base() -> None:
    not_iterable: Any = 42
    yes: Any = "yes"
    one: Any = 1
    with pytest.raises(
        TypeError, match=r"^shard_batch_sampler: batch_sampler must be an iterable"
    ):
        shard_batch_sampler(not_iterable, num_processes=1, process_index=0)
    zero = ListBatchSampler([[0]], batch_size=0)
    with pytest.raises(
        ValueError, match=r"batch_sampler\.batch_size \(0\) must be >= 1"
    ):
        shard_batch_sampler(zero, num_processes=1, process_index=0)
    odd = ListBatchSampler([[0]], batch_size=2)
    odd.drop_last = yes
    with pytest.raises(
        TypeError, match=r"batch_sampler\.drop_last must be a bool; got 'yes'"
    ):
        shard_batch_sampler(odd, num_processes=1, process_index=0)
    with pytest.raises(TypeError, match=r"even_batches must be a bool; got 1"):
        shard_batch_sampler(
            sequential_base(4, 2),
            num_processes=1,
            process_index=0,
            even_batches=one,
        )


def test_sharded_batch_sampler_is_a_frozen_sampler_with_its_options() -> None:
    base = sequential_base(10, 3)
    shard = shard_batch_sampler(
        base, num_processes=2, process_index=1, even_batches=False
    )
    assert isinstance(shard, torch.utils.data.Sampler)
    assert shard.batch_sampler is base
    assert (shard.batch_size, shard.drop_last) == (3, False)
    assert (shard.num_processes, shard.process_index) == (2, 1)
    assert (shard.split_batches, shard.even_batches) == (False, False)
    assert shard.total_batch_size == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.process_index = 0  # type: ignore[misc]
    assert shard == shard_batch_sampler(
        base, num_processes=2, process_index=1, even_batches=False
    )
    assert list(base) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]  # base unchanged


def test_replace_gives_another_rank_and_revalidates() -> None:
    shard = shard_batch_sampler(
        sequential_base(10, 3), num_processes=2, process_index=0
    )
    assert list(dataclasses.replace(shard, process_index=1)) == [[3, 4, 5], [9, 0, 1]]
    with pytest.raises(ValueError, match=r"^ShardedBatchSampler: process_index \(2\)"):
        dataclasses.replace(shard, process_index=2)
    stream = shard_iterable_dataset(range(5), batch_size=2, num_processes=2)
    assert list(dataclasses.replace(stream, process_index=1)) == [2, 3, 1, 2]


def test_split_shard_reports_the_global_batch_size() -> None:
    shard = shard_batch_sampler(
        sequential_base(10, 4), num_processes=2, process_index=0, split_batches=True
    )
    assert shard.total_batch_size == 4


def test_sharded_batch_sampler_feeds_a_dataloader_and_pickles() -> None:
    data = TensorDataset(torch.arange(10) * 10)
    shard = shard_batch_sampler(
        sequential_base(10, 3), num_processes=2, process_index=1
    )
    loader = DataLoader(data, batch_sampler=shard)
    batches = [batch.tolist() for (batch,) in loader]
    assert len(loader) == 2
    assert batches == [[30, 40, 50], [90, 0, 10]]
    copy = pickle.loads(pickle.dumps(shard))
    assert list(copy) == list(shard) and len(copy) == len(shard)


def test_shard_batch_sampler_len_needs_a_sized_base() -> None:
    class Unsized:
        batch_size = 2

        def __iter__(self) -> Iterator[list[int]]:
            return iter([[0, 1], [2]])

    shard = shard_batch_sampler(Unsized(), num_processes=2, process_index=0)
    assert list(shard) == [
        [0, 1]
    ]  # positions 0/1 of the only round; rank 1 gets [2, 0]
    with pytest.raises(
        TypeError,
        match=r"^ShardedBatchSampler.__len__: the base batch sampler \(Unsized\) has no len",
    ):
        len(shard)


def test_split_len_without_torch_sampler_walks_the_base_once() -> None:
    base = ListBatchSampler([[0, 1, 2, 3], [4, 5, 6, 7], [8]], batch_size=4)
    shards = all_ranks(base, 4, split_batches=True, even_batches=False)
    assert [len(shard) for shard in shards] == [3, 2, 2, 2]
    assert [len(list(shard)) for shard in shards] == [3, 2, 2, 2]


# --- dynamic batch samplers ------------------------------------------------------

DYNAMIC = [[0], [1, 2], [3, 4, 5], [6]]


@pytest.mark.parametrize(
    ("p", "even", "drop_last", "expected"),
    [
        (3, True, False, [[[0], [6]], [[1, 2], [0]], [[3, 4, 5], [1, 2]]]),
        (3, False, False, [[[0], [6]], [[1, 2]], [[3, 4, 5]]]),
        (3, True, True, [[[0]], [[1, 2]], [[3, 4, 5]]]),
        (2, True, False, [[[0], [3, 4, 5]], [[1, 2], [6]]]),
        (5, True, False, [[[0]], [[1, 2]], [[3, 4, 5]], [[6]], [[0]]]),
        (6, True, False, [[[0]], [[1, 2]], [[3, 4, 5]], [[6]], [[0]], [[1, 2]]]),
    ],
)
def test_dynamic_batch_sampler_takes_whole_batches_from_the_first_round(
    p: int, even: bool, drop_last: bool, expected: list[Batches]
) -> None:
    base = ListBatchSampler(DYNAMIC, batch_size=None, drop_last=drop_last)
    shards = all_ranks(base, p, even_batches=even)
    assert [list(shard) for shard in shards] == expected
    assert [len(shard) for shard in shards] == [len(batches) for batches in expected]
    assert all(shard.total_batch_size is None for shard in shards)


def test_base_without_batch_size_or_drop_last_is_dynamic() -> None:
    shard = shard_batch_sampler([[0, 1], [2], [3, 4]], num_processes=2, process_index=1)
    assert (shard.batch_size, shard.drop_last) == (None, False)
    assert list(shard) == [[2], [0, 1]]


def test_dynamic_batch_sampler_cannot_split() -> None:
    base = ListBatchSampler(DYNAMIC)
    with pytest.raises(
        ValueError,
        match=r"^shard_batch_sampler: batch_size \(None\) must be a multiple",
    ):
        shard_batch_sampler(base, num_processes=2, process_index=0, split_batches=True)


# --- resuming: iter_from ---------------------------------------------------------


@pytest.mark.parametrize(
    ("split", "even"), list(itertools.product([False, True], repeat=2))
)
def test_iter_from_equals_dropping_the_first_batches(split: bool, even: bool) -> None:
    base = ListBatchSampler([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], batch_size=4)
    for shard in all_ranks(base, 2, split_batches=split, even_batches=even):
        whole = list(shard)
        for skip in range(len(whole) + 2):
            before = base.iterations
            assert list(shard.iter_from(skip)) == whole[skip:]
            assert base.iterations == before + 1  # one pass over the base per epoch


def test_iter_from_rejects_negative_skip() -> None:
    shard = shard_batch_sampler(sequential_base(4, 2), num_processes=1, process_index=0)
    with pytest.raises(
        ValueError, match=r"^ShardedBatchSampler.iter_from: skip \(-1\) must be >= 0"
    ):
        shard.iter_from(-1)


class SliceCounting(Sequence[int]):
    """An index list that counts how often it is sliced (a split shard's per-batch work)."""

    def __init__(self, indices: list[int], log: list[int]) -> None:
        self.indices, self.log = indices, log

    def __len__(self) -> int:
        return len(self.indices)

    @overload
    def __getitem__(self, key: int) -> int: ...

    @overload
    def __getitem__(self, key: slice) -> list[int]: ...

    def __getitem__(self, key: int | slice) -> int | list[int]:
        if isinstance(key, slice):
            self.log.append(self.indices[0])
            return self.indices[key]
        return self.indices[key]


def test_iter_from_does_not_slice_skipped_batches() -> None:
    log: list[int] = []
    batches = [SliceCounting([4 * j + t for t in range(4)], log) for j in range(3)]

    class Base:
        batch_size, drop_last = 4, False

        def __iter__(self) -> Iterator[SliceCounting]:
            return iter(batches)

    shard = shard_batch_sampler(
        Base(), num_processes=2, process_index=1, split_batches=True
    )
    assert list(shard.iter_from(2)) == [[10, 11]]
    assert log == [8]  # only the one batch that was yielded was cut


# --- docs/sharding.md#semantics-sharding-an-iterable-dataset ---------------------


class Stream(IterableDataset[int]):
    """``0 .. n-1`` in order, sized; records the epochs given to ``set_epoch``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


# (n, bs, p, split_batches, drop_last, samples per rank)
TABLE_3: list[tuple[int, int, int, bool, bool, list[list[int]]]] = [
    (10, 3, 2, False, False, [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 0, 1]]),
    (10, 3, 2, False, True, [[0, 1, 2], [3, 4, 5]]),
    (2, 3, 2, False, False, [[0, 1, 0], [1, 0, 1]]),
    (7, 2, 3, False, False, [[0, 1, 6, 0], [2, 3, 1, 2], [4, 5, 3, 4]]),
    (
        13,
        2,
        4,
        False,
        False,
        [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 0], [6, 7, 1, 2]],
    ),
    (1, 2, 3, False, False, [[0, 0], [0, 0], [0, 0]]),
    (0, 3, 2, False, False, [[], []]),
    (9, 4, 2, True, False, [[0, 1, 4, 5, 8, 0], [2, 3, 6, 7, 1, 2]]),
    (9, 4, 2, True, True, [[0, 1, 4, 5], [2, 3, 6, 7]]),
    (5, 4, 4, True, False, [[0, 4], [1, 0], [2, 1], [3, 2]]),
    (3, 4, 2, True, False, [[0, 1], [2, 0]]),
]


@pytest.mark.parametrize(("n", "bs", "p", "split", "drop_last", "expected"), TABLE_3)
def test_shard_iterable_dataset_matches_spec_table(
    n: int, bs: int, p: int, split: bool, drop_last: bool, expected: list[list[int]]
) -> None:
    shards = [
        shard_iterable_dataset(
            Stream(n),
            batch_size=bs,
            drop_last=drop_last,
            num_processes=p,
            process_index=rank,
            split_batches=split,
        )
        for rank in range(p)
    ]
    assert [list(shard) for shard in shards] == expected
    assert [len(shard) for shard in shards] == [len(samples) for samples in expected]


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (
            {"batch_size": 1, "num_processes": 2, "split_batches": True},
            ValueError,
            r"batch_size \(1\) must be a multiple of num_processes \(2\) when split_batches=True; use a batch size divisible by 2 or split_batches=False\.$",
        ),
        (
            {"batch_size": 3, "num_processes": 2, "split_batches": True},
            ValueError,
            r"batch_size \(3\) must be a multiple",
        ),
        ({"batch_size": 0}, ValueError, r"batch_size \(0\) must be >= 1"),
        ({"batch_size": None}, TypeError, r"batch_size must be an int; got None"),
        ({"drop_last": None}, TypeError, r"drop_last must be a bool; got None"),
    ],
)
def test_shard_iterable_dataset_rejects_bad_options(
    kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=r"^shard_iterable_dataset: " + pattern):
        shard_iterable_dataset(range(3), **kwargs)
    with pytest.raises(error, match=r"^ShardedIterableDataset: " + pattern):
        ShardedIterableDataset(dataset=range(3), **kwargs)


def test_shard_iterable_dataset_rejects_a_non_iterable() -> None:
    not_iterable: Any = 3
    with pytest.raises(
        TypeError,
        match=r"^shard_iterable_dataset: dataset must be an iterable; got 3 \(int\)",
    ):
        shard_iterable_dataset(not_iterable)


def test_sharded_iterable_dataset_len_needs_a_sized_dataset() -> None:
    shard = shard_iterable_dataset(
        iter(range(5)), batch_size=2, num_processes=2, process_index=1
    )
    with pytest.raises(
        TypeError,
        match=r"^ShardedIterableDataset.__len__: the dataset \(range_iterator\) has no len",
    ):
        len(shard)
    assert list(shard) == [2, 3, 1, 2]  # it still iterates (one pass of the stream)


def test_sharded_iterable_dataset_forwards_set_epoch_and_keeps_options() -> None:
    stream = Stream(5)
    shard = shard_iterable_dataset(
        stream, batch_size=2, num_processes=2, split_batches=True
    )
    assert isinstance(shard, IterableDataset)
    assert (shard.total_batch_size, shard.process_batch_size) == (2, 1)
    shard.set_epoch(3)
    assert stream.epochs == [3]
    shard_iterable_dataset(range(3)).set_epoch(
        1
    )  # no set_epoch on the dataset: nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.batch_size = 4  # type: ignore[misc]


def test_sharded_iterable_dataset_feeds_a_dataloader_and_pickles() -> None:
    shard = shard_iterable_dataset(
        Stream(10), batch_size=3, num_processes=2, process_index=1
    )
    loader = DataLoader(shard, batch_size=shard.process_batch_size)
    assert [batch.tolist() for batch in loader] == [[3, 4, 5], [9, 0, 1]]
    assert len(loader) == 2
    copy = pickle.loads(pickle.dumps(shard))
    assert list(copy) == list(shard)


def test_sharded_iterable_dataset_iter_from() -> None:
    shard = shard_iterable_dataset(
        Stream(10), batch_size=3, num_processes=2, process_index=1
    )
    whole = list(shard)
    for skip in range(len(whole) + 2):
        assert list(shard.iter_from(skip)) == whole[skip:]
    with pytest.raises(
        ValueError, match=r"^ShardedIterableDataset.iter_from: skip \(-3\)"
    ):
        shard.iter_from(-3)


# --- properties ------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(shard_cases())
def test_shards_follow_the_spec_transcription(case: ShardCase) -> None:
    expected = spec_shards(
        case.base_batches(),
        case.batch_size,
        case.num_processes,
        split_batches=case.split_batches,
        even_batches=case.even_batches,
        drop_last=case.drop_last,
    )
    shards = case.shards()
    got = [list(shard) for shard in shards]
    assert got == expected
    assert [len(shard) for shard in shards] == [len(batches) for batches in got]


@settings(max_examples=200, deadline=None)
@given(shard_cases())
def test_shards_count_cover_and_loop_back_as_the_spec_says(case: ShardCase) -> None:
    shards = case.shards()
    got = [list(shard) for shard in shards]
    lens = [len(shard) for shard in shards]
    assert lens == [len(batches) for batches in got]
    k, p, n, g = (
        len(case.base_batches()),
        case.num_processes,
        case.n,
        case.total_batch_size,
    )
    flat = [index for batches in got for batch in batches for index in batch]
    if case.drop_last:
        assert len(set(lens)) <= 1
        assert sorted(flat) == sorted(case.order[: g * (n // g)])  # no index twice
    elif not case.even_batches:
        assert sorted(flat) == sorted(case.order)  # an exact partition
    else:
        assert lens == [k if case.split_batches else -(-k // p)] * p
        width = case.batch_size // p if case.split_batches else case.batch_size
        assert all(len(batch) == width for batches in got for batch in batches)
        extras = Counter(flat) - Counter(case.order)
        assert len(flat) == g * -(-n // g) and extras.total() == len(flat) - n
        first = case.order[: min(n, g)]  # the epoch's first indices, looped over
        assert extras == Counter(first[t % len(first)] for t in range(len(flat) - n))


@settings(max_examples=150, deadline=None)
@given(dynamic_batches(), st.integers(1, 5), st.booleans(), st.booleans())
def test_dynamic_shards_follow_the_spec(
    batches: Batches, p: int, even: bool, drop_last: bool
) -> None:
    base = ListBatchSampler(batches, batch_size=None, drop_last=drop_last)
    shards = all_ranks(base, p, even_batches=even)
    got = [list(shard) for shard in shards]
    expected = spec_shards(
        batches, None, p, split_batches=False, even_batches=even, drop_last=drop_last
    )
    assert got == expected
    assert [len(shard) for shard in shards] == [len(b) for b in got]
    if not even and not drop_last:
        flat = sorted(index for ranks in got for batch in ranks for index in batch)
        assert flat == sorted(index for batch in batches for index in batch)


@settings(max_examples=150, deadline=None)
@given(shard_cases(shuffled=False), st.integers(0, 8))
def test_iterable_shard_equals_even_batch_sampler_shard_concatenated(
    case: ShardCase, skip: int
) -> None:
    even = dataclasses.replace(case, even_batches=True)
    for rank, shard in enumerate(even.shards()):
        stream = shard_iterable_dataset(
            Stream(case.n),
            batch_size=case.batch_size,
            drop_last=case.drop_last,
            num_processes=case.num_processes,
            process_index=rank,
            split_batches=case.split_batches,
        )
        samples = [index for batch in shard for index in batch]
        assert list(stream) == samples
        assert len(stream) == len(samples)
        assert list(stream.iter_from(skip)) == samples[skip:]


@settings(max_examples=100, deadline=None)
@given(shard_cases(max_n=60), st.integers(0, 10))
def test_iter_from_is_dropping_this_ranks_first_batches(
    case: ShardCase, skip: int
) -> None:
    for shard in case.shards():
        assert list(shard.iter_from(skip)) == list(shard)[skip:]


# --- optional: Accelerate 1.15 as an oracle (batches only; lens differ:
# docs/migration.md#semantics-deliberate-differences-from-accelerate) ----------


@pytest.fixture(scope="module")
def accelerate_data_loader() -> ModuleType:
    module: ModuleType = pytest.importorskip("accelerate.data_loader")
    return module


@settings(max_examples=100, deadline=None)
@given(case=shard_cases(max_n=80))
def test_batches_match_accelerate(
    accelerate_data_loader: ModuleType, case: ShardCase
) -> None:
    data_loader = accelerate_data_loader
    base = case.base()
    for rank, shard in enumerate(case.shards()):
        theirs = data_loader.BatchSamplerShard(
            base, case.num_processes, rank, case.split_batches, case.even_batches
        )
        assert list(shard) == list(theirs)
        ordered = list(range(case.n))
        stream = data_loader.IterableDatasetShard(
            ordered,
            case.batch_size,
            case.drop_last,
            case.num_processes,
            rank,
            case.split_batches,
        )
        ours = shard_iterable_dataset(
            ordered,
            batch_size=case.batch_size,
            drop_last=case.drop_last,
            num_processes=case.num_processes,
            process_index=rank,
            split_batches=case.split_batches,
        )
        assert list(ours) == list(stream)
