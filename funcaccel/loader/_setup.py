"""``shard_loader``'s decision procedure, as one frozen value.

The seven steps: docs/loader.md#semantics-building-a-sharded-loader.

Two halves, which ``shard_loader`` composes: ``plan_setup`` checks the arguments
and reads what it needs from the caller's ``DataLoader`` (never changing it) into a
``LoaderPlan``; ``build_setup`` builds from that plan the inner ``DataLoader`` this
rank iterates: the original's dataset and worker/collation settings (step 6) around
an ``IndexSlot`` (map-style data) or a sharded stream (iterable data).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any
from typing import Final

import torch
from torch.utils.data import BatchSampler
from torch.utils.data import DataLoader
from torch.utils.data import IterableDataset
from torch.utils.data import RandomSampler
from torch.utils.data import SequentialSampler

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._rng_types import check_rng_types
from funcaccel._typing import RngType
from funcaccel._world import check_world
from funcaccel.context import DistributedContext
from funcaccel.loader._draws import EpochDraws
from funcaccel.loader._draws import plan_draws
from funcaccel.loader._indices import BaseIndices
from funcaccel.loader._reading import CountedStream
from funcaccel.loader._reading import IndexSlot
from funcaccel.loader._reading import TaggedCollate
from funcaccel.loader._stateful import StatefulStream
from funcaccel.loader._stateful import stateful_loader
from funcaccel.loader._stateful import stream_resumes
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import check_mesh
from funcaccel.sharding import shard_batch_sampler
from funcaccel.sharding import shard_iterable_dataset

__all__ = [
    "LoaderPlan",
    "Setup",
    "build_setup",
    "kept_settings",
    "plan_setup",
]

SliceFn = Callable[[Any, slice], Any]
_WHERE: Final = "shard_loader"
_FIX_UNBATCHED: Final = "Pass a batch_size to the DataLoader, or dispatch_batches=True."
_DISPATCHING: Final = (
    "True when dispatch_batches=True (rank 0 sends each rank its rows)"
)
_FIX_DISPATCH: Final = "Pass put_on_device=True or dispatch_batches=False."


def kept_settings(dataloader: DataLoader[Any]) -> dict[str, Any]:
    """Return the ``DataLoader`` arguments the inner loader keeps.

    The rules: docs/loader.md#semantics-building-a-sharded-loader step 6.
    """
    return {
        "num_workers": dataloader.num_workers,
        "collate_fn": dataloader.collate_fn,
        "pin_memory": dataloader.pin_memory,
        "timeout": dataloader.timeout,
        "worker_init_fn": dataloader.worker_init_fn,
        "multiprocessing_context": dataloader.multiprocessing_context,
        "prefetch_factor": dataloader.prefetch_factor,
        "persistent_workers": dataloader.persistent_workers,
        "pin_memory_device": dataloader.pin_memory_device,
        "in_order": dataloader.in_order,
    }


@dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """Everything a ``ShardedLoader`` decided at construction."""

    ctx: DistributedContext
    # ctx as the data-parallel ranks see it (ctx itself without a mesh): what
    # decides which batches a rank reads; collectives run on ctx
    view: DistributedContext
    dataloader: DataLoader[Any]
    split_batches: bool
    put_on_device: bool
    rng_types: tuple[RngType, ...]
    dispatch: bool
    even_batches: bool
    seed: int
    non_blocking: bool
    slice_fn: SliceFn | None
    iterable: bool
    batch_size: int | None  # bs of the original loader
    drop_last: bool
    total_batch_size: int | None  # G
    base: BaseIndices | None  # map-style data only
    # None on ranks > 0 when dispatching; for map-style data its (batch) sampler is
    # an IndexSlot, loaded with each epoch's indices (read_batches)
    inner: DataLoader[Any] | None
    counted: bool  # the inner loader yields (batch, samples read) pairs
    # every rank: the loader resumes a stateful stream from its state (docs/data.md)
    streams: bool
    # the inner loader yields (batch, StreamTag) pairs from a StatefulStream
    stateful: bool
    sync_generator: torch.Generator | None
    reseed_generator: torch.Generator | None
    worker_generator: torch.Generator  # the inner loader's; seeded seed + epoch
    epoch_targets: tuple[Any, ...]  # objects whose set_epoch is called
    # what the loader draws from torch's global generator, as Accelerate's does
    draws: EpochDraws


def _check_types(
    ctx: object,
    dataloader: object,
    flags: Mapping[str, object],
    dispatch_batches: object,
    seed: object,
    slice_fn: object,
) -> None:
    what = "a DistributedContext (from build_context)"
    check_type(_WHERE, "ctx", ctx, DistributedContext, what=what)
    what = "a torch.utils.data.DataLoader"
    check_type(_WHERE, "dataloader", dataloader, DataLoader, what=what)
    for name, value in flags.items():
        check_type(_WHERE, name, value, bool, what="True or False")
    what = "None, True or False"
    check_type(
        _WHERE, "dispatch_batches", dispatch_batches, bool, what=what, optional=True
    )
    seed = check_int(_WHERE, "seed", seed, 0)
    # Epoch e seeds torch generators with seed + e, which must stay below 2**64.
    if seed >= 2**63:
        fail_value(_WHERE, "seed", seed, "< 2**63", "Pass a smaller int.")
    if slice_fn is not None and not callable(slice_fn):
        fail_type(_WHERE, "slice_fn", slice_fn, "None or a callable (data, slice)")


def _check_not_split(dataset: object) -> None:
    """Refuse a ``datasets`` stream already split between nodes: it would be split twice.

    ``split_dataset_by_node`` records its split in the stream's ``_distributed``
    (a ``datasets`` attribute, read here because no public one says so).
    """
    split = getattr(dataset, "_distributed", None)
    world = getattr(split, "world_size", None)
    if isinstance(world, int) and world > 1:
        rank = getattr(split, "rank", "?")
        raise ValueError(
            f"{_WHERE}: the dataset is a datasets stream already split between "
            f"{world} nodes (split_dataset_by_node, rank {rank}); shard_loader "
            "splits the stream between the ranks itself, so it would be split twice "
            "and each rank would miss samples. Pass the stream as it was before "
            "split_dataset_by_node."
        )


def _check_rng_types(rng_types: object, ctx: DistributedContext) -> tuple[RngType, ...]:
    if rng_types is None:
        return ()
    return check_rng_types(_WHERE, rng_types, ctx)


def _unused_generator(owner: str, generator: torch.Generator) -> ValueError:
    seed = generator.initial_seed()
    example = f"seed={seed}" if seed < 2**63 else "a seed below 2**63"
    return ValueError(
        f"{_WHERE}: {owner} has a generator (initial seed {seed}), which a sharded "
        "loader does not use: it draws each epoch's order, and the workers' base "
        "seed, from seed + epoch, so that every rank and world size agree. Drop "
        f"generator= there and pass the seed to shard_loader instead ({example})."
    )


def _check_no_generator(dataloader: DataLoader[Any]) -> None:
    """Refuse a generator the loader would ignore, rather than ignore it silently."""
    if isinstance(dataloader.generator, torch.Generator):
        raise _unused_generator("the DataLoader", dataloader.generator)
    batch_sampler: Any = _batches_of(dataloader)
    sampler: Any = (
        dataloader.sampler
        if batch_sampler is None
        else getattr(batch_sampler, "sampler", None)
    )
    # Only the RandomSampler that _base_indices replaces; a custom sampler keeps
    # (and draws from) its own generator.
    replaced = batch_sampler is None or type(batch_sampler) is BatchSampler
    generator = getattr(sampler, "generator", None)
    if replaced and type(sampler) is RandomSampler and generator is not None:
        raise _unused_generator("the DataLoader's RandomSampler", generator)


def _batches_of(dataloader: DataLoader[Any]) -> Any:
    """Return what yields ``dataloader``'s index lists, or ``None`` when it has none.

    That is its batch sampler, or, for ``DataLoader(sampler=BatchSampler(...),
    batch_size=None)``, the ``BatchSampler`` given as its sampler.
    """
    if dataloader.batch_sampler is not None:
        return dataloader.batch_sampler
    sampler = dataloader.sampler
    return sampler if isinstance(sampler, BatchSampler) else None


def _original_batch_size(dataloader: DataLoader[Any]) -> int | None:
    if dataloader.batch_size is not None:
        return dataloader.batch_size
    size: Any = getattr(_batches_of(dataloader), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def _base_indices(dataloader: DataLoader[Any], seed: int) -> BaseIndices:
    batch_sampler: Any = _batches_of(dataloader)
    if batch_sampler is None:  # no automatic batching: items are single indices
        sampler: Any = dataloader.sampler
        source, batch_size, drop_last = sampler, None, False
    else:
        sampler = getattr(batch_sampler, "sampler", None)
        source, batch_size = batch_sampler, _original_batch_size(dataloader)
        drop_last = getattr(batch_sampler, "drop_last", False)
        name = "the batch sampler's drop_last"
        check_type(_WHERE, name, drop_last, bool, what="True or False")
    # Exact types: a subclass may order indices its own way, so it is used as is.
    is_torch_batching = batch_sampler is None or type(batch_sampler) is BatchSampler
    kind: Any = "given"
    if is_torch_batching and type(sampler) is RandomSampler:
        source, kind = sampler, "random"
    elif is_torch_batching and type(sampler) is SequentialSampler:
        source, kind = sampler, "sequential"
    return BaseIndices(
        kind=kind,
        source=source,
        batched=batch_sampler is not None,
        batch_size=batch_size,
        drop_last=drop_last,
        seed=seed,
        whole_items=dataloader.batch_sampler is None and batch_sampler is not None,
    )


def _check_batching(
    ctx: DistributedContext,
    *,
    batch_size: int | None,
    split_batches: bool,
    dispatch: bool,
    batched: bool,
) -> None:
    p = ctx.num_processes
    check_world(_WHERE, p, ctx.process_index, split_batches, batch_size)
    what = f"set (not None) to shard batches across {p} processes"
    if p > 1 and not dispatch and not batched:
        fail_value(_WHERE, "the DataLoader's batch_size", None, what, _FIX_UNBATCHED)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoaderPlan:
    """What ``shard_loader``'s checked arguments decide, before anything is built."""

    view: DistributedContext
    split_batches: bool
    put_on_device: bool
    rng_types: tuple[RngType, ...]
    even_batches: bool
    seed: int
    non_blocking: bool
    slice_fn: SliceFn | None
    iterable: bool
    dispatch: bool
    reads: bool  # this rank reads data (only global rank 0 does when dispatching)
    batch_size: int | None  # bs of the original loader
    total_batch_size: int | None  # G


