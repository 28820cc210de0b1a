"""Hypothesis strategies for sharding configurations (used by ``test_sharding.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise

from hypothesis import strategies as st
from torch.utils.data import BatchSampler

from funcaccel.sharding import ShardedBatchSampler
from funcaccel.sharding import shard_batch_sampler


class ListBatchSampler:
    """A re-iterable batch sampler over fixed batches, with free ``batch_size``.

    ``batch_size=None`` makes it a dynamic batch sampler (batches of any size).
    Each iteration yields fresh copies and counts itself in ``iterations``.
    """

    def __init__(
        self,
        batches: list[list[int]],
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        self.batches = batches
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.iterations = 0

    def __iter__(self) -> Iterator[list[int]]:
        self.iterations += 1
        return (list(batch) for batch in self.batches)

    def __len__(self) -> int:
        return len(self.batches)


@dataclass(frozen=True)
class ShardCase:
    """One epoch of indices ``order`` batched by torch's ``BatchSampler``, and the options."""

    order: tuple[int, ...]
    batch_size: int
    num_processes: int
    split_batches: bool
    even_batches: bool
    drop_last: bool

    @property
    def n(self) -> int:
        """Number of samples in the epoch."""
        return len(self.order)

    @property
    def total_batch_size(self) -> int:
        """``G``: ``bs`` if split, else ``bs * p``."""
        if self.split_batches:
            return self.batch_size
        return self.batch_size * self.num_processes

    def base(self) -> BatchSampler:
        """Return a fresh base batch sampler over ``order``."""
        return BatchSampler(list(self.order), self.batch_size, self.drop_last)

    def base_batches(self) -> list[list[int]]:
        """Return the base batches ``B_0 .. B_{k-1}``."""
        return list(self.base())

    def shards(self) -> list[ShardedBatchSampler]:
        """Return the shard of every rank, in rank order."""
        base = self.base()
        return [
            shard_batch_sampler(
                base,
                num_processes=self.num_processes,
                process_index=rank,
                split_batches=self.split_batches,
                even_batches=self.even_batches,
            )
            for rank in range(self.num_processes)
        ]


@st.composite
def shard_cases(
    draw: st.DrawFn,
    *,
    max_n: int = 200,
    max_batch_size: int = 17,
    max_processes: int = 5,
    shuffled: bool = True,
) -> ShardCase:
    """Draw a sharding configuration; split cases get a batch size divisible by p."""
    num_processes = draw(st.integers(1, max_processes))
    split_batches = draw(st.booleans())
    if split_batches:
        multiple = draw(st.integers(1, max(max_batch_size // num_processes, 1)))
        batch_size = multiple * num_processes
    else:
        batch_size = draw(st.integers(1, max_batch_size))
    n = draw(st.integers(0, max_n))
    order = draw(st.permutations(range(n))) if shuffled else list(range(n))
    return ShardCase(
        order=tuple(order),
        batch_size=batch_size,
        num_processes=num_processes,
        split_batches=split_batches,
        even_batches=draw(st.booleans()),
        drop_last=draw(st.booleans()),
    )


@st.composite
def dynamic_batches(draw: st.DrawFn, *, max_n: int = 60) -> list[list[int]]:
    """Draw a permutation of ``range(n)`` cut into non-empty batches of any size."""
    n = draw(st.integers(0, max_n))
    order = draw(st.permutations(range(n)))
    cuts = draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=n)) if n > 1 else set()
    bounds = [0, *sorted(cuts), n] if n else [0]
    return [list(order[a:b]) for a, b in pairwise(bounds)]
