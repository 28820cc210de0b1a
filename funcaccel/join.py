"""Train on inputs of uneven length across ranks: torch's ``Join`` for DDP models.

With ``even_batches=False`` ranks read different numbers of batches; a rank that
runs out would leave the others waiting in DDP's gradient all-reduce forever.
``join_uneven_inputs`` enters ``torch.distributed.algorithms.Join`` around the
loop: a rank that has finished shadows the others' collectives (it contributes
zero gradients) until all have finished. As in DDP's join mode, each step's
gradient is the sum of the gradients of the ranks still training divided by the
world size.

With 3 ranks, 10 samples, ``batch_size=2`` and ``even_batches=False``: rank 0
reads [0,1] [6,7], rank 1 [2,3] [8,9], rank 2 only [4,5]. In the second step rank
2 has joined, so both others step with ``(g([6,7]) + g([8,9])) / 3``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Final

from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.algorithms.join import Joinable
from torch.utils.data import IterableDataset

from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.loader import ShardedLoader
from funcaccel.loader import shard_loader

__all__ = ["join_uneven_inputs"]

_JOINABLE: Final = (
    "a module torch's Join can shadow (DistributedDataParallel, or another "
    "Joinable such as ZeroRedundancyOptimizer)",
    "Wrap it with wrap_model(ctx, model) for DDP, or keep even_batches=True (FSDP2 "
    "has no join support).",
)
_ONE_MODEL: Final = ("at least one model", "Pass the DDP model(s) you train.")


def _inside_compile(model: object) -> object:
    while isinstance(inner := getattr(model, "_orig_mod", None), nn.Module):
        model = inner
    return model


def _as_sequence(value: object, name: str) -> tuple[object, ...]:
    if isinstance(value, (nn.Module, Joinable, ShardedLoader)):
        return (value,)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return tuple(value)
    fail_type("join_uneven_inputs", name, value, "one object or a sequence of them")


def _joinables(models: object) -> list[Joinable]:
    found: list[Joinable] = []
    for i, model in enumerate(_as_sequence(models, "models")):
        inner = _inside_compile(model)
        if not isinstance(inner, Joinable):
            fail_type("join_uneven_inputs", f"models[{i}]", inner, *_JOINABLE)
        found.append(inner)
    if not found:
        fail_value("join_uneven_inputs", "models", models, *_ONE_MODEL)
    return found


def _loaders(loaders: object) -> tuple[ShardedLoader, ...]:
    what = "a ShardedLoader from shard_loader(ctx, dataloader)"
    return tuple(
        check_type("join_uneven_inputs", f"loaders[{i}]", x, ShardedLoader, what=what)
        for i, x in enumerate(_as_sequence(loaders, "loaders"))
    )


def _can_reshard(loader: ShardedLoader) -> bool:
    return not loader.dispatch_batches and not isinstance(
        loader.dataset, IterableDataset
    )


def _with_even_batches(loader: ShardedLoader, even_batches: bool) -> ShardedLoader:
    """Return a new loader like ``loader`` but for ``even_batches``; ``loader`` is kept."""
    if loader.even_batches == even_batches:
        return loader
    copy = shard_loader(
        loader.ctx,
        loader.dataloader,
        split_batches=loader.split_batches,
        put_on_device=loader.put_on_device,
        rng_types=list(loader.rng_types),
        dispatch_batches=False,
        even_batches=even_batches,
        seed=loader.seed,
        # ShardedLoader does not expose non_blocking yet; it only changes speed.
        non_blocking=bool(getattr(loader, "non_blocking", False)),
    )
    copy.set_epoch(loader.epoch)
    return copy


@contextlib.contextmanager
def join_uneven_inputs(
    ctx: DistributedContext,
    models: nn.Module | Joinable | Sequence[nn.Module | Joinable],
    *,
    even_batches: bool | None = None,
    loaders: ShardedLoader | Sequence[ShardedLoader] = (),
) -> Iterator[tuple[ShardedLoader, ...]]:
    """Let ranks with different numbers of batches train together (torch ``Join``).

    Yields the loaders to iterate inside the block: with ``even_batches`` given,
    a new ``ShardedLoader`` for each map-style loader whose ``even_batches``
    differs (the ones you passed are not changed); otherwise ``loaders`` as they
    are. Join is entered disabled when the batches are even (``even_batches=True``,
    or ``None`` with every loader even); a finished rank keeps shadowing until
    every rank is done, as in Accelerate. With one process nothing is entered.

    Per rank, with 2 ranks, 6 samples, ``batch_size=2``: the loaders yielded for
    ``even_batches=False`` give rank 0 [0,1] [4,5] and rank 1 only [2,3]; the
    second step on rank 0 applies ``g([4,5]) / 2`` while rank 1 has joined.

    Args:
        ctx: the run's context.
        models: the ``DistributedDataParallel`` model(s) (or other torch
            ``Joinable``) trained in the block.
        even_batches: override the loaders' ``even_batches`` for the block.
        loaders: the ``ShardedLoader`` (s) to re-shard and yield.

    Yields:
        A tuple with one loader per entry of ``loaders``.

    Raises:
        TypeError: with several processes, a model that is not a ``Joinable``
            (a plain module, FSDP2), or a loader that is not a ``ShardedLoader``.
        RuntimeError: several processes and no process group matching ``ctx``.

    Warns:
        UserWarning: ``even_batches`` is given but a loader is iterable or
            dispatches batches; it is yielded unchanged, as Accelerate does.
    """
    check_context("join_uneven_inputs", ctx)
    what = "None, True or False"
    check_type(
        "join_uneven_inputs",
        "even_batches",
        even_batches,
        bool,
        what=what,
        optional=True,
    )
    given = _loaders(loaders)
    if ctx.num_processes == 1:
        yield given
        return
    joinables = _joinables(models)
    require_process_group(ctx, "join_uneven_inputs")
    if even_batches is None:
        out = given
        enable = not given or not all(loader.even_batches for loader in given)
    else:
        kept = [i for i, loader in enumerate(given) if not _can_reshard(loader)]
        if kept:
            warnings.warn(
                f"join_uneven_inputs: even_batches={even_batches} applies only to "
                f"map-style loaders that do not dispatch; loaders {kept} are iterable "
                "or dispatch batches and are yielded unchanged.",
                UserWarning,
                stacklevel=3,
            )
        out = tuple(
            loader if i in kept else _with_even_batches(loader, even_batches)
            for i, loader in enumerate(given)
        )
        enable = not even_batches
    with Join(joinables, enable=enable, throw_on_early_termination=False):
        yield out