def plan_setup(
    ctx: DistributedContext,
    dataloader: DataLoader[Any],
    *,
    split_batches: bool,
    put_on_device: bool,
    rng_types: Sequence[RngType] | None,
    dispatch_batches: bool | None,
    even_batches: bool,
    seed: int,
    non_blocking: bool,
    slice_fn: SliceFn | None,
    mesh: ParallelMesh | None,
) -> LoaderPlan:
    """Check ``shard_loader``'s arguments and decide who reads how much (first half).

    The rules: docs/loader.md#semantics-building-a-sharded-loader. With a ``mesh``
    the sharding arithmetic runs on its data-parallel view of ``ctx``
    (``mesh.dp_size`` ranks), so a tensor-parallel group reads the same batches.
    """
    flags = {
        "split_batches": split_batches,
        "put_on_device": put_on_device,
        "even_batches": even_batches,
        "non_blocking": non_blocking,
    }
    _check_types(ctx, dataloader, flags, dispatch_batches, seed, slice_fn)
    view = ctx if mesh is None else check_mesh(_WHERE, ctx, mesh).dp_view(ctx)
    rngs = _check_rng_types(rng_types, ctx)
    _check_no_generator(dataloader)
    iterable = isinstance(dataloader.dataset, IterableDataset)
    _check_not_split(dataloader.dataset)
    if dispatch_batches and not put_on_device:
        fail_value(_WHERE, "put_on_device", False, _DISPATCHING, _FIX_DISPATCH)
    wanted = (
        put_on_device and iterable if dispatch_batches is None else dispatch_batches
    )
    p = view.num_processes
    dispatch = wanted and p > 1
    bs = _original_batch_size(dataloader)
    _check_batching(
        view,
        batch_size=bs,
        split_batches=split_batches,
        dispatch=dispatch,
        batched=_batches_of(dataloader) is not None,
    )
    return LoaderPlan(
        view=view,
        split_batches=split_batches,
        put_on_device=put_on_device,
        rng_types=rngs,
        even_batches=even_batches,
        seed=seed,
        non_blocking=non_blocking,
        slice_fn=slice_fn,
        iterable=iterable,
        dispatch=dispatch,
        # Only global rank 0 reads when dispatching (its data-parallel rank is 0).
        reads=not dispatch or ctx.process_index == 0,
        batch_size=bs,
        total_batch_size=None if bs is None else bs if split_batches else bs * p,
    )


