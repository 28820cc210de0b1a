"""Shard batch samplers and iterable datasets across processes (SPEC §2 and §3).

Everything here is index arithmetic on values the caller passes in: nothing reads
``torch.distributed``, the environment or a global. A shard is a frozen value that
wraps the original batch sampler or dataset without changing it; each iteration of
a shard iterates the original exactly once (one epoch) and keeps only what this
rank needs, plus the first indices of the epoch in case the last round must loop
back to them.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from collections.abc import Sized
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import TypeVar

from torch.utils.data import IterableDataset
from torch.utils.data import Sampler

__all__ = [
    "ShardedBatchSampler",
    "ShardedIterableDataset",
    "shard_batch_sampler",
    "shard_iterable_dataset",
]

_T = TypeVar("_T")


def _check_int(where: str, name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{where}: {name} must be an int, got {value!r} of type {type(value).__name__}; pass an int >= {minimum}."
        raise TypeError(msg)
    if value < minimum:
        msg = (
            f"{where}: {name} ({value}) must be >= {minimum}; pass an int >= {minimum}."
        )
        raise ValueError(msg)


def _check_bool(where: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        msg = f"{where}: {name} must be a bool, got {value!r} of type {type(value).__name__}; pass True or False."
        raise TypeError(msg)


def _check_world(where: str, num_processes: object, process_index: object) -> None:
    _check_int(where, "num_processes", num_processes, minimum=1)
    _check_int(where, "process_index", process_index, minimum=0)
    assert isinstance(num_processes, int) and isinstance(process_index, int)
    if process_index >= num_processes:
        msg = (
            f"{where}: process_index ({process_index}) must be in [0, num_processes={num_processes}); "
            f"pass this process's rank, below {num_processes}."
        )
        raise ValueError(msg)


def _check_split(where: str, batch_size: int | None, num_processes: int) -> None:
    if batch_size is None or batch_size % num_processes != 0:
        msg = (
            f"{where}: batch_size ({batch_size}) must be a multiple of num_processes ({num_processes}) "
            f"when split_batches=True; use a batch size divisible by {num_processes} or split_batches=False."
        )
        raise ValueError(msg)


def _check_skip(where: str, skip: object) -> None:
    _check_int(where, "skip", skip, minimum=0)


def _take_cyclic(source: Sequence[_T], start: int, count: int) -> list[_T]:
    """Return ``count`` items of ``cycle(source)`` from position ``start``."""
    if not source:
        return []
    return [source[(start + t) % len(source)] for t in range(count)]


def _base_options(where: str, batch_sampler: object) -> tuple[int | None, bool]:
    """Read and check ``batch_size`` (absent: ``None``) and ``drop_last`` (absent: False)."""
    if not isinstance(batch_sampler, Iterable):
        msg = f"{where}: batch_sampler must be an iterable of index lists, got {type(batch_sampler).__name__}; pass a torch BatchSampler or similar."
        raise TypeError(msg)
    batch_size: Any = getattr(batch_sampler, "batch_size", None)
    drop_last: Any = getattr(batch_sampler, "drop_last", False)
    if batch_size is not None:
        _check_int(where, "batch_sampler.batch_size", batch_size, minimum=1)
    _check_bool(where, "batch_sampler.drop_last", drop_last)
    return batch_size, drop_last


@dataclass(frozen=True, kw_only=True)
class ShardedBatchSampler(Sampler[list[int]]):
    """The batches of one rank, cut from a base batch sampler as SPEC §2 states.

    Build it with :func:`shard_batch_sampler`. ``batch_size`` and ``drop_last`` are
    read from ``batch_sampler`` once, at construction (``None`` and ``False`` when it
    lacks them); the base itself is never changed.

    Attributes:
        batch_sampler: The wrapped base batch sampler, iterated once per epoch.
        num_processes: Number of ranks ``p``.
        process_index: This rank ``i``.
        split_batches: Each base batch is cut into ``p`` slices instead of dealt out.
        even_batches: Loop back to the epoch's first indices so every rank gets the
            same number of full batches.
        batch_size: The base batch size ``bs`` (``None`` for a dynamic sampler).
        drop_last: The base sampler's ``drop_last``.
    """

    batch_sampler: Iterable[Sequence[int]]
    num_processes: int
    process_index: int
    split_batches: bool = False
    even_batches: bool = True
    batch_size: int | None = field(init=False)
    drop_last: bool = field(init=False)

    def __post_init__(self) -> None:
        where = type(self).__name__
        batch_size, drop_last = _validate_batch_shard(
            where,
            self.batch_sampler,
            self.num_processes,
            self.process_index,
            self.split_batches,
            self.even_batches,
        )
        object.__setattr__(self, "batch_size", batch_size)
        object.__setattr__(self, "drop_last", drop_last)

    @property
    def total_batch_size(self) -> int | None:
        """Global batch size ``G``: ``bs`` if split, else ``bs * p``; ``None`` if dynamic."""
        if self.batch_size is None:
            return None
        return (
            self.batch_size
            if self.split_batches
            else self.batch_size * self.num_processes
        )

    @property
    def process_batch_size(self) -> int | None:
        """Per-rank batch size ``c``: ``bs / p`` if split, else ``bs``; ``None`` if dynamic."""
        if self.batch_size is None or not self.split_batches:
            return self.batch_size
        return self.batch_size // self.num_processes

    def __len__(self) -> int:
        """Return the number of batches this rank yields per epoch (SPEC §2).

        Raises:
            TypeError: If the base batch sampler has no ``len()``.
        """
        if not isinstance(self.batch_sampler, Sized):
            msg = f"{type(self).__name__}.__len__: the base batch sampler ({type(self.batch_sampler).__name__}) has no len(); give it a __len__ or do not ask for len()."
            raise TypeError(msg)
        k, p, i = len(self.batch_sampler), self.num_processes, self.process_index
        if self.split_batches:
            if k == 0 or self.even_batches or self.drop_last:
                return k
            assert self.batch_size is not None  # checked at construction
            last = self._last_batch_length(k, self.batch_size)
            return (
                k - 1
                if last < self.batch_size and last <= i * (self.batch_size // p)
                else k
            )
        if self.drop_last:
            return k // p
        if self.even_batches:
            return -(-k // p)
        return k // p + (1 if i < k % p else 0)

    def _last_batch_length(self, k: int, batch_size: int) -> int:
        # torch's BatchSampler: the last batch holds what is left of len(sampler).
        sampler = getattr(self.batch_sampler, "sampler", None)
        if isinstance(sampler, Sized):
            n = len(sampler)
            if -(-n // batch_size) == k:
                return n - (k - 1) * batch_size
        # Any other base: walk one epoch of index lists (no data is read).
        last = 0
        for batch in self.batch_sampler:
            last = len(batch)
        return last

    def __iter__(self) -> Iterator[list[int]]:
        """Iterate this rank's batches of one epoch; same as ``iter_from(0)``."""
        return self.iter_from(0)

    def iter_from(self, skip: int) -> Iterator[list[int]]:
        """Iterate one epoch of this rank's batches, leaving out its first ``skip``.

        The base is iterated once, as for a full epoch (its random order is drawn as
        usual), but a skipped batch is only counted: its indices are neither sliced,
        padded nor yielded, so a loader that resumes mid-epoch fetches no skipped data.
        Skipping past the end yields nothing.

        Args:
            skip: Number of this rank's leading batches to leave out (``>= 0``).

        Returns:
            An iterator equal to ``itertools.islice(iter(self), skip, None)``.

        Raises:
            ValueError: If ``skip`` is negative.

        >>> from torch.utils.data import BatchSampler, SequentialSampler
        >>> base = BatchSampler(SequentialSampler(range(10)), batch_size=2, drop_last=False)
        >>> list(shard_batch_sampler(base, num_processes=2, process_index=1).iter_from(1))
        [[6, 7], [0, 1]]
        """
        _check_skip(f"{type(self).__name__}.iter_from", skip)
        if self.split_batches:
            return self._iter_split(skip)
        return self._iter_whole(skip)

    def _iter_split(self, skip: int) -> Iterator[list[int]]:
        assert self.batch_size is not None  # checked at construction
        bs = self.batch_size
        lo = self.process_index * (bs // self.num_processes)
        hi = lo + bs // self.num_processes
        first: Sequence[int] | None = None  # B_0, the loop-back source
        produced = 0  # this rank's batches so far, skipped ones included
        for batch in self.batch_sampler:
            if first is None:
                first = list(batch)
            if len(batch) < bs:
                # Only the last base batch can be short.
                if self.drop_last or (not self.even_batches and len(batch) <= lo):
                    continue
                if produced >= skip:
                    padded = (
                        list(batch) + _take_cyclic(first, 0, bs - len(batch))
                        if self.even_batches
                        else batch
                    )
                    yield list(padded[lo:hi])
            elif produced >= skip:
                yield list(batch[lo:hi])
            produced += 1

    def _iter_whole(self, skip: int) -> Iterator[list[int]]:
        bs, p, i = self.batch_size, self.num_processes, self.process_index
        keep_head = self.even_batches and not self.drop_last
        head: list[list[int]] = []  # B_0 .. B_{min(p,k)-1}, the loop-back source
        mine: list[int] = []  # this rank's batch in the open round
        size = 0  # batches in the open round
        last_len = 0  # length of the newest base batch
        produced = 0  # this rank's batches so far, skipped ones included
        for batch in self.batch_sampler:
            if size == p:
                # A full round ending in a short batch turned out not to be the tail;
                # a conforming base never gets here (only its last batch is short).
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
        # The tail T holds the `size` batches of the open round; only its last can be short.
        if size == 0 or self.drop_last or produced < skip:
            return
        if not self.even_batches:
            if i < size:
                yield mine
            return
        if bs is None:
            yield mine if i < size else list(head[(i - size) % len(head)])
            return
        # The final round's positions draw, in order, from one shared cycle F of the
        # first min(p, k) batches: the short last batch T[-1] takes bs - len(T[-1])
        # items, each empty position takes bs. Rank i needs only its own draw.
        fill = [index for batch in head for index in batch]
        if i < size:
            yield (
                mine
                if len(mine) >= bs
                else mine + _take_cyclic(fill, 0, bs - len(mine))
            )
            return
        start = max(bs - last_len, 0) + (i - size) * bs
        yield _take_cyclic(fill, start, bs)


def _validate_batch_shard(
    where: str,
    batch_sampler: object,
    num_processes: object,
    process_index: object,
    split_batches: object,
    even_batches: object,
) -> tuple[int | None, bool]:
    _check_world(where, num_processes, process_index)
    _check_bool(where, "split_batches", split_batches)
    _check_bool(where, "even_batches", even_batches)
    batch_size, drop_last = _base_options(where, batch_sampler)
    assert isinstance(num_processes, int)
    if split_batches:
        _check_split(where, batch_size, num_processes)
    return batch_size, drop_last


def shard_batch_sampler(
    batch_sampler: Iterable[Sequence[int]],
    *,
    num_processes: int,
    process_index: int,
    split_batches: bool = False,
    even_batches: bool = True,
) -> ShardedBatchSampler:
    """Return the batches of rank ``process_index`` out of ``batch_sampler`` (SPEC §2).

    Without ``split_batches`` rank ``i`` takes every ``p``-th base batch; with it,
    slice ``i`` of every base batch. With ``even_batches`` (and no ``drop_last`` on
    the base) the last round is completed with the epoch's first indices, so every
    rank gets the same number of full batches; these are the only duplicates.
    ``batch_sampler`` is left unchanged and is iterated once per epoch.

    With 2 ranks and 10 samples in batches of 3, rank 0 yields [0, 1, 2] [6, 7, 8]
    and rank 1 yields [3, 4, 5] [9, 0, 1] (the last two loop back to the start):

    >>> from torch.utils.data import BatchSampler, SequentialSampler
    >>> base = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)
    >>> [list(shard_batch_sampler(base, num_processes=2, process_index=r)) for r in (0, 1)]
    [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
    >>> uneven = shard_batch_sampler(base, num_processes=2, process_index=1, even_batches=False)
    >>> list(uneven), len(uneven), uneven.total_batch_size
    ([[3, 4, 5], [9]], 2, 6)

    Args:
        batch_sampler: A re-iterable source of index lists; its ``batch_size``
            (``None``, or absent, for a dynamic sampler) and ``drop_last`` (absent:
            False) are read once.
        num_processes: Number of ranks ``p`` (``>= 1``).
        process_index: This rank, in ``[0, num_processes)``.
        split_batches: Cut each base batch into ``p`` slices of ``bs / p``.
        even_batches: Loop back to the epoch's start to even out the last round.

    Returns:
        A frozen torch ``Sampler`` of index lists whose ``len()`` is the number of
        batches this rank yields.

    Raises:
        ValueError: If ``num_processes < 1``, ``process_index`` is out of range, or
            ``split_batches`` is set and ``batch_size`` is ``None`` or not a multiple
            of ``num_processes``.
        TypeError: If an argument, or the base's ``batch_size``/``drop_last``, has
            the wrong type.
    """
    _validate_batch_shard(
        "shard_batch_sampler",
        batch_sampler,
        num_processes,
        process_index,
        split_batches,
        even_batches,
    )
    return ShardedBatchSampler(
        batch_sampler=batch_sampler,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=split_batches,
        even_batches=even_batches,
    )


@dataclass(frozen=True, kw_only=True)
class ShardedIterableDataset(IterableDataset[_T]):
    """The samples of one rank, cut from a stream as SPEC §3 states.

    Build it with :func:`shard_iterable_dataset`. Every rank reads the whole stream
    into buffers of ``total_batch_size`` samples and keeps its slice of each.

    Attributes:
        dataset: The wrapped stream, read once per iteration.
        batch_size: The original loader's batch size ``bs``.
        drop_last: Discard a last partial buffer instead of padding it.
        num_processes: Number of ranks ``p``.
        process_index: This rank ``i``.
        split_batches: ``bs`` is the global batch size, cut into ``p`` slices.
    """

    dataset: Iterable[_T]
    batch_size: int = 1
    drop_last: bool = False
    num_processes: int = 1
    process_index: int = 0
    split_batches: bool = False

    def __post_init__(self) -> None:
        _validate_iterable_shard(
            type(self).__name__,
            self.dataset,
            self.batch_size,
            self.drop_last,
            self.num_processes,
            self.process_index,
            self.split_batches,
        )

    @property
    def total_batch_size(self) -> int:
        """Global batch size ``G``: ``bs`` if split, else ``bs * p``."""
        return (
            self.batch_size
            if self.split_batches
            else self.batch_size * self.num_processes
        )

    @property
    def process_batch_size(self) -> int:
        """Per-rank batch size ``c``: ``bs / p`` if split, else ``bs``."""
        return (
            self.batch_size // self.num_processes
            if self.split_batches
            else self.batch_size
        )

    def __len__(self) -> int:
        """Return the number of samples this rank yields per epoch (SPEC §3).

        Raises:
            TypeError: If the wrapped dataset has no ``len()``.
        """
        if not isinstance(self.dataset, Sized):
            msg = f"{type(self).__name__}.__len__: the dataset ({type(self.dataset).__name__}) has no len(); give it a __len__ or do not ask for len()."
            raise TypeError(msg)
        n, g = len(self.dataset), self.total_batch_size
        buffers = n // g if self.drop_last else -(-n // g)
        return self.process_batch_size * buffers

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` to ``dataset.set_epoch``, if the dataset defines one.

        The shard itself holds no epoch; the wrapped dataset changes as its own
        ``set_epoch`` does.
        """
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[_T]:
        """Iterate this rank's samples of one epoch; same as ``iter_from(0)``."""
        return self.iter_from(0)

    def iter_from(self, skip: int) -> Iterator[_T]:
        """Iterate one epoch of this rank's samples, leaving out its first ``skip``.

        The stream is read in full, as for a whole epoch (an iterable dataset cannot
        seek), and skipped samples are dropped without being yielded.

        Args:
            skip: Number of this rank's leading samples to leave out (``>= 0``).

        Returns:
            An iterator equal to ``itertools.islice(iter(self), skip, None)``.

        Raises:
            ValueError: If ``skip`` is negative.

        >>> shard = shard_iterable_dataset(range(10), batch_size=3, num_processes=2)
        >>> list(shard.iter_from(2))
        [2, 6, 7, 8]
        """
        _check_skip(f"{type(self).__name__}.iter_from", skip)
        return self._iter(skip)

    def _iter(self, skip: int) -> Iterator[_T]:
        g, c = self.total_batch_size, self.process_batch_size
        lo, hi = self.process_index * c, (self.process_index + 1) * c
        first: list[_T] | None = None  # the first full buffer, the loop-back source
        buffer: list[_T] = []
        produced = 0  # this rank's samples so far, skipped ones included
        for sample in self.dataset:
            buffer.append(sample)
            if len(buffer) == g:
                yield from buffer[max(lo, lo + skip - produced) : hi]
                produced += c
                if first is None:
                    first = buffer
                buffer = []
        if buffer and not self.drop_last:
            source = buffer if first is None else first
            padded = buffer + _take_cyclic(source, 0, g - len(buffer))
            yield from padded[max(lo, lo + skip - produced) : hi]


def _validate_iterable_shard(
    where: str,
    dataset: object,
    batch_size: object,
    drop_last: object,
    num_processes: object,
    process_index: object,
    split_batches: object,
) -> None:
    if not isinstance(dataset, Iterable):
        msg = f"{where}: dataset must be iterable, got {type(dataset).__name__}; pass an IterableDataset or another iterable."
        raise TypeError(msg)
    _check_int(where, "batch_size", batch_size, minimum=1)
    _check_bool(where, "drop_last", drop_last)
    _check_world(where, num_processes, process_index)
    _check_bool(where, "split_batches", split_batches)
    assert isinstance(batch_size, int) and isinstance(num_processes, int)
    if split_batches:
        _check_split(where, batch_size, num_processes)


def shard_iterable_dataset(
    dataset: Iterable[_T],
    *,
    batch_size: int = 1,
    drop_last: bool = False,
    num_processes: int = 1,
    process_index: int = 0,
    split_batches: bool = False,
) -> ShardedIterableDataset[_T]:
    """Return the samples of rank ``process_index`` out of the stream ``dataset`` (SPEC §3).

    Every rank reads the whole stream into consecutive buffers of ``G`` samples and
    yields positions ``[i*c, (i+1)*c)`` of each. A last partial buffer is dropped
    with ``drop_last``, else padded from the start of the first full buffer (or of
    itself when none was full). For a sequential stream a rank's samples are those
    of :func:`shard_batch_sampler` with ``even_batches=True``, concatenated.
    ``dataset`` is left unchanged, except through its own ``set_epoch``.

    With 2 ranks, 10 samples and batches of 3, rank 0 yields 0, 1, 2, 6, 7, 8 and
    rank 1 yields 3, 4, 5, 9, 0, 1:

    >>> [list(shard_iterable_dataset(range(10), batch_size=3, num_processes=2, process_index=r)) for r in (0, 1)]
    [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 0, 1]]
    >>> len(shard_iterable_dataset(range(10), batch_size=3, drop_last=True, num_processes=2))
    3

    Args:
        dataset: The stream of samples; re-iterable for more than one epoch.
        batch_size: The original loader's batch size ``bs`` (``>= 1``).
        drop_last: Discard a last partial global batch instead of padding it.
        num_processes: Number of ranks ``p`` (``>= 1``).
        process_index: This rank, in ``[0, num_processes)``.
        split_batches: ``bs`` is the global batch size: ``G = bs``, ``c = bs / p``;
            otherwise ``G = bs * p`` and ``c = bs``.

    Returns:
        A frozen torch ``IterableDataset`` of single samples (batch it with ``c``).

    Raises:
        ValueError: If ``batch_size < 1``, ``num_processes < 1``, ``process_index``
            is out of range, or ``split_batches`` is set and ``batch_size`` is not a
            multiple of ``num_processes`` (batch size 1 included).
        TypeError: If an argument has the wrong type.
    """
    _validate_iterable_shard(
        "shard_iterable_dataset",
        dataset,
        batch_size,
        drop_last,
        num_processes,
        process_index,
        split_batches,
    )
    return ShardedIterableDataset(
        dataset=dataset,
        batch_size=batch_size,
        drop_last=drop_last,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=split_batches,
    )
