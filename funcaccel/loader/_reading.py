"""How the loader reads batches: its inner ``DataLoader``'s sampler and in-process reads.

``IndexSlot`` is the index sampler of the loader's inner ``DataLoader``: the loader
loads each epoch's iterator into it right before iterating, so one ``DataLoader``
(and its persistent workers) serves every epoch. ``read_batches`` reads batches in
this process when no worker, pinning or timeout asks for torch's iterator.
``CountedStream`` and ``TaggedCollate`` count the samples an unsized stream
produced, through the worker processes if there are any, so the last batch can
carry the remainder.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from typing import Any
from typing import Final

import torch
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset
from torch.utils.data import Sampler

from funcaccel.sharding import shard_iterable_dataset

__all__ = [
    "READ_LABEL",
    "CountedStream",
    "IndexSlot",
    "TaggedCollate",
    "fetch_batch",
    "read_batches",
]


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