def _iterable_inner(
    dataset: Any,
    plan: LoaderPlan,
    kept: dict[str, Any],
    *,
    drop_last: bool,
    split: bool,
) -> tuple[DataLoader[Any] | None, bool]:
    """Return the inner loader over iterable data and whether it counts samples."""
    bs, total = plan.batch_size, plan.total_batch_size
    if stream_resumes(dataset, plan.dispatch, plan.total_batch_size, kept):
        assert bs is not None and total is not None  # stream_resumes
        if not plan.reads:
            return None, False
        view = plan.view
        p, rank = (1, 0) if plan.dispatch else (view.num_processes, view.process_index)
        layout = (bs, total, p, rank, split, drop_last)
        return stateful_loader(dataset, layout, kept, whole=plan.dispatch), False
    counted = not (
        plan.dispatch or drop_last or total is None or isinstance(dataset, Sized)
    )
    if not plan.reads:
        return None, counted
    p, stream, size = plan.view.num_processes, dataset, bs
    shard: dict[str, Any] | None = None
    if not plan.dispatch and p > 1:
        assert bs is not None and total is not None  # _check_batching
        size = total // p if split else bs
        shard = {
            "batch_size": bs,
            "drop_last": drop_last,
            "num_processes": p,
            "process_index": plan.view.process_index,
            "split_batches": split,
        }
        stream = shard_iterable_dataset(dataset, **shard)
    if counted:
        stream = CountedStream(dataset, shard)
        kept["collate_fn"] = TaggedCollate(kept["collate_fn"])
    return DataLoader(stream, batch_size=size, drop_last=drop_last, **kept), counted


