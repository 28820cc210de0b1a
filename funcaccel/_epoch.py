"""Where each epoch's indices come from, and how a resume skips them (SPEC §4.1, §4.2).

``BaseIndices`` describes, once per loader, the unsharded index stream of the
original ``DataLoader``: the seeded replacement of a shuffling ``RandomSampler``, a
sequential order, or the user's own (batch) sampler. Its ``for_epoch(epoch)`` gives
that epoch's stream as a value; for the first two it is an ``IndexedBatches`` (or a
plain sequence of indices) that skips any number of batches in constant time, so a
resume costs the same at 90 % of an epoch as at its start.

``IndexSlot`` is the index sampler of the loader's inner ``DataLoader``: the loader
loads each epoch's iterator into it right before iterating, so one ``DataLoader``
(and its persistent workers) serves every epoch. ``CountedStream`` and
``TaggedCollate`` count the samples an unsized stream produced, through the worker
processes if there are any, so the last batch can carry the remainder.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any
from typing import Final
from typing import Literal

import torch
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset
from torch.utils.data import RandomSampler
from torch.utils.data import Sampler

from funcaccel.sharding import shard_iterable_dataset

__all__ = [
    "BaseIndices",
    "seeded_order",
    "CountedStream",
    "IndexSlot",
    "IndexedBatches",
    "READ_LABEL",
    "TaggedCollate",
    "fetch_batch",
    "read_batches",
    "skip_items",
]


@dataclass(frozen=True, slots=True)
class IndexedBatches:
    """Torch's ``BatchSampler`` over a known order, able to start at any batch.

    ``sampler`` is the epoch's order (a ``range`` or a list); it is named as torch's
    attribute so that sharding reads its length like a ``BatchSampler``'s.

    >>> batches = IndexedBatches(range(5), 2, False)
    >>> list(batches), len(batches), list(batches.iter_from(2))
    ([[0, 1], [2, 3], [4]], 3, [[4]])
    """

    sampler: Sequence[int]
    batch_size: int
    drop_last: bool

    def __len__(self) -> int:
        n, bs = len(self.sampler), self.batch_size
        return n // bs if self.drop_last else -(-n // bs)

    def __iter__(self) -> Iterator[list[int]]:
        return self.iter_from(0)

    def iter_from(self, skip: int) -> Iterator[list[int]]:
        """Iterate the batches after the first ``skip``, without building those."""
        order, bs = self.sampler, self.batch_size
        starts = range(skip * bs, len(self) * bs, bs)
        if isinstance(order, list):
            return (order[start : start + bs] for start in starts)
        return (list(order[start : start + bs]) for start in starts)


def skip_items(source: Iterable[Any], skip: int) -> Iterator[Any]:
    """Iterate ``source`` after its first ``skip`` items, in O(1) where it can.

    >>> list(skip_items(IndexedBatches(range(4), 2, False), 1)), list(skip_items(iter("abc"), 2))
    ([[2, 3]], ['c'])
    """
    if isinstance(source, IndexedBatches):
        return source.iter_from(skip)
    if isinstance(source, (range, list)):
        return iter(source[skip:])
    return itertools.islice(iter(source), skip, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseIndices:
    """The unsharded index stream of a map-style loader, one epoch at a time.

    ``kind`` is ``"random"`` for the seeded replacement of a ``RandomSampler``
    (SPEC §4.2: the order torch's ``RandomSampler`` draws with a fresh generator
    seeded ``seed + epoch``), ``"sequential"`` for a ``SequentialSampler``, and
    ``"given"`` for anything else, used as it is. ``batched`` is false when the
    loader does not batch (then items are single indices); with ``"given"`` and
    ``batched``, ``source`` is the user's batch sampler, else the user's sampler.
    """

    kind: Literal["random", "sequential", "given"]
    source: Iterable[Any]
    batched: bool
    batch_size: int | None
    drop_last: bool
    seed: int

    def for_epoch(self, epoch: int) -> Iterable[Any]:
        """Return epoch ``epoch``'s stream (index lists, or indices when unbatched)."""
        if self.kind == "given":
            return self.source
        order: Sequence[int]
        if self.kind == "sequential":
            order = range(_sized_len(self.source))
        else:
            order = seeded_order(self.source, self.seed + epoch)
        return self._batched(order)

    def for_length(self) -> Iterable[Any]:
        """Return a stream with the length (and last batch) of any epoch, cheaply."""
        if self.kind == "given":
            return self.source
        if isinstance(self.source, RandomSampler):  # kind == "random"
            return self._batched(range(self.source.num_samples))
        return self._batched(range(_sized_len(self.source)))

    def _batched(self, order: Sequence[int]) -> Iterable[Any]:
        if not self.batched:
            return order
        assert self.batch_size is not None  # torch's BatchSampler has one
        return IndexedBatches(order, self.batch_size, self.drop_last)

    @property
    def generator(self) -> torch.Generator | None:
        """The generator the loader synchronises for ``"generator"`` (SPEC §4.2).

        ``None`` for the seeded replacement, whose generator is made fresh from the
        seed every epoch (synchronising it before reseeding would change nothing).
        """
        if self.kind == "random":
            return None
        for owner in (self.source, getattr(self.source, "sampler", None)):
            found = getattr(owner, "generator", None)
            if isinstance(found, torch.Generator):
                return found
        return None


