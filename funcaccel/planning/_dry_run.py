"""``dry_run``: the user's training function at a world size, in this process.

Each rank checked (by default rank 0, rank 1 and the last rank) runs
``fn(ctx, *args)`` in its own fake world: torch's fake process group of
``world_size``, on which every collective returns at once without sending
anything, so every funcaccel function (``build_mesh``, ``wrap_model``,
``shard_loader``, ``accumulate_step`` ...) runs its real checks for that rank.
The tensors are real (fake tensors cannot be moved by ``Module.to`` nor read by
``.item()``): give ``fn`` a small configuration of the model, and use
``estimate_memory`` for the memory of the full one. What a rank
raises is re-raised as ``DryRunError`` naming the rank; then the collectives
each rank called are compared, and a rank that calls one the others do not (a
collective under ``if ctx.is_main_process``) is a ``DryRunError`` naming both
ranks' calls and where they were made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import Final

from funcaccel._checks import check_int
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._typing import MixedPrecision
from funcaccel.context import DistributedContext
from funcaccel.planning._fake_world import fake_world_ctx
from funcaccel.planning._fake_world import recording_mode

__all__ = ["DryRunError", "DryRunReport", "dry_run"]

_CALLER: Final = "dry_run"


class DryRunError(RuntimeError):
    """What the dry run found: a rank's error, or ranks whose collectives differ."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DryRunReport:
    """What a dry run that found nothing wrong ran.

    Args:
        world_size: the world simulated.
        ranks: the ranks that ran ``fn``.
        collectives: each rank's collective calls, in order, as ``(name,
            where)`` pairs; the same names on every rank.
    """

    world_size: int
    ranks: tuple[int, ...]
    collectives: tuple[tuple[tuple[str, str], ...], ...]


def _ranks(world_size: int, ranks: Sequence[int] | None) -> tuple[int, ...]:
    if ranks is None:
        return tuple(sorted({0, min(1, world_size - 1), world_size - 1}))
    chosen = tuple(ranks)
    for rank in chosen:
        check_int(_CALLER, "every rank", rank, 0)
        if rank >= world_size:
            fail_value(
                _CALLER, "ranks", chosen, f"ranks below world_size ({world_size})"
            )
    if not chosen:
        fail_value(_CALLER, "ranks", chosen, "at least one rank, or None")
    return chosen


def _said(rank: int, call: tuple[str, str] | None, index: int) -> str:
    if call is None:
        return f"rank {rank} makes no call {index + 1} (it made {index})"
    return f"rank {rank}'s call {index + 1} is {call[0]} at {call[1]}"


def _compare(ranks: tuple[int, ...], calls: list[list[tuple[str, str]]]) -> None:
    first, reference = ranks[0], calls[0]
    for rank, own in zip(ranks[1:], calls[1:], strict=True):
        for index in range(max(len(own), len(reference))):
            mine = own[index] if index < len(own) else None
            theirs = reference[index] if index < len(reference) else None
            if mine is not None and theirs is not None and mine[0] == theirs[0]:
                continue
            msg = (
                f"{_CALLER}: the ranks call different collectives: "
                f"{_said(first, theirs, index)}, but {_said(rank, mine, index)}. A "
                "collective that only some ranks call waits forever on the "
                "cluster: call it on every rank (e.g. outside `if "
                "ctx.is_main_process:`), and keep only the printing or saving "
                "inside."
            )
            raise DryRunError(msg)


def dry_run(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    ranks: Sequence[int] | None = None,
    mixed_precision: MixedPrecision = "no",
) -> DryRunReport:
    """Run ``fn(ctx, *args)`` for some ranks of ``world_size`` on a fake group; check it.

    ``fn`` is the training function a launch would run on every rank (as
    ``launch(fn, ...)`` takes it), given the rank's context; it should stop after
    one or two steps (pass the count in ``args``). Its tensors are real, so use a
    small configuration of the model; collectives send nothing: a reduction gives
    this rank's own values, and an all-gather (an object collective too) gives
    this rank's data from every rank.

    With ``world_size=8``: ``build_mesh(ctx, tp=3)`` raises on every rank, and
    the dry run raises ``DryRunError("dry_run: rank 0 of 8 raised ValueError:
    build_mesh: ...")``; a ``reduce`` under ``if ctx.is_main_process`` makes
    rank 0 call one collective more than rank 1, a ``DryRunError`` naming the
    call and its line.

    Args:
        fn: the training function, ``fn(ctx, *args)``.
        args: passed to ``fn`` after the context.
        world_size: the world to simulate (>= 1).
        ranks: the ranks to run; default rank 0, rank 1 and the last rank.
        mixed_precision: the contexts' mode, as ``build_context`` takes it.

    Returns:
        The ``DryRunReport`` of the ranks' collectives.

    Raises:
        DryRunError: a rank raised (the error is chained), or the ranks' collective
            calls differ.
        TypeError, ValueError: bad arguments.
        RuntimeError: a default process group already exists in this process.
    """
    if not callable(fn):
        fail_type(_CALLER, "fn", fn, "a function fn(ctx, ...)")
    check_int(_CALLER, "world_size", world_size, 1)
    chosen = _ranks(world_size, ranks)
    calls: list[list[tuple[str, str]]] = []
    for rank in chosen:
        own: list[tuple[str, str]] = []
        with fake_world_ctx(
            _CALLER, world_size, rank, mixed_precision=mixed_precision
        ) as ctx:
            try:
                _run(fn, ctx, args, own)
            except Exception as error:
                msg = f"{_CALLER}: rank {rank} of {world_size} raised {type(error).__name__}: {error}"
                raise DryRunError(msg) from error
        calls.append(own)
    _compare(chosen, calls)
    return DryRunReport(
        world_size=world_size,
        ranks=chosen,
        collectives=tuple(tuple(own) for own in calls),
    )


def _run(
    fn: Callable[..., Any],
    ctx: DistributedContext,
    args: tuple[Any, ...],
    calls: list[tuple[str, str]],
) -> None:
    with recording_mode(calls):
        fn(ctx, *args)
