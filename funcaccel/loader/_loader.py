"""Sharded data loading: ``shard_loader``, ``iter_batches``, ``LoaderState``.

The rules: docs/loader.md#semantics-building-a-sharded-loader, docs/loader.md#semantics-dispatch-mode.

``shard_loader(ctx, dataloader)`` returns a ``ShardedLoader``: a drop-in for the
``DataLoader`` that yields this rank's batches, on ``ctx.device``. The caller's
``DataLoader``, sampler and lists are never modified; the loader builds its own inner
``DataLoader`` with the same worker and collation settings.

``iter_batches(loader, state)`` yields ``Batch`` records (``data``, ``index``,
``is_last``, ``remainder``, ``state``); ``state`` is the ``LoaderState`` to resume
from, counted in global batches so that it carries across world sizes.

With 2 ranks, 10 samples and ``batch_size=3`` (map-style, not shuffled), rank 0
yields [0,1,2] [6,7,8] and rank 1 yields [3,4,5] [9,0,1], ``is_last`` F,T on both,
``total_batch_size`` 6 and ``remainder`` 4 (the last global batch holds 4 real
samples; [0,1] are looped back). Resuming rank 1 from ``LoaderState(epoch=0,
global_batches=1, global_batch_size=6)`` yields only [9,0,1], without reading
samples 3, 4 and 5.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any
from typing import Final

from torch.utils.data import DataLoader

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._typing import RngType
from funcaccel.context import DistributedContext
from funcaccel.loader._draws import draw_global
from funcaccel.loader._placement import send_to_device
from funcaccel.loader._setup import Setup
from funcaccel.loader._setup import build_setup
from funcaccel.loader._setup import plan_setup
from funcaccel.loader._state import START
from funcaccel.loader._state import Batch
from funcaccel.loader._state import LoaderState
from funcaccel.loader._stream import epoch_length
from funcaccel.loader._stream import length
from funcaccel.loader._stream import local_batches
from funcaccel.loader._stream import past_the_end
from funcaccel.loader._stream_records import records
from funcaccel.loader._workers import check_worker_state
from funcaccel.mesh import ParallelMesh

__all__ = [
    "Batch",
    "LoaderState",
    "RngType",
    "ShardedLoader",
    "iter_batches",
    "send_to_device",
    "shard_loader",
]

# iter_batches: a stream's state saved on one world size, resumed on another whose
# global batch does not divide the samples consumed (docs/data.md).
_FIX_STREAM: Final = (
    "The stream's state was saved by a loader on {0} data-parallel ranks and this "
    "loader runs on {1}: the position after {2} samples falls inside one of its "
    "global batches. Resume on a world size (and batch size) whose global batch "
    "divides {2}, or start the next epoch with LoaderState(epoch={3})."
)
# iter_batches: a state this loader cannot resume from (docs/loader.md#errors).
_SAMPLES: Final = "the samples state counts (global_batches * global_batch_size)"
_DYNAMIC: Final = "0 for a loader with a dynamic batch sampler (no total_batch_size)"
_FIX: Final = (
    "Resume at an epoch start, or with a state from a loader whose global batch "
    "divides the samples consumed (world size * batch size)."
)


class ShardedLoader:
    """This rank's share of a ``DataLoader``; build it with ``shard_loader``.

    Iterating it (``for x in loader``) yields the batch data of epoch
    ``loader.epoch`` and moves ``loader.epoch`` on by one, so each new ``for`` loop
    iterates the next epoch (reshuffled, from ``seed + epoch``), as a
    ``DataLoader`` reshuffles on each ``iter()``. That counter is the loader's one
    piece of state; ``set_epoch`` sets it, as with Accelerate's loaders and torch's
    ``DistributedSampler``. ``iter_batches`` yields records with the position in
    the epoch, can resume, and neither reads nor moves the counter.
    """

    __slots__ = ("_epoch", "_setup")

    def __init__(self, setup: Setup) -> None:
        self._setup = setup
        self._epoch = 0

    @property
    def ctx(self) -> DistributedContext:
        """The context this loader shards for."""
        return self._setup.ctx

    @property
    def dataloader(self) -> DataLoader[Any]:
        """The caller's original ``DataLoader`` (never modified)."""
        return self._setup.dataloader

    @property
    def dataset(self) -> Any:
        """The original loader's dataset."""
        return self._setup.dataloader.dataset

    @property
    def split_batches(self) -> bool:
        """Whether each original batch is split across ranks."""
        return self._setup.split_batches

    @property
    def data_parallel_size(self) -> int:
        """How many ranks read distinct batches: ``ctx.num_processes``, or a mesh's ``dp_size``."""
        return self._setup.view.num_processes

    @property
    def even_batches(self) -> bool:
        """Whether the last round loops back so every rank gets a full batch."""
        return self._setup.even_batches

    @property
    def put_on_device(self) -> bool:
        """Whether batches are moved to ``ctx.device``."""
        return self._setup.put_on_device

    @property
    def dispatch_batches(self) -> bool:
        """Whether rank 0 reads and sends every rank its rows (False with one process)."""
        return self._setup.dispatch

    @property
    def rng_types(self) -> tuple[RngType, ...]:
        """The generators synchronised from rank 0 at each epoch start."""
        return self._setup.rng_types

    @property
    def seed(self) -> int:
        """The base seed; epoch ``e`` is shuffled with ``seed + e``."""
        return self._setup.seed

    @property
    def total_batch_size(self) -> int | None:
        """The global batch size ``G`` (``bs`` if split, else ``bs * p``; ``None`` if dynamic)."""
        return self._setup.total_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter(loader)`` iterates (0, then +1 per ``iter``)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(loader)`` iterate ``epoch``; changes this loader in place.

        The ``for`` loops after it iterate ``epoch + 1``, ``epoch + 2``, ...

        Raises:
            TypeError: ``epoch`` is not an int.
            ValueError: ``epoch`` is negative.
        """
        check_int("ShardedLoader.set_epoch", "epoch", epoch, 0)
        self._epoch = epoch

    def __len__(self) -> int:
        """Return the number of batches this rank yields per epoch.

        The rules: docs/loader.md#semantics-building-a-sharded-loader, docs/loader.md#semantics-dispatch-mode.

        Raises:
            TypeError: The dataset (iterable) or the batch sampler has no ``len()``.
        """
        return length(self._setup)

    def __iter__(self) -> Iterator[Any]:
        """Iterate epoch ``self.epoch`` and move the counter on to the next epoch.

        The counter moves when the iteration starts, not when it ends, so a loop
        that breaks early is still followed by a new epoch's order.
        """
        setup, epoch = self._setup, self._epoch
        self._epoch = epoch + 1
        if setup.dispatch or setup.stateful:
            return (batch.data for batch in records(setup, epoch, 0))
        return local_batches(setup, epoch)

    def __repr__(self) -> str:
        return (
            f"ShardedLoader(rank={self.ctx.process_index}/{self.ctx.num_processes}, "
            f"total_batch_size={self.total_batch_size}, epoch={self._epoch}, "
            f"dispatch_batches={self.dispatch_batches})"
        )


def shard_loader(
    ctx: DistributedContext,
    dataloader: DataLoader[Any],
    *,
    split_batches: bool = False,
    put_on_device: bool = True,
    rng_types: Sequence[RngType] | None = None,
    dispatch_batches: bool | None = None,
    even_batches: bool = True,
    seed: int = 0,
    non_blocking: bool = False,
    slice_fn: Callable[[Any, slice], Any] | None = None,
    mesh: ParallelMesh | None = None,
) -> ShardedLoader:
    """Return this rank's share of ``dataloader``, a drop-in ``DataLoader``.

    Map-style data is sharded by batches (``shard_batch_sampler``), iterable data
    by samples (``shard_iterable_dataset``); with ``dispatch_batches`` rank 0
    reads every global batch and sends each rank its rows. A shuffled epoch
    ``e`` is drawn from ``seed + e``, the same on every rank and world size, so
    a run resumes on another world size. ``dataloader``, its sampler and
    ``rng_types`` are left unchanged; one process yields the original batches.
    Torch's global generator is drawn from as by Accelerate's prepared loader
    (here and at each epoch start; not in a resumed epoch, unlike Accelerate):
    docs/loader.md#draws-from-torchs-global-generator.

    With 2 ranks, 10 samples and ``batch_size=3``: rank 0 yields [0,1,2] [6,7,8],
    rank 1 yields [3,4,5] [9,0,1] (looped back). Sharding needs no process
    group, so a hand-built context shows any rank's share:

    >>> import torch
    >>> from funcaccel.context import DistributedType
    >>> def rank(i):
    ...     kind = DistributedType.MULTI_CPU
    ...     return DistributedContext(num_processes=2, process_index=i, distributed_type=kind)
    >>> data = DataLoader(torch.arange(10), batch_size=3)
    >>> [[batch.tolist() for batch in shard_loader(rank(i), data)] for i in (0, 1)]
    [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
    >>> loader = shard_loader(rank(0), data)
    >>> len(loader), loader.total_batch_size
    (2, 6)

    Every option (``split_batches``, ``put_on_device``, ``rng_types``,
    ``dispatch_batches``, ``even_batches``, ``seed``, ``non_blocking``,
    ``slice_fn``, ``mesh``), the settings kept and the errors:
    docs/loader.md#api and docs/loader.md#semantics-building-a-sharded-loader.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: a value or combination docs/loader.md#errors lists.
    """
    plan = plan_setup(
        ctx,
        dataloader,
        split_batches=split_batches,
        put_on_device=put_on_device,
        rng_types=rng_types,
        dispatch_batches=dispatch_batches,
        even_batches=even_batches,
        seed=seed,
        non_blocking=non_blocking,
        slice_fn=slice_fn,
        mesh=mesh,
    )
    setup = build_setup(ctx, dataloader, plan)
    draw_global(setup.draws.when_built)  # as Accelerate's prepare_data_loader
    return ShardedLoader(setup)


def _skip(loader: ShardedLoader, state: LoaderState) -> int:
    """Return how many of this rank's batches ``state`` has consumed.

    A state beyond the end of the epoch is a ``ValueError``; one exactly at its end
    (the epoch finished) skips everything.

    The rules: docs/loader.md#semantics-resuming-from-a-loaderstate.
    """
    if state.global_batches == 0:
        return 0
    skip = _consumed(loader, state)
    try:
        batches = epoch_length(loader._setup)
    except TypeError:
        return skip  # unsized: checked while the skipped batches are read
    if skip > batches:
        total = loader.total_batch_size
        raise past_the_end(state.epoch, skip, batches, total, state)
    return skip


def _consumed(loader: ShardedLoader, state: LoaderState) -> int:
    total = loader.total_batch_size
    if total is None:
        size = state.global_batch_size
        if size:
            fail_value("iter_batches", "state.global_batch_size", size, _DYNAMIC, _FIX)
        return state.global_batches
    samples = state.global_batches * (state.global_batch_size or total)
    what = f"a multiple of this loader's total_batch_size ({total})"
    if samples % total and state.stream_ranks:
        ranks = loader.data_parallel_size
        fix = _FIX_STREAM.format(state.stream_ranks, ranks, samples, state.epoch + 1)
        fail_value("iter_batches", _SAMPLES, samples, what, fix)
    if samples % total:
        fail_value("iter_batches", _SAMPLES, samples, what, _FIX)
    return samples // total


def iter_batches(loader: ShardedLoader, state: LoaderState = START) -> Iterator[Batch]:
    """Yield the batches of epoch ``state.epoch`` as records, resuming after ``state``.

    Skips the ``state.global_batches * state.global_batch_size / G`` batches this
    rank had consumed, with the epoch sharded from its start on the current world,
    so a state saved on another world size continues the same global order. For
    map-style data skipped batches are indices only: nothing is read. The loader
    reads one batch ahead, so ``is_last`` is already true on the last batch. The
    skip applies to this call only. ``loader`` is left unchanged. A resumed
    epoch draws nothing from torch's global generator (its start drew before the
    state was saved); an epoch started from its beginning draws what a
    ``DataLoader`` does: docs/loader.md#draws-from-torchs-global-generator.

    With 2 ranks, 10 samples and ``batch_size=2`` (``G = 4``), rank 0 yields
    [0,1] [4,5] [8,9] and rank 1 [2,3] [6,7] [0,1]; the first records' ``state``
    is ``LoaderState(epoch=0, global_batches=1, global_batch_size=4)``. Resuming
    from it on 2 ranks gives [4,5] [8,9] / [6,7] [0,1]; on one process with
    ``batch_size=2`` it gives [4,5] [6,7] [8,9]:

    >>> import torch
    >>> from funcaccel.context import DistributedType
    >>> two = DistributedContext(num_processes=2, process_index=0, distributed_type=DistributedType.MULTI_CPU)
    >>> records = list(iter_batches(shard_loader(two, DataLoader(torch.arange(10), batch_size=2))))
    >>> [(b.data.tolist(), b.is_last, b.remainder) for b in records]
    [([0, 1], False, 2), ([4, 5], False, 2), ([8, 9], True, 2)]
    >>> records[0].state
    LoaderState(epoch=0, global_batches=1, global_batch_size=4)
    >>> one = shard_loader(DistributedContext(), DataLoader(torch.arange(10), batch_size=2))
    >>> [b.data.tolist() for b in iter_batches(one, records[0].state)]
    [[4, 5], [6, 7], [8, 9]]

    Args:
        loader: From ``shard_loader``.
        state: Where to start; the default is the start of epoch 0.

    Yields:
        ``Batch`` records: ``data``, ``index``, ``is_last``, ``remainder``,
        ``state``.

    Raises:
        TypeError: ``loader`` or ``state`` of the wrong type.
        ValueError: The consumed samples are not a whole number of this loader's
            global batches.
    """
    what = "a ShardedLoader from shard_loader(ctx, dataloader)"
    check_type("iter_batches", "loader", loader, ShardedLoader, what=what)
    hint = "Use LoaderState.from_dict for a saved dict."
    check_type("iter_batches", "state", state, LoaderState, hint=hint)
    skip, setup = _skip(loader, state), loader._setup
    if setup.streams and state.stream_state is not None and skip:
        # every rank checks (when dispatching, only rank 0 reads)
        assert setup.total_batch_size is not None
        ranks, samples = loader.data_parallel_size, skip * setup.total_batch_size
        fix = _FIX_STREAM.format(state.stream_ranks, ranks, samples, state.epoch + 1)
        workers, total = setup.dataloader.num_workers, setup.total_batch_size
        saved = state.global_batch_size
        check_worker_state(state.stream_state, workers, total, state.epoch, fix, saved)
    return records(setup, state.epoch, skip, state.stream_state)