def _sized_len(source: object) -> int:
    assert isinstance(source, Sized)  # SequentialSampler always is
    return len(source)


def seeded_order(sampler: Iterable[Any], seed: int) -> list[int]:
    """Return the order ``sampler`` (a ``RandomSampler``) draws with a fresh seed.

    The draws are torch's ``RandomSampler.__iter__``'s, made on a new CPU generator
    seeded ``seed``, but as whole tensors: the epoch's order costs a few C calls
    instead of one Python step per index (tests compare it with torch's own).

    >>> generator = torch.Generator().manual_seed(42)
    >>> sampler = RandomSampler(range(8), generator=generator)
    >>> seeded_order(sampler, 42) == list(sampler) == [6, 3, 0, 7, 2, 1, 4, 5]
    True
    """
    assert isinstance(sampler, RandomSampler)  # kind == "random"
    generator = torch.Generator()
    generator.manual_seed(seed)
    n, count = len(sampler.data_source), sampler.num_samples
    parts: list[torch.Tensor] = []
    if sampler.replacement:
        for _ in range(count // 32):
            parts.append(
                torch.randint(n, (32,), dtype=torch.int64, generator=generator)
            )
        parts.append(
            torch.randint(n, (count % 32,), dtype=torch.int64, generator=generator)
        )
    else:
        for _ in range(count // n):
            parts.append(torch.randperm(n, generator=generator))
        parts.append(torch.randperm(n, generator=generator)[: count % n])
    order: list[int] = torch.cat(parts).tolist()
    return order


class IndexSlot(Sampler[Any]):
    """The inner ``DataLoader``'s index sampler: yields what the loader loaded.

    Torch calls ``iter()`` on its index sampler once per epoch (twice when worker
    processes start, using the second); each call returns the loaded iterator, so
    the loader must ``load_`` a fresh one before every ``iter(dataloader)``. It has
    no ``len()``: the loader computes lengths itself.
    """

    def __init__(self) -> None:
        self._indices: Iterator[Any] = iter(())

    def load_(self, indices: Iterator[Any]) -> None:
        """Make ``indices`` the stream of the next ``iter(dataloader)``."""
        self._indices = indices

    def __iter__(self) -> Iterator[Any]:
        return self._indices


class _Counter:
    """Iterates ``dataset`` once per ``iter()``, counting what it read."""

    def __init__(self, dataset: Iterable[Any]) -> None:
        self.dataset = dataset
        self.count = 0

    def __iter__(self) -> Iterator[Any]:
        for sample in self.dataset:
            self.count += 1
            yield sample


class CountedStream(IterableDataset[tuple[Any, int]]):
    """Yield ``(sample, samples read so far)`` from a (sharded) unsized stream.

    With ``shard`` (keyword arguments of ``shard_iterable_dataset``) the stream is
    this rank's shard; the count is of the whole stream read so far, so at the
    shard's last sample it is the epoch's ``n``.

    >>> list(CountedStream(iter("abc"), None))
    [('a', 1), ('b', 2), ('c', 3)]
    """

    def __init__(self, dataset: Iterable[Any], shard: dict[str, Any] | None) -> None:
        self.dataset = dataset
        self.shard = shard

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        counter = _Counter(self.dataset)
        stream: Iterable[Any] = counter
        if self.shard is not None:
            stream = shard_iterable_dataset(counter, **self.shard)
        for sample in stream:
            yield sample, counter.count


class TaggedCollate:
    """Collate the samples of ``CountedStream`` and keep the last count.

    >>> TaggedCollate(list)([("a", 1), ("b", 2)])
    (['a', 'b'], 2)
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[tuple[Any, int]]) -> tuple[Any, int]:
        return self.collate_fn([sample for sample, _ in items]), items[-1][1]


def fetch_batch(
    dataset: Any, collate_fn: Callable[[Any], Any], indices: Any, *, batched: bool
) -> Any:
    """Read and collate one item of the index stream as torch's fetcher does.

    >>> fetch_batch([10, 11, 12], list, [2, 0], batched=True)
    [12, 10]
    """
    if not batched:
        return collate_fn(dataset[indices])
    getitems = getattr(dataset, "__getitems__", None)
    samples = getitems(indices) if getitems else [dataset[i] for i in indices]
    return collate_fn(samples)


# The profiler label of a batch read in-process, named like the one torch's
# DataLoader iterator gives each batch, so that a profile shows data loading under
# the same prefix.
READ_LABEL: Final = "enumerate(DataLoader)#ShardedLoader.__next__"
_profiling: Final[Callable[[], bool]] = getattr(
    torch._C._autograd, "_profiler_enabled", lambda: True
)


def read_batches(
    loader: DataLoader[Any], indices: Iterator[Any], *, batched: bool
) -> Iterator[Any]:
    """Yield ``loader``'s batches for ``indices``, read in this process.

    With no worker process, no pinning and no timeout, this is what iterating
    ``loader`` over ``indices`` yields (``fetch_batch`` of each item), read lazily,
    one item at a time, without the loader iterator's per-batch bookkeeping: its
    profiler range alone costs about 10 us per batch, so it is opened (as
    ``READ_LABEL``) only while a profiler runs. A ``StopIteration`` from the
    dataset or ``collate_fn`` ends the epoch, as it ends a ``DataLoader``'s.
    Otherwise the loader itself is iterated, its ``IndexSlot`` sampler loaded with
    ``indices``.

    >>> slot = IndexSlot()
    >>> loader = DataLoader(range(10, 20), batch_sampler=slot, collate_fn=list)
    >>> list(read_batches(loader, iter([[3, 1], [0]]), batched=True))
    [[13, 11], [10]]
    """
    if loader.num_workers > 0 or loader.pin_memory or loader.timeout:
        # torch's own iterator: worker processes, pinning, or (with no workers)
        # its refusal of a timeout
        sampler = loader.batch_sampler if batched else loader.sampler
        assert isinstance(sampler, IndexSlot)
        sampler.load_(indices)
        yield from loader
        return
    dataset, collate = loader.dataset, loader.collate_fn
    for item in indices:
        try:
            if _profiling():
                with torch.profiler.record_function(READ_LABEL):
                    data = fetch_batch(dataset, collate, item, batched=batched)
            else:
                data = fetch_batch(dataset, collate, item, batched=batched)
        except StopIteration:
            return  # from the dataset or collate_fn: it ends a DataLoader's epoch too
        yield data
