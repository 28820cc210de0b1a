"""The records of a loader over a ``StatefulStream``, each with the stream's state.

The rules: docs/data.md#resuming-a-stream and docs/data.md#worker-processes.
``records`` is the one entry of ``iter_batches`` and ``ShardedLoader.__iter__``:
it hands a stateful stream to the functions here and every other loader to
``_stream.plain_records``.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from collections.abc import Iterator
from functools import partial
from typing import Any

from funcaccel.loader._placement import send_tree
from funcaccel.loader._setup import Setup
from funcaccel.loader._state import Batch
from funcaccel.loader._state import make_batch
from funcaccel.loader._stateful import Resume
from funcaccel.loader._stateful import StatefulStream
from funcaccel.loader._stateful import StreamTag
from funcaccel.loader._stream import dispatched_rows
from funcaccel.loader._stream import epoch_samples
from funcaccel.loader._stream import flag_last
from funcaccel.loader._stream import open_epoch
from funcaccel.loader._stream import plain_records
from funcaccel.loader._stream import skip_exactly
from funcaccel.loader._stream import start_epoch
from funcaccel.loader._workers import in_cycle
from funcaccel.loader._workers import worker_resumes

__all__ = ["records"]


def records(
    setup: Setup, epoch: int, skip: int, stream_state: Any = None
) -> Iterator[Batch]:
    """Yield the ``Batch`` records of ``epoch`` after this rank's first ``skip``.

    ``stream_state`` is a stateful stream's position after those batches
    (``LoaderState.stream_state``); other loaders ignore it.
    """
    if setup.dispatch and setup.stateful:  # rank 0 reads the stream
        return _dispatched_stream_records(setup, epoch, skip, stream_state)
    if setup.stateful and setup.inner is not None and setup.inner.num_workers:
        return _worker_records(setup, epoch, skip, stream_state)
    if setup.stateful:
        return _stateful_records(setup, epoch, skip, stream_state)
    return plain_records(setup, epoch, skip)


def _stateful_records(
    setup: Setup, epoch: int, skip: int, stream_state: Any
) -> Iterator[Batch]:
    """``records`` for a ``StatefulStream``: each record carries the stream's state."""
    total, n = setup.total_batch_size, epoch_samples(setup)
    assert total is not None  # stream_resumes
    ranks = setup.view.num_processes
    device = setup.ctx.device if setup.put_on_device else None
    fixed = -1 if setup.drop_last or n is None else n % total
    items = open_epoch(setup, epoch, skip, stream_state)
    for index, ((data, tag), last) in enumerate(flag_last(items), skip):
        if device is not None:
            data = send_tree(data, device, setup.non_blocking)
        if not last:
            state = None if tag.state is None else {"source": tag.state}
            yield make_batch(data, index, False, fixed, epoch, total, state, ranks)
            continue
        remainder = fixed if n is not None or setup.drop_last else tag.seen % total
        yield make_batch(data, index, True, remainder, epoch, total, None, ranks)


def _worker_records(
    setup: Setup, epoch: int, skip: int, stream_state: Any
) -> Iterator[Batch]:
    """``records`` for a ``StatefulStream`` read by worker processes (docs/data.md)."""
    total, n = setup.total_batch_size, epoch_samples(setup)
    inner = setup.inner
    assert total is not None and inner is not None
    stream: Any = inner.dataset
    assert isinstance(stream, StatefulStream)
    start_epoch(setup, epoch, skip)
    entries: list[Any] = [None] * inner.num_workers
    first = 0
    if skip and stream_state is not None:
        entries, first = stream_state["workers"], stream_state["next"]
    stream.load_(worker_resumes(entries) if skip and stream_state is not None else None)
    items = in_cycle(iter(inner), entries, first)
    if skip and stream_state is None:
        skip_exactly(setup, items, skip, epoch)  # no position saved: replay
    ranks = setup.view.num_processes
    device = setup.ctx.device if setup.put_on_device else None
    # Each worker pads its own last global batch, so remainder is only the rule's.
    fixed = -1 if setup.drop_last or n is None else n % total
    for index, ((data, state), last) in enumerate(flag_last(items), skip):
        if device is not None:
            data = send_tree(data, device, setup.non_blocking)
        kept = None if last else state
        yield make_batch(data, index, last, fixed, epoch, total, kept, ranks)


def _dispatched_stream_records(
    setup: Setup, epoch: int, skip: int, stream_state: Any
) -> Iterator[Batch]:
    """Rank 0 of a dispatching loader over a ``StatefulStream``: ``records`` with states.

    The stream yields the original loader's batches, each with the stream's state;
    the state after every ``group``-th one (a whole global batch) goes with that
    global batch's record. Other ranks run ``plain_records``: the same collectives.
    """
    view, inner, total = setup.view, setup.inner, setup.total_batch_size
    assert inner is not None and total is not None
    stream: Any = inner.dataset
    assert isinstance(stream, StatefulStream)
    start_epoch(setup, epoch, skip)
    group = 1 if setup.split_batches else view.num_processes
    jump = skip > 0 and stream_state is not None
    stream.load_(Resume(skip * total, stream_state["source"]) if jump else None)
    states: deque[Any] = deque()  # after each global batch read, in order

    def untagged(pairs: Iterator[tuple[Any, StreamTag]]) -> Iterator[Any]:
        for count, (data, tag) in enumerate(pairs, 1):
            if count % group == 0:
                states.append(tag.state)
            yield data

    base = untagged(iter(inner))
    pad_source: Callable[[], list[Any]] | None = None
    if jump:
        pad_source = partial(_first_global_batch, setup, stream.dataset, group)
    elif skip:  # no position saved: replay, keeping the first global batch to pad
        head = list(itertools.islice(base, group))
        skip_exactly(setup, itertools.chain(head, base), skip * group, epoch, group)
        states.clear()
        pad_source = head.copy
    ranks = view.num_processes
    for index, data, is_last, remainder in dispatched_rows(
        setup, base, pad_source, skip
    ):
        state = states.popleft() if states else None
        position = None if state is None else {"source": state}
        yield make_batch(data, index, is_last, remainder, epoch, total, position, ranks)


def _first_global_batch(setup: Setup, dataset: Any, group: int) -> list[Any]:
    """The epoch's first ``group`` original batches, read again (to pad the last)."""
    bs, collate = setup.batch_size, setup.dataloader.collate_fn
    assert bs is not None
    samples = list(itertools.islice(iter(dataset), bs * group))
    return [collate(samples[i : i + bs]) for i in range(0, len(samples), bs)]
