"""The records of a loader over a ``StatefulStream``, each with the stream's state.

The rules: docs/data.md#resuming-a-stream and docs/data.md#worker-processes.
``records`` is the one entry of ``iter_batches`` and ``ShardedLoader.__iter__``:
it hands a stateful stream to the functions here and every other loader to
``_stream.plain_records``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from funcaccel.loader._placement import send_tree
from funcaccel.loader._setup import Setup
from funcaccel.loader._state import Batch
from funcaccel.loader._state import make_batch
from funcaccel.loader._stateful import StatefulStream
from funcaccel.loader._stream import END
from funcaccel.loader._stream import epoch_samples
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
    current: Any = next(items, END)
    if current is END:
        return
    index = skip
    for following in items:
        data, tag = current
        if device is not None:
            data = send_tree(data, device, setup.non_blocking)
        state = None if tag.state is None else {"source": tag.state}
        yield make_batch(data, index, False, fixed, epoch, total, state, ranks)
        current, index = following, index + 1
    data, tag = current
    if device is not None:
        data = send_tree(data, device, setup.non_blocking)
    last = fixed if n is not None or setup.drop_last else tag.seen % total
    yield make_batch(data, index, True, last, epoch, total, None, ranks)


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
    current: Any = next(items, END)
    if current is END:
        return
    index = skip
    for following in items:
        data, state = current
        if device is not None:
            data = send_tree(data, device, setup.non_blocking)
        yield make_batch(data, index, False, fixed, epoch, total, state, ranks)
        current, index = following, index + 1
    data, _ = current
    if device is not None:
        data = send_tree(data, device, setup.non_blocking)
    yield make_batch(data, index, True, fixed, epoch, total, None, ranks)