def _map_inner(
    dataloader: DataLoader[Any],
    base: BaseIndices,
    plan: LoaderPlan,
    kept: dict[str, Any],
    *,
    split: bool,
    even_batches: bool,
) -> DataLoader[Any] | None:
    """Return the inner loader over map-style data, fed through an ``IndexSlot``."""
    p = plan.view.num_processes
    if not plan.dispatch and p > 1:
        # Fail now, not at the first epoch, on a sampler sharding rejects.
        shard_batch_sampler(
            base.for_length(),
            num_processes=p,
            process_index=plan.view.process_index,
            split_batches=split,
            even_batches=even_batches,
        )
    if not plan.reads:
        return None
    slot, dataset = IndexSlot(), dataloader.dataset
    if dataloader.batch_sampler is not None:
        return DataLoader(dataset, batch_sampler=slot, **kept)
    return DataLoader(dataset, batch_size=None, sampler=slot, **kept)


def build_setup(
    ctx: DistributedContext, dataloader: DataLoader[Any], plan: LoaderPlan
) -> Setup:
    """Build the inner loader and the ``Setup`` that ``plan`` decided (second half).

    ``shard_loader`` composes the halves: ``build_setup(ctx, dl, plan_setup(...))``.
    """
    kept = kept_settings(dataloader)
    # The inner loader draws its worker base seed from a generator of its own, not
    # from the global RNG (nor from the caller's generator, which stays unconsumed):
    # so ranks that synchronised "torch" stay in step even when only rank 0 reads.
    kept["generator"] = worker_generator = torch.Generator()
    split, dataset = plan.split_batches, dataloader.dataset
    base = None if plan.iterable else _base_indices(dataloader, plan.seed)
    if base is None:
        drop_last = dataloader.drop_last
        inner, counted = _iterable_inner(
            dataset, plan, kept, drop_last=drop_last, split=split
        )
    else:
        drop_last, counted = base.drop_last, False
        even = plan.even_batches
        inner = _map_inner(dataloader, base, plan, kept, split=split, even_batches=even)
    return Setup(
        ctx=ctx,
        view=plan.view,
        dataloader=dataloader,
        split_batches=split,
        put_on_device=plan.put_on_device,
        rng_types=plan.rng_types,
        dispatch=plan.dispatch,
        even_batches=plan.even_batches,
        seed=plan.seed,
        non_blocking=plan.non_blocking,
        slice_fn=plan.slice_fn,
        iterable=plan.iterable,
        batch_size=plan.batch_size,
        drop_last=drop_last,
        total_batch_size=plan.total_batch_size,
        base=base,
        inner=inner,
        counted=counted,
        stateful=isinstance(getattr(inner, "dataset", None), StatefulStream),
        streams=base is None
        and stream_resumes(dataset, plan.dispatch, plan.total_batch_size, kept),
        sync_generator=None if base is None else base.generator,
        reseed_generator=None if base is not None else _reseeded_generator(dataset),
        worker_generator=worker_generator,
        epoch_targets=_epoch_targets(dataloader, base),
        draws=plan_draws(
            kind="iterable" if base is None else base.kind,
            processes=plan.view.num_processes,
            dispatch=plan.dispatch,
            persistent_workers=dataloader.persistent_workers,
        ),
    )


def _reseeded_generator(dataset: object) -> torch.Generator | None:
    if callable(getattr(dataset, "set_epoch", None)):
        return None
    found = getattr(dataset, "generator", None)
    return found if isinstance(found, torch.Generator) else None


def _epoch_targets(
    dataloader: DataLoader[Any], base: BaseIndices | None
) -> tuple[Any, ...]:
    candidates: list[Any] = [dataloader.dataset]
    if base is not None and base.kind == "given":
        candidates += [base.source, getattr(base.source, "sampler", None)]
    targets: list[Any] = []
    for obj in candidates:
        has_set_epoch = callable(getattr(obj, "set_epoch", None))
        if has_set_epoch and all(obj is not seen for seen in targets):
            targets.append(obj)
    return tuple(targets)
