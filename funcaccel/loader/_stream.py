"""One epoch of a ``ShardedLoader``, as a stream of batches.

The rules: docs/loader.md#semantics-building-a-sharded-loader, docs/loader.md#semantics-epoch-order-and-rng-synchronisation, docs/loader.md#semantics-dispatch-mode.

Each function takes the loader's ``Setup`` and the epoch; the epoch-start work of
docs/loader.md#semantics-epoch-order-and-rng-synchronisation (synchronise, seed, ``set_epoch``) runs when the stream is first advanced.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sized
from typing import Any
from typing import Final

from funcaccel._checks import type_name
from funcaccel.loader._dispatch import dispatch_epoch
from funcaccel.loader._indices import IndexedBatches
from funcaccel.loader._indices import skip_items
from funcaccel.loader._placement import send_tree
from funcaccel.loader._reading import fetch_batch
from funcaccel.loader._reading import read_batches
from funcaccel.loader._setup import Setup
from funcaccel.loader._state import Batch
from funcaccel.loader._state import LoaderState
from funcaccel.loader._state import make_batch
from funcaccel.loader._stateful import Resume
from funcaccel.loader._stateful import StatefulStream
from funcaccel.rng import sync_rng_states
from funcaccel.sharding import shard_batch_sampler

__all__ = [
    "END",
    "dispatched_rows",
    "epoch_length",
    "epoch_samples",
    "length",
    "local_batches",
    "open_epoch",
    "past_the_end",
    "plain_records",
    "skip_exactly",
    "start_epoch",
]

END: Final = object()


def _unsized(what: object) -> TypeError:
    return TypeError(
        f"ShardedLoader.__len__: the {type_name(what)} has no len(), so the "
        "number of batches is unknown; give it a __len__ or do not call len()."
    )


def length(setup: Setup, rank: int | None = None) -> int:
    """Return ``len(loader)``: batches rank ``rank`` (default: this one) yields per epoch.

    The rules: docs/loader.md#semantics-building-a-sharded-loader, docs/loader.md#semantics-dispatch-mode.
    """
    ctx, bs, drop_last = setup.view, setup.batch_size, setup.drop_last
    rank = ctx.process_index if rank is None else rank
    p = ctx.num_processes
    if setup.base is not None:
        stream = setup.base.for_length()
        if not isinstance(stream, Sized):
            raise _unsized(stream)
        if p > 1 and not setup.dispatch:
            shard = shard_batch_sampler(
                stream,
                num_processes=p,
                process_index=rank,
                split_batches=setup.split_batches,
                even_batches=setup.even_batches,
            )
            return len(shard)
        k = len(stream)
    else:
        dataset = setup.dataloader.dataset
        if not isinstance(dataset, Sized):
            raise _unsized(dataset)
        n = len(dataset)
        k = n if bs is None else n // bs if drop_last else -(-n // bs)
    # Iterable shards and dispatch both group k base batches by p (docs/loader.md#semantics-building-a-sharded-loader and docs/loader.md#semantics-dispatch-mode).
    if p == 1 or setup.split_batches:
        return k
    return k // p if drop_last else -(-k // p)


def epoch_length(setup: Setup) -> int:
    """Return the global batches per epoch: ``len(loader)`` on rank 0, the longest.

    The same on every rank; with ``even_batches=False`` other ranks may yield fewer.
    """
    return length(setup, 0)


def epoch_samples(setup: Setup) -> int | None:
    """Return ``n`` for the remainder: ``len(sampler)``, or ``len(dataset)``."""
    if setup.base is not None:
        stream = setup.base.for_length()
        if isinstance(stream, IndexedBatches):
            return len(stream.sampler)
        sampler = stream if not setup.base.batched else getattr(stream, "sampler", None)
        if isinstance(sampler, Sized):
            return len(sampler)
    dataset = setup.dataloader.dataset
    return len(dataset) if isinstance(dataset, Sized) else None


def start_epoch(setup: Setup, epoch: int, skip: int) -> None:
    """Start an epoch on every rank: synchronise, seed, ``set_epoch``, then draw.

    The rules: docs/loader.md#semantics-epoch-order-and-rng-synchronisation. The
    draws from torch's global generator are those of Accelerate's loader, made
    where its iterator makes them (after ``set_epoch``); a resumed epoch
    (``skip > 0``) makes none: docs/loader.md#draws-from-torchs-global-generator.
    """
    sync_rng_states(
        setup.ctx, setup.rng_types, setup.sync_generator, caller="iter_batches"
    )
    if setup.reseed_generator is not None:
        setup.reseed_generator.manual_seed(setup.seed + epoch)
    setup.worker_generator.manual_seed(setup.seed + epoch)
    for target in setup.epoch_targets:
        target.set_epoch(epoch)
    setup.draws.start_epoch(resumed=skip > 0)


def _consume(iterator: Iterator[Any], count: int) -> int:
    """Drop the next ``count`` items of ``iterator``; return how many there were."""
    return sum(1 for _ in itertools.islice(iterator, count))


def past_the_end(
    epoch: int,
    skip: int,
    batches: int,
    total: int | None,
    state: LoaderState | None = None,
) -> ValueError:
    """The error for a resume state beyond the end of the epoch."""
    size = "" if total is None else f" of {total} samples"
    named = "the state" if state is None else repr(state)
    return ValueError(
        f"iter_batches: {named} is {skip} global batches{size} into epoch {epoch}, "
        f"past the end of the epoch: this loader's epoch has {batches} global "
        f"batches (len(loader) on rank 0). Resume from a state this loader saved "
        f"(batch.state), from LoaderState(epoch={epoch}, global_batches={batches}) "
        f"at the most, or from LoaderState(epoch={epoch + 1}) to start the next epoch."
    )


def skip_exactly(
    setup: Setup, iterator: Iterator[Any], skip: int, epoch: int, group: int = 1
) -> None:
    """Drop this rank's first ``skip`` items; a stream that ends first is an error.

    The up-front check of ``iter_batches`` needs ``len()``; an unsized stream is
    checked here, while it is read. ``group`` items make one global batch (the
    last one may be short unless ``drop_last``), and ``skip`` is a multiple of it.
    """
    dropped = _consume(iterator, skip)
    if dropped < skip:
        batches = dropped // group if setup.drop_last else -(-dropped // group)
        if batches < skip // group:
            raise past_the_end(epoch, skip // group, batches, setup.total_batch_size)


def open_epoch(
    setup: Setup, epoch: int, skip: int, stream_state: Any = None
) -> Iterator[Any]:
    """Start ``epoch`` and return this rank's batch iterator.

    The epoch's start: docs/loader.md#semantics-epoch-order-and-rng-synchronisation.

    The iterator is the inner ``DataLoader``'s own, positioned after this rank's
    first ``skip`` batches: for map-style data only indices were skipped; a
    stateful stream given its ``stream_state`` loads it (docs/data.md); other
    iterable data has the skipped batches read and dropped.
    """
    start_epoch(setup, epoch, skip)
    assert setup.inner is not None  # only dispatch ranks > 0 have none
    if setup.base is None:
        jump = setup.stateful and skip > 0 and stream_state is not None
        if setup.stateful:
            stream: Any = setup.inner.dataset
            total = setup.total_batch_size
            assert isinstance(stream, StatefulStream) and total is not None
            resume = Resume(skip * total, stream_state["source"]) if jump else None
            stream.load_(resume)
        batches = iter(setup.inner)
        if not jump:
            skip_exactly(setup, batches, skip, epoch)
        return batches
    ctx, stream = setup.view, setup.base.for_epoch(epoch)
    indices: Iterator[Any]
    if ctx.num_processes == 1:
        indices = skip_items(stream, skip)
    else:
        shard = shard_batch_sampler(
            stream,
            num_processes=ctx.num_processes,
            process_index=ctx.process_index,
            split_batches=setup.split_batches,
            even_batches=setup.even_batches,
        )
        indices = shard.iter_from(skip)
    return read_batches(setup.inner, indices, batched=setup.base.fetch_batched)


def local_batches(setup: Setup, epoch: int) -> Iterator[Any]:
    """Yield this rank's batches of ``epoch``: the data only, on the device if asked.

    The epoch starts when the first batch is asked for.
    """
    batches = open_epoch(setup, epoch, 0)
    device = setup.ctx.device if setup.put_on_device else None
    non_blocking = setup.non_blocking
    if setup.counted:
        batches = (data for data, _ in batches)
    if device is None:
        yield from batches
        return
    for batch in batches:
        yield send_tree(batch, device, non_blocking)


def _dispatch_base(
    setup: Setup, epoch: int, skip: int, head: list[Any]
) -> Iterator[Any]:
    """Rank 0: yield the original batches after the first ``skip``.

    When ``skip > 0`` the epoch's first ``len(head)`` items (index lists, or
    batches of iterable data) are skipped, so they are stored in ``head`` first:
    the last global batch may need padding from them.
    """
    assert setup.inner is not None
    head_count = len(head)
    if setup.base is None:
        batches = iter(setup.inner)
        if skip:
            head[:] = itertools.islice(batches, head_count)
            skip_exactly(setup, itertools.chain(head, batches), skip, epoch, head_count)
        yield from batches
        return
    stream = setup.base.for_epoch(epoch)
    indices: Iterator[Any]
    if skip and isinstance(stream, (IndexedBatches, list, range)):
        # A fixed order: take the head from its start, then jump to the rest.
        head[:] = itertools.islice(iter(stream), head_count)
        indices = skip_items(stream, skip)
    else:
        indices = iter(stream)  # the user's own: one pass, head first
        if skip:
            head[:] = itertools.islice(indices, head_count)
            skip_exactly(setup, itertools.chain(head, indices), skip, epoch, head_count)
    yield from read_batches(setup.inner, indices, batched=setup.base.fetch_batched)


def plain_records(setup: Setup, epoch: int, skip: int) -> Iterator[Batch]:
    """Yield the ``Batch`` records of ``epoch`` after this rank's first ``skip``.

    For every loader but one over a ``StatefulStream`` (``_stream_records.py``).
    """
    if setup.dispatch:
        yield from _dispatched_records(setup, epoch, skip)
        return
    if setup.counted:
        yield from _counted_records(setup, epoch, skip)
        return
    total, n = setup.total_batch_size, epoch_samples(setup)
    known = not (setup.drop_last or total is None or n is None)
    remainder = n % total if known and n is not None and total else -1
    device = setup.ctx.device if setup.put_on_device else None
    non_blocking = setup.non_blocking
    items = open_epoch(setup, epoch, skip)
    # One batch ahead, so that the last one is known while it is processed. The
    # loops are written out per case: this runs once per batch.
    current = next(items, END)
    if current is END:
        return
    index = skip
    if device is None:
        for following in items:
            yield make_batch(current, index, False, remainder, epoch, total)
            current, index = following, index + 1
        yield make_batch(current, index, True, remainder, epoch, total)
        return
    for following in items:
        data = send_tree(current, device, non_blocking)
        yield make_batch(data, index, False, remainder, epoch, total)
        current, index = following, index + 1
    data = send_tree(current, device, non_blocking)
    yield make_batch(data, index, True, remainder, epoch, total)


def flag_last(items: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
    """Yield ``(item, is_last)``, one item ahead so the last is known when it is yielded."""
    current = next(items, END)
    if current is END:
        return
    for following in items:
        yield current, False
        current = following
    yield current, True


def _counted_records(setup: Setup, epoch: int, skip: int) -> Iterator[Batch]:
    """``records`` for an unsized stream: the last batch carries the observed count."""
    total = setup.total_batch_size
    assert total is not None and not setup.drop_last  # see build_setup
    device = setup.ctx.device if setup.put_on_device else None
    for index, ((data, seen), last) in enumerate(
        flag_last(open_epoch(setup, epoch, skip)), skip
    ):
        if device is not None:
            data = send_tree(data, device, setup.non_blocking)
        remainder = seen % total if last else -1
        yield make_batch(data, index, last, remainder, epoch, total)


def _dispatched_records(setup: Setup, epoch: int, skip: int) -> Iterator[Batch]:
    ctx, view = setup.ctx, setup.view
    start_epoch(setup, epoch, skip)
    group = 1 if setup.split_batches else view.num_processes
    base: Iterator[Any] | None = None
    pad_source: Callable[[], list[Any]] | None = None
    if ctx.process_index == 0:
        head: list[Any] = [None] * group  # filled by _dispatch_base when skipped
        base = _dispatch_base(setup, epoch, skip * group, head)
        if skip and setup.base is None:
            pad_source = head.copy  # the skipped first batches themselves
        elif skip:
            pad_source = _refetch(setup, head)
    total = setup.total_batch_size
    for index, data, is_last, remainder in dispatched_rows(
        setup, base, pad_source, skip
    ):
        yield make_batch(data, index, is_last, remainder, epoch, total)


def dispatched_rows(
    setup: Setup,
    base: Iterator[Any] | None,
    pad_source: Callable[[], list[Any]] | None,
    skip: int,
) -> Iterator[tuple[int, Any, bool, int]]:
    """Run ``dispatch_epoch`` for ``setup`` from global batch ``skip`` on.

    ``base`` and ``pad_source`` are rank 0's (``None`` elsewhere). Yields each
    batch's index, this rank's share on ``ctx.device``, whether it is the last,
    and its remainder (the last batch's real rows, else -1).
    """
    ctx, view = setup.ctx, setup.view
    group = 1 if setup.split_batches else view.num_processes
    for offset, (data, is_last, rows) in enumerate(
        dispatch_epoch(
            ctx,
            base_batches=base,
            pad_source=pad_source,
            group=group,
            drop_last=setup.drop_last,
            first_index=skip,
            slice_fn=setup.slice_fn,
            shares=view.num_processes,
            share=view.process_index,
        )
    ):
        data = send_tree(data, ctx.device, setup.non_blocking)
        yield skip + offset, data, is_last, rows if is_last else -1


def _refetch(setup: Setup, head: list[Any]) -> Callable[[], list[Any]]:
    inner = setup.inner
    assert inner is not None
    batched = setup.dataloader.batch_sampler is not None

    def fetch() -> list[Any]:
        # The head's index lists were skipped, not read: read them now.
        return [
            fetch_batch(inner.dataset, inner.collate_fn, item, batched=batched)
            for item in head
        ]

    return fetch
