"""Where each epoch's indices come from, and how a resume skips them.

The rules: docs/loader.md#semantics-resuming-from-a-loaderstate, docs/loader.md#semantics-epoch-order-and-rng-synchronisation.

``BaseIndices`` describes, once per loader, the unsharded index stream of the
original ``DataLoader``: the seeded replacement of a shuffling ``RandomSampler``, a
sequential order, or the user's own (batch) sampler. Its ``for_epoch(epoch)`` gives
that epoch's stream as a value; for the first two it is an ``IndexedBatches`` (or a
plain sequence of indices) that skips any number of batches in constant time, so a
resume costs the same at 90 % of an epoch as at its start.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any
from typing import Literal

import torch
from torch.utils.data import RandomSampler

__all__ = ["BaseIndices", "IndexedBatches", "seeded_order", "skip_items"]


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
    (docs/loader.md#semantics-epoch-order-and-rng-synchronisation: the order torch's ``RandomSampler`` draws with a fresh generator
    seeded ``seed + epoch``), ``"sequential"`` for a ``SequentialSampler``, and
    ``"given"`` for anything else, used as it is. ``batched`` is false when the
    loader does not batch (then items are single indices); with ``"given"`` and
    ``batched``, ``source`` is the user's batch sampler, else the user's sampler.
    ``whole_items`` is true for a ``DataLoader(sampler=BatchSampler(...),
    batch_size=None)``: the stream is batched, but each index list is passed to
    the dataset whole (``dataset[indices]``), as that ``DataLoader`` does.
    """

    kind: Literal["random", "sequential", "given"]
    source: Iterable[Any]
    batched: bool
    batch_size: int | None
    drop_last: bool
    seed: int
    whole_items: bool = False

    @property
    def fetch_batched(self) -> bool:
        """Whether each item is fetched index by index (torch's automatic batching)."""
        return self.batched and not self.whole_items

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
        """The generator the loader synchronises for ``"generator"``.

        The rules: docs/loader.md#semantics-epoch-order-and-rng-synchronisation.

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
