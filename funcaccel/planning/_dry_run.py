"""``dry_run``: the user's training function at a world size, in this process.

Each rank checked (by default rank 0, rank 1 and the last rank) runs
``fn(ctx, *args)`` in its own fake world: torch's fake process group of
``world_size``, on which every collective returns at once without sending
anything, so every funcaccel function (``build_mesh``, ``wrap_model``,
``shard_loader``, ``accumulate_step`` ...) runs its real checks for that rank.
With ``tensors="real"`` (the default) the tensors are real, so ``fn`` is given a
small configuration of the model; with ``tensors="fake"`` every tensor ``fn``
makes is a fake tensor (``fake_tensor_mode(user_code=True)``: shapes and dtypes,
no storage, reads answered by placeholders), so a full-size model runs its
steps without its memory. What a rank
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
from typing import Literal

from funcaccel._checks import check_choice
from funcaccel._checks import check_int
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._typing import MixedPrecision
from funcaccel.context import DistributedContext
from funcaccel.planning._fake_world import PLACEHOLDERS
from funcaccel.planning._fake_world import fake_tensor_mode
from funcaccel.planning._fake_world import fake_world_ctx
from funcaccel.planning._fake_world import host_objects_ctx
from funcaccel.planning._fake_world import recording_mode

__all__ = ["DryRunError", "DryRunReport", "dry_run"]

_CALLER: Final = "dry_run"
_TENSORS: Final = ("real", "fake")


class DryRunError(RuntimeError):
    """What the dry run found: a rank's error, or ranks whose collectives differ."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DryRunReport:
    """What a dry run that found nothing wrong ran.

    Args:
        world_size: the world simulated.
        ranks: the ranks that ran ``fn``.
        tensors: ``"real"`` or ``"fake"``, as ``dry_run`` was given.
        collectives: each rank's collective calls, in order, as ``(name,
            where)`` pairs; the same names on every rank.
    """

    world_size: int
    ranks: tuple[int, ...]
    tensors: Literal["real", "fake"]
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
                "ctx.is_main_process:`, keeping only the printing or saving "
                "inside), and give every rank as many batches (shard_loader's "
                "even_batches=True)."
            )
            raise DryRunError(msg)


def dry_run(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int,
    ranks: Sequence[int] | None = None,
    mixed_precision: MixedPrecision = "no",
    tensors: Literal["real", "fake"] = "real",
) -> DryRunReport:
    """Run ``fn(ctx, *args)`` for some ranks of ``world_size`` on a fake group; check it.

    ``fn`` is the training function a launch would run on every rank (as
    ``launch(fn, ...)`` takes it), given the rank's context; it should stop after
    one or two steps (pass the count in ``args``). Collectives send nothing: a
    reduction gives this rank's own values, and an all-gather (an object
    collective too) gives this rank's data from every rank.

    With ``tensors="real"`` the tensors are real: use a small configuration of
    the model. With ``tensors="fake"`` the tensors ``fn`` makes are fake (real
    tensors passed in ``args`` stay real, and mix with them), so the full model
    runs without its memory: a read of a fake value (``loss.item()``,
    ``float(t)``, ``bool(t)``) gives a placeholder, ``False`` for a bool, ``0.0``
    for a float, ``1`` for an integer, so a branch on such a value takes that
    side; integer tensors made from nothing (``arange``, ``randperm``,
    ``randint``, up to 2**24 elements) are real, so indices are; an op whose
    output shape depends on values (``nonzero``, a boolean mask) cannot run, nor
    can DDP, whose reducer reads the parameters (``fsdp=``, a mesh, or one
    process run).

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
        tensors: ``"real"``, or ``"fake"`` for fake tensors.

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
    check_choice(_CALLER, "tensors", tensors, _TENSORS)
    chosen = _ranks(world_size, ranks)
    calls: list[list[tuple[str, str]]] = []
    for rank in chosen:
        own: list[tuple[str, str]] = []
        with fake_world_ctx(
            _CALLER, world_size, rank, mixed_precision=mixed_precision
        ) as ctx:
            try:
                _run(fn, ctx, args, own, fake=tensors == "fake")
            except Exception as error:
                msg = f"{_CALLER}: rank {rank} of {world_size} raised {type(error).__name__}: {error}{_hint(error)}"
                raise DryRunError(msg) from error
        calls.append(own)
    _compare(chosen, calls)
    return DryRunReport(
        world_size=world_size,
        ranks=chosen,
        tensors=tensors,
        collectives=tuple(tuple(own) for own in calls),
    )


def _run(
    fn: Callable[..., Any],
    ctx: DistributedContext,
    args: tuple[Any, ...],
    calls: list[tuple[str, str]],
    *,
    fake: bool,
) -> None:
    with recording_mode(calls):
        if not fake:
            fn(ctx, *args)
            return
        with host_objects_ctx(), fake_tensor_mode(user_code=True):
            fn(ctx, *args)


def _hint(error: Exception) -> str:
    """Say what to do when ``error`` is a fake tensor's refusal to give a value."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    if isinstance(error, DynamicOutputShapeException):
        return (
            " (an op whose output shape depends on the tensor's values cannot run "
            "on fake tensors: compute the mask or indices from real data, or run "
            "dry_run with tensors='real' and a small configuration of the model)"
        )
    if isinstance(error, DataDependentOutputException):
        return (
            " (this op returns a Python value computed from tensors' values, as "
            "torch.equal and torch.allclose do, and fake tensors have none; only "
            f"reads of one value get a placeholder, {dict(PLACEHOLDERS)} by dtype: "
            "leave the check out of the dry run, or run dry_run with "
            "tensors='real' and a small configuration of the model)"
        )
    return ""
