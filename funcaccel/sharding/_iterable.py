"""Shard an iterable dataset (a stream) across processes.

The rules: docs/sharding.md#semantics-sharding-an-iterable-dataset.

Every rank reads the whole stream and keeps its slice of each global batch; pure
arithmetic on the values passed in, as in ``funcaccel.sharding``, which re-exports
``ShardedIterableDataset`` and ``shard_iterable_dataset``.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sized
from dataclasses import InitVar
from dataclasses import dataclass
from typing import TypeVar

from torch.utils.data import IterableDataset

from funcaccel._checks import check_bool
from funcaccel._checks import check_int
from funcaccel._checks import fail_type
from funcaccel._checks import type_name
from funcaccel._world import check_world
from funcaccel.sharding._common import take_cyclic

__all__ = [
    "ShardedIterableDataset",
    "shard_iterable_dataset",
]

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class ShardedIterableDataset(IterableDataset[_T]):
    """The samples of one rank, cut from a stream (rules: docs/sharding.md).

    Built by :func:`shard_iterable_dataset`, whose arguments are its fields. Every
    rank reads the whole stream into buffers of ``total_batch_size`` samples and
    keeps its slice of each.
    """

    dataset: Iterable[_T]
    batch_size: int = 1
    drop_last: bool = False
    num_processes: int = 1
    process_index: int = 0
    split_batches: bool = False
    # Name that error messages start with; shard_iterable_dataset passes its own.
    _caller: InitVar[str] = "ShardedIterableDataset"

    def __post_init__(self, _caller: str) -> None:
        if not isinstance(self.dataset, Iterable):
            hint = "Pass an IterableDataset or another iterable."
            fail_type(_caller, "dataset", self.dataset, "an iterable", hint)
        size = check_int(_caller, "batch_size", self.batch_size, 1)
        check_bool(_caller, "drop_last", self.drop_last)
        args = (self.num_processes, self.process_index, self.split_batches, size)
        check_world(_caller, *args)

    @property
    def total_batch_size(self) -> int:
        """Global batch size ``G``: ``bs`` if split, else ``bs * p``."""
        return self.batch_size * (1 if self.split_batches else self.num_processes)

    @property
    def process_batch_size(self) -> int:
        """Per-rank batch size ``c``, to batch this shard with: ``bs / p`` if split, else ``bs``."""
        return self.batch_size // (self.num_processes if self.split_batches else 1)

    def __len__(self) -> int:
        """Return the samples this rank yields per epoch; ``TypeError`` if the dataset is unsized."""
        if not isinstance(self.dataset, Sized):
            msg = f"{type_name(self)}.__len__: the dataset ({type_name(self.dataset)}) has no len(); give it a __len__ or do not ask for len()."
            raise TypeError(msg)
        n, g = len(self.dataset), self.total_batch_size
        return self.process_batch_size * (n // g if self.drop_last else -(-n // g))

    def set_epoch(self, epoch: int) -> None:
        """Call ``dataset.set_epoch(epoch)`` if the dataset defines it, else nothing.

        The shard holds no epoch itself; the dataset changes as its own method does.
        """
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[_T]:
        """Iterate this rank's samples of one epoch; same as ``iter_from(0)``."""
        return self.iter_from(0)

    def iter_from(self, skip: int) -> Iterator[_T]:
        """Iterate one epoch of this rank's samples, leaving out its first ``skip``.

        The stream is read in full (an iterable dataset cannot seek); skipped samples
        are dropped unyielded. Equals ``itertools.islice(iter(self), skip, None)``.

        Raises:
            ValueError: If ``skip`` is negative.

        >>> shard = shard_iterable_dataset(range(10), batch_size=3, num_processes=2)
        >>> list(shard.iter_from(2))
        [2, 6, 7, 8]
        """
        check_int(f"{type_name(self)}.iter_from", "skip", skip, 0)
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
                first, buffer = buffer if first is None else first, []
        if buffer and not self.drop_last:
            pad = take_cyclic(buffer if first is None else first, 0, g - len(buffer))
            yield from (buffer + pad)[max(lo, lo + skip - produced) : hi]


def shard_iterable_dataset(
    dataset: Iterable[_T],
    *,
    batch_size: int = 1,
    drop_last: bool = False,
    num_processes: int = 1,
    process_index: int = 0,
    split_batches: bool = False,
) -> ShardedIterableDataset[_T]:
    """Return the samples of rank ``process_index`` out of the stream ``dataset``.

    The rules: docs/sharding.md#semantics-sharding-an-iterable-dataset.

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
        A frozen torch ``IterableDataset`` of single samples (batch it with ``c``,
        its ``process_batch_size``).

    Raises:
        ValueError: If ``batch_size < 1``, ``num_processes < 1``, ``process_index``
            is out of range, or ``split_batches`` is set and ``batch_size`` is not a
            multiple of ``num_processes`` (batch size 1 included).
        TypeError: If an argument has the wrong type.
    """
    return ShardedIterableDataset(
        dataset=dataset,
        batch_size=batch_size,
        drop_last=drop_last,
        num_processes=num_processes,
        process_index=process_index,
        split_batches=split_batches,
        _caller="shard_iterable_dataset",
    )
