"""Shard batch samplers and iterable datasets across processes.

The rules: docs/sharding.md#semantics-sharding-a-batch-sampler, docs/sharding.md#semantics-sharding-an-iterable-dataset.

Everything here is index arithmetic on values the caller passes in: nothing reads
``torch.distributed``, the environment or a global. A shard is a frozen value that
wraps the original batch sampler or dataset without changing it; each iteration of
a shard iterates the original exactly once (one epoch) and keeps only what this
rank needs, plus the epoch's first indices in case the last round loops back.
``ShardedIterableDataset`` and ``shard_iterable_dataset`` are defined in
``funcaccel.sharding._iterable`` and re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from collections.abc import Sized
from dataclasses import InitVar
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from torch.utils.data import Sampler

from funcaccel._checks import check_bool
from funcaccel._checks import check_int
from funcaccel._checks import fail_type
from funcaccel._checks import type_name
from funcaccel._world import check_world
from funcaccel.sharding._common import take_cyclic
from funcaccel.sharding._iterable import ShardedIterableDataset
from funcaccel.sharding._iterable import shard_iterable_dataset

__all__ = [
    "ShardedBatchSampler",
    "ShardedIterableDataset",
    "shard_batch_sampler",
    "shard_iterable_dataset",
]


@dataclass(frozen=True, kw_only=True)
class ShardedBatchSampler(Sampler[list[int]]):
    """The batches of one rank, cut from a base batch sampler (rules: docs/sharding.md).

    Built by :func:`shard_batch_sampler`, whose arguments are its fields. Also holds
    ``batch_size`` (``bs``; ``None`` for a dynamic sampler) and ``drop_last``, read
    from ``batch_sampler`` once, at construction. The base is never changed.
    """

    batch_sampler: Iterable[Sequence[int]]
    num_processes: int
    process_index: int
    split_batches: bool = False
    even_batches: bool = True
    batch_size: int | None = field(init=False)
    drop_last: bool = field(init=False)
    # Name that error messages start with; shard_batch_sampler passes its own.
    _caller: InitVar[str] = "ShardedBatchSampler"

    def __post_init__(self, _caller: str) -> None:
        if not isinstance(self.batch_sampler, Iterable):
            what, hint = "an iterable of index lists", "Pass a torch BatchSampler."
            fail_type(_caller, "batch_sampler", self.batch_sampler, what, hint)
        size: Any = getattr(self.batch_sampler, "batch_size", None)
        drop_last: Any = getattr(self.batch_sampler, "drop_last", False)
        if size is not None:
            check_int(_caller, "batch_sampler.batch_size", size, 1)
        check_bool(_caller, "batch_sampler.drop_last", drop_last)
        check_bool(_caller, "even_batches", self.even_batches)
        args = (self.num_processes, self.process_index, self.split_batches, size)
        check_world(_caller, *args)
        object.__setattr__(self, "batch_size", size)
        object.__setattr__(self, "drop_last", drop_last)

    @property
    def total_batch_size(self) -> int | None:
        """Global batch size ``G``: ``bs`` if split, else ``bs * p``; ``None`` if dynamic."""
        if self.batch_size is None or self.split_batches:
            return self.batch_size
        return self.batch_size * self.num_processes

    def __len__(self) -> int:
        """Return the batches this rank yields per epoch; ``TypeError`` if the base is unsized."""
        if not isinstance(self.batch_sampler, Sized):
            msg = f"{type_name(self)}.__len__: the base batch sampler ({type_name(self.batch_sampler)}) has no len(); give it a __len__ or do not ask for len()."
            raise TypeError(msg)
        k, p, i = len(self.batch_sampler), self.num_processes, self.process_index
        if not self.split_batches:
            if self.drop_last:
                return k // p
            return -(-k // p) if self.even_batches else k // p + (i < k % p)
        if k == 0 or self.even_batches or self.drop_last:
            return k
        assert self.batch_size is not None  # checked at construction
        last = self._last_batch_length(k, self.batch_size)
        return k - (last < self.batch_size and last <= i * (self.batch_size // p))

    def _last_batch_length(self, k: int, batch_size: int) -> int:
        # torch's BatchSampler: the last batch holds what is left of len(sampler).
        sampler = getattr(self.batch_sampler, "sampler", None)
        if isinstance(sampler, Sized) and -(-len(sampler) // batch_size) == k:
            return len(sampler) - (k - 1) * batch_size
        last = 0  # any other base: walk one epoch of index lists (no data is read)
        for batch in self.batch_sampler:
            last = len(batch)
        return last

    def __iter__(self) -> Iterator[list[int]]:
        """Iterate this rank's batches of one epoch; same as ``iter_from(0)``."""
        return self.iter_from(0)

    def iter_from(self, skip: int) -> Iterator[list[int]]:
        """Iterate one epoch of this rank's batches, leaving out its first ``skip``.

        For resuming mid-epoch. The base is iterated once, as for a whole epoch (a
        random base draws its order as usual), but a skipped batch is only counted:
        its indices are not sliced, padded or yielded, so no skipped data is fetched.

        Args:
            skip: Number of this rank's leading batches to leave out (``>= 0``);
                skipping past the end yields nothing.

        Returns:
            An iterator equal to ``itertools.islice(iter(self), skip, None)``.

        Raises:
            ValueError: If ``skip`` is negative.

        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> base = BatchSampler(SequentialSampler(range(10)), 2, drop_last=False)
        >>> list(shard_batch_sampler(base, num_processes=2, process_index=1).iter_from(1))
        [[6, 7], [0, 1]]
        """
        check_int(f"{type_name(self)}.iter_from", "skip", skip, 0)
        return self._iter_split(skip) if self.split_batches else self._iter_whole(skip)

    def _iter_split(self, skip: int) -> Iterator[list[int]]:
        assert self.batch_size is not None  # checked at construction
        bs = self.batch_size
        lo = self.process_index * (bs // self.num_processes)
        hi = lo + bs // self.num_processes
        first: list[int] | None = None  # B_0, the loop-back source
        produced = 0  # this rank's batches so far, skipped ones included
        for batch in self.batch_sampler:
            if first is None:
                first = list(batch)
            if len(batch) >= bs:
                if produced >= skip:
                    yield list(batch[lo:hi])
            elif self.drop_last or not (self.even_batches or len(batch) > lo):
                continue  # only the last base batch can be short
            elif produced >= skip:
                pad = take_cyclic(first, 0, bs - len(batch) if self.even_batches else 0)
                yield (list(batch) + pad)[lo:hi]
            produced += 1

    def _iter_whole(self, skip: int) -> Iterator[list[int]]:
        bs, p, i = self.batch_size, self.num_processes, self.process_index
        keep_head = self.even_batches and not self.drop_last
        head: list[list[int]] = []  # B_0 .. B_{min(p,k)-1}, the loop-back source
        mine: list[int] = []  # this rank's batch in the open round
        size = last_len = 0  # batches in the open round; length of the newest one
        produced = 0  # this rank's batches so far, skipped ones included
        for batch in self.batch_sampler:
            if size == p:
                # A round ending in a short batch was not the tail after all; a
                # conforming base never gets here (only its last batch is short).
                if produced >= skip:
                    yield mine
                produced, size = produced + 1, 0
            if keep_head and len(head) < p:
                head.append(list(batch))
            if size == i:
                mine = list(batch)
            size, last_len = size + 1, len(batch)
            # A round is complete when it has p batches and its last one is full.
            if size == p and (bs is None or last_len >= bs):
                if produced >= skip:
                    yield mine
                produced, size = produced + 1, 0
        # The open round is the tail T (len(T) = size); only T[-1] can be short.
        if size == 0 or self.drop_last or produced < skip:
            return
        if not self.even_batches or (i < size and (bs is None or len(mine) >= bs)):
            if i < size:
                yield mine
        elif bs is None:
            yield list(head[(i - size) % len(head)])
        else:
            # Positions j = 0 .. p-1 of the final round draw in turn from one shared
            # cycle F over the first min(p, k) batches: the short T[-1] takes
            # bs - len(T[-1]) items and each empty position bs; rank i needs only
            # its own draw.
            fill = [index for batch in head for index in batch]
            if i < size:
                yield mine + take_cyclic(fill, 0, bs - len(mine))
            else:
                yield take_cyclic(fill, max(bs - last_len, 0) + (i - size) * bs, bs)


def shard_batch_sampler(
    batch_sampler: Iterable[Sequence[int]],
    *,
    num_processes: int,
    process_index: int,
    split_batches: bool = False,
    even_batches: bool = True,
) -> ShardedBatchSampler:
    """Return the batches of rank ``process_index`` out of ``batch_sampler``.

    Without ``split_batches`` rank ``i`` takes every ``p``-th base batch; with it,
    slice ``i`` of every base batch. With ``even_batches`` (and no ``drop_last`` on
    the base) the last round is completed with the epoch's first indices, so every
    rank gets the same number of full batches; these are the only duplicates.
    ``batch_sampler`` is left unchanged and is iterated once per epoch. The rules:
    docs/sharding.md#semantics-sharding-a-batch-sampler.

    With 2 ranks and 10 samples in batches of 3, rank 0 yields [0, 1, 2] [6, 7, 8]
    and rank 1 yields [3, 4, 5] [9, 0, 1] (the last two loop back to the start):

    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> base = BatchSampler(SequentialSampler(range(10)), 3, drop_last=False)
    >>> [list(shard_batch_sampler(base, num_processes=2, process_index=r)) for r in (0, 1)]
    [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
    >>> uneven = shard_batch_sampler(base, num_processes=2, process_index=1, even_batches=False)
    >>> list(uneven), len(uneven), uneven.total_batch_size
    ([[3, 4, 5], [9]], 2, 6)

    Arguments, attributes (``len()``, ``total_batch_size``, ``iter_from``) and
    errors: docs/sharding.md#api and docs/sharding.md#errors.

    Raises:
        TypeError: an argument, or the base's ``batch_size``/``drop_last``, of the
            wrong type.
        ValueError: ``num_processes < 1``, ``process_index`` out of range, or
            ``split_batches`` with a ``batch_size`` that ``num_processes`` does not
            divide.
    """
    return ShardedBatchSampler(
        batch_sampler=batch_sampler,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=split_batches,
        even_batches=even_batches,
        _caller="shard_batch_sampler",
    )
