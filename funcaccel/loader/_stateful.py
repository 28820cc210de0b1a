"""A stream that says where it stands: the O(1) resume of a stateful iterable dataset.

A *stateful* dataset is an iterable dataset with ``state_dict()`` and
``load_state_dict(state)`` (a ``datasets.IterableDataset``, or a dataset of your
own): ``state_dict()`` taken between two samples is the position after the sample
yielded last, and an iteration after ``load_state_dict(state)`` continues from
there. ``StatefulStream`` reads such a dataset in global batches of ``G`` samples,
exactly as ``shard_iterable_dataset`` does, and tags this rank's samples of each
with the source's state after that global batch, so that the loader can hand the
state out with the batch (``Batch.state``) and a resume can load it instead of
reading the skipped samples again. Every rank reads the whole stream, so the
state after ``k`` global batches is the same on every rank and for every world
size: a resume on another world size continues the same global order.

The rules: docs/data.md#resuming-a-stream.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from typing import Final

from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset
from torch.utils.data import get_worker_info

from funcaccel._stream_state import resumes_exactly
from funcaccel.loader._reading import TaggedCollate

__all__ = [
    "DONE",
    "Resume",
    "StatefulStream",
    "StreamCollate",
    "StreamTag",
    "WorkerResumes",
    "is_stateful",
    "stateful_loader",
    "stream_resumes",
]


def is_stateful(dataset: object) -> bool:
    """Whether ``dataset`` is an iterable dataset whose own state resumes it exactly.

    It has ``state_dict`` and ``load_state_dict``, and is no ``datasets`` stream
    shuffled through a buffer (``funcaccel._stream_state``).

    >>> class Counter(IterableDataset[int]):
    ...     def __iter__(self): return iter(range(3))
    ...     def state_dict(self): return {}
    ...     def load_state_dict(self, state): pass
    >>> is_stateful(Counter()), is_stateful(range(3))
    (True, False)
    """
    return isinstance(dataset, IterableDataset) and resumes_exactly(dataset)


@dataclass(frozen=True, slots=True)
class StreamTag:
    """What each sample of a ``StatefulStream`` carries.

    Attributes:
        seen: Samples of the epoch read so far, skipped ones included.
        state: The source's ``state_dict()`` after the global batch the sample
            belongs to; ``None`` in the padded last global batch.
    """

    seen: int
    state: Any
    worker: int = 0
    end: bool = False  # the end marker of a worker's stream (its sample is None)


@dataclass(frozen=True, slots=True)
class Resume:
    """Where the next iteration of a ``StatefulStream`` starts.

    Attributes:
        consumed: Samples of the epoch already consumed (whole global batches).
        state: The source's ``state_dict()`` after them.
    """

    consumed: int
    state: Any


# What each worker process of a loader with workers resumes from, by worker id:
# a Resume, None (its stream from the start) or DONE (its stream had ended).
WorkerResumes = tuple["Resume | None | str", ...]
DONE: Final = "done"


class StatefulStream(IterableDataset[tuple[Any, StreamTag]]):
    """This rank's samples of a stateful stream, each with a ``StreamTag``.

    Global batches of ``size`` samples are read one at a time; this rank keeps
    positions ``[lo, hi)`` of each. With ``pad`` a last partial global batch is
    padded from the epoch's first global batch (or from itself when none was
    full), as ``shard_iterable_dataset`` pads; without it (one process) it is
    kept short, or dropped with ``drop_last``.

    ``load_(resume)`` makes the next ``iter()`` continue after ``resume``: the
    source is deep-copied and the copy loaded, so the caller's dataset never
    changes position; nothing of the skipped samples is read (the padding of a
    last partial global batch reads the epoch's first one again).

    >>> class Numbers(IterableDataset[int]):
    ...     def __init__(self): self.at = 0
    ...     def __iter__(self):
    ...         while self.at < 5:
    ...             self.at += 1
    ...             yield self.at - 1
    ...         self.at = 0
    ...     def state_dict(self): return {"at": self.at}
    ...     def load_state_dict(self, state): self.at = state["at"]
    >>> stream = StatefulStream(Numbers(), size=2, lo=0, hi=2, pad=True, drop_last=False)
    >>> [(x, t.seen, t.state) for x, t in stream]
    [(0, 2, {'at': 2}), (1, 2, {'at': 2}), (2, 4, {'at': 4}), (3, 4, {'at': 4}), (4, 5, None), (0, 5, None)]
    >>> stream.load_(Resume(consumed=2, state={"at": 2}))
    >>> [x for x, _ in stream]
    [2, 3, 4, 0]
    """

    def __init__(
        self,
        dataset: Any,
        *,
        size: int,
        lo: int,
        hi: int,
        pad: bool,
        drop_last: bool,
        mark_end: bool = False,
    ) -> None:
        self.dataset = dataset
        self.size, self.lo, self.hi = size, lo, hi
        self.pad, self.drop_last, self.mark_end = pad, drop_last, mark_end
        self._resume: Resume | WorkerResumes | None = None

    def load_(self, resume: Resume | WorkerResumes | None) -> None:
        """Make the next ``iter()`` start after ``resume`` (``None``: at the epoch's start).

        A tuple gives each worker process its own (indexed by worker id).
        """
        self._resume = resume

    def _head(self) -> list[Any]:
        """Read the epoch's first global batch from the (never loaded) dataset."""
        head: list[Any] = []
        for sample in self.dataset:
            head.append(sample)
            if len(head) == self.size:
                break
        return head

    def _source(self, resume: Resume | None) -> Any:
        if resume is None:
            return self.dataset
        source = copy.deepcopy(self.dataset)
        source.load_state_dict(copy.deepcopy(resume.state))
        return source

    def __iter__(self) -> Iterator[tuple[Any, StreamTag]]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        loaded = self._resume
        mine = loaded[worker] if isinstance(loaded, tuple) else loaded
        seen = 0
        if isinstance(mine, Resume):
            seen = mine.consumed
            yield from self._samples(mine, worker)
        elif mine is None:
            yield from self._samples(None, worker)
        if self.mark_end:
            yield None, StreamTag(seen, None, worker, end=True)

    def _samples(
        self, resume: Resume | None, worker: int
    ) -> Iterator[tuple[Any, StreamTag]]:
        size, lo, hi = self.size, self.lo, self.hi
        source = self._source(resume)
        seen = 0 if resume is None else resume.consumed
        first: list[Any] | None = None  # the epoch's first full global batch
        buffer: list[Any] = []
        for sample in source:
            buffer.append(sample)
            if len(buffer) == size:
                seen += size
                tag = StreamTag(seen, source.state_dict(), worker)
                yield from ((kept, tag) for kept in buffer[lo:hi])
                if seen == size:  # not resumed: the epoch's first global batch
                    first = buffer
                buffer = []
        if not buffer or self.drop_last:
            return
        seen += len(buffer)
        end = StreamTag(seen, None, worker)
        if self.pad:
            if first is None:
                # Resumed after at least one full global batch: read the first again.
                first = buffer if seen < size else self._head()
            # The loop-back of shard_iterable_dataset: cycle through ``first``.
            buffer += [first[t % len(first)] for t in range(size - len(buffer))]
        yield from ((kept, end) for kept in buffer[lo:hi])


class StreamCollate:
    """Collate a worker's ``StatefulStream`` batch: ``(data, tag, ended)``.

    The end marker is left out of the data; ``data`` is ``None`` when the batch
    held nothing else. ``tag`` is the last real sample's (the marker's when none).

    >>> end = StreamTag(3, None, 1, end=True)
    >>> StreamCollate(list)([("a", StreamTag(3, {}, 1)), (None, end)])
    (['a'], StreamTag(seen=3, state={}, worker=1, end=False), True)
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(
        self, items: list[tuple[Any, StreamTag]]
    ) -> tuple[Any, StreamTag, bool]:
        real = [(sample, tag) for sample, tag in items if not tag.end]
        ended = items[-1][1].end
        if not real:
            return None, items[-1][1], ended
        return self.collate_fn([sample for sample, _ in real]), real[-1][1], ended


def stream_resumes(
    dataset: Any, dispatch: bool, total: int | None, kept: Mapping[str, Any]
) -> bool:
    """Whether ``shard_loader`` reads ``dataset`` through a ``StatefulStream``.

    A stateful dataset, batched (``total`` is the global batch size), read in this
    process (by every rank, or by rank 0 when dispatching) or, not dispatching,
    by workers that start afresh each epoch.
    """
    return (
        is_stateful(dataset)
        and total is not None
        # persistent workers keep the stream they were given at the first epoch;
        # when dispatching, rank 0 reads in this process only
        and not (kept["num_workers"] and (kept["persistent_workers"] or dispatch))
    )


def stateful_loader(
    dataset: Any,
    shard: tuple[int, int, int, int, bool, bool],
    kept: dict[str, Any],
    *,
    whole: bool = False,
) -> DataLoader[Any]:
    """Return the inner ``DataLoader`` over a ``StatefulStream`` of ``dataset``.

    ``shard`` is ``(bs, G, ranks, rank, split_batches, drop_last)``; ``kept`` the
    settings the inner loader keeps (its ``collate_fn`` is wrapped). ``whole``:
    rank 0 of a dispatching loader, which reads global batches of ``G`` whole, in
    the original loader's batches of ``bs``.
    """
    bs, total, p, rank, split, drop_last = shard
    c = bs if whole else total // p if split else bs
    lo = rank * c if p > 1 else 0
    workers = kept["num_workers"] > 0
    stream = StatefulStream(
        dataset,
        size=total if p > 1 or whole else bs,
        lo=0 if whole else lo,
        hi=total if whole else lo + c,
        pad=p > 1,
        drop_last=drop_last and not whole,
        mark_end=workers,
    )
    settings = dict(kept)
    if workers:  # docs/data.md#worker-processes: each worker marks its end
        settings["collate_fn"] = StreamCollate(kept["collate_fn"])
        return DataLoader(stream, batch_size=c, drop_last=False, **settings)
    settings["collate_fn"] = TaggedCollate(kept["collate_fn"])
    return DataLoader(stream, batch_size=c, drop_last=drop_last, **settings)
