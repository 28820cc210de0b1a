"""Helpers for testing code written with funcaccel: simulated and real ranks.

``rank_ctx(p, i)`` is rank ``i`` of ``p`` as a hand-built ``DistributedContext``:
every function that only reads the context (sharding, loaders without dispatch,
scheduler rules, tracker gating) behaves as on that rank, with no process started.
``run_ranks(fn, p, *args)`` runs ``fn(ctx, *args)`` on ``p`` real gloo processes
(through ``funcaccel.launch``) and returns each rank's result, for functions that
communicate.

>>> ctx = rank_ctx(4, 2)
>>> ctx.process_index, ctx.distributed_type.value, ctx.backend, ctx.is_main_process
(2, 'MULTI_CPU', 'gloo', False)
>>> rank_ctx(1, 0).distributed_type.value
'NO'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final
from typing import Literal
from typing import TypedDict
from typing import TypeVar
from typing import cast

import torch
import torch.distributed as dist
from typing_extensions import TypeVarTuple
from typing_extensions import Unpack

from funcaccel._checks import fail_type
from funcaccel.context import CollectiveTimeout
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.launch import StartMethod
from funcaccel.launch import launch

__all__ = ["ContextFields", "rank_ctx", "run_ranks"]

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

DEFAULT_TIMEOUT_S: Final = 120.0


class ContextFields(TypedDict, total=False):
    """The ``DistributedContext`` fields ``rank_ctx`` lets a test set."""

    local_process_index: int
    device: torch.device
    distributed_type: DistributedType
    mixed_precision: Literal["no", "fp16", "bf16"]
    backend: str | None
    collective_timeout: CollectiveTimeout


_FIELDS: Final = frozenset(ContextFields.__annotations__)


def rank_ctx(
    num_processes: int, process_index: int, **fields: Unpack[ContextFields]
) -> DistributedContext:
    """Return rank ``process_index`` of ``num_processes`` as a hand-built context.

    Starts nothing and reads no environment. The defaults describe one machine on
    CPU: ``local_process_index=process_index``; with several processes
    ``distributed_type=MULTI_CPU`` and ``backend="gloo"``, with one ``NO`` and
    ``None``. ``fields`` override any of them (and ``device``,
    ``mixed_precision``, ``collective_timeout``).

    With ``num_processes=2``, ``rank_ctx(2, 0)`` is the main process and
    ``rank_ctx(2, 1)`` the last one; ``shard_loader(rank_ctx(2, 1), loader)``
    yields what rank 1 reads in a real run.

    >>> [rank_ctx(2, i).is_main_process for i in (0, 1)]
    [True, False]
    >>> rank_ctx(2, 1, local_process_index=0).is_local_main_process
    True

    Raises:
        TypeError: a field that ``DistributedContext`` does not have, or of the
            wrong type.
        ValueError: values ``DistributedContext`` refuses (rank out of range, ...).
    """
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        msg = (
            f"rank_ctx: unknown field(s) {unknown}; the fields are "
            f"{sorted(_FIELDS)} (num_processes and process_index are positional)."
        )
        raise TypeError(msg)
    several = isinstance(num_processes, int) and num_processes > 1
    kind = DistributedType.MULTI_CPU if several else DistributedType.NO
    return DistributedContext(
        num_processes=num_processes,
        process_index=process_index,
        local_process_index=fields.get("local_process_index", process_index),
        device=fields.get("device", torch.device("cpu")),
        distributed_type=fields.get("distributed_type", kind),
        mixed_precision=fields.get("mixed_precision", "no"),
        backend=fields.get("backend", "gloo" if several else None),
        collective_timeout=fields.get("collective_timeout"),
    )


def _call_with_ctx(fn: Callable[..., object], *args: object) -> object:
    """Run on each rank: build its context from the started group, call ``fn``."""
    ctx = rank_ctx(dist.get_world_size(), dist.get_rank())
    return fn(ctx, *args)


def run_ranks(
    fn: Callable[[DistributedContext, Unpack[Ts]], T],
    world_size: int,
    *args: Unpack[Ts],
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    start_method: StartMethod | None = None,
) -> list[T]:
    """Run ``fn(ctx, *args)`` on ``world_size`` real gloo processes; return the results.

    Each rank starts the default group through a ``file://`` rendezvous in a new
    temporary directory (``launch``), calls ``fn`` with ``rank_ctx(world_size,
    rank)`` and destroys the group afterwards. With ``world_size=1`` and no
    ``start_method``, ``fn`` runs in this process with ``rank_ctx(1, 0)`` and no
    group; given a ``start_method``, in one child process with a gloo group of one
    (still ``rank_ctx(1, 0)``), so that it may kill itself or change process-wide
    state without touching the caller.

    ``start_method="forkserver"`` is the quick choice for a test suite: the fork
    server, started once per calling process, imports torch and funcaccel once,
    and every rank is forked from it with both loaded (a second or more saved per
    rank over ``"spawn"``), yet inherits nothing from the caller (no threads, no
    CUDA state). The server keeps the environment it started with: variables set
    in the caller afterwards do not reach the ranks (set them inside ``fn``).

    With ``world_size=2`` and ``fn = lambda ctx: ctx.process_index`` the result is
    ``[0, 1]``; if rank 1 raises, rank 0 is killed and ``LaunchError`` names rank 1
    with its traceback; if a rank hangs, all are killed after ``timeout_s``.

    Args:
        fn: takes the rank's context first; its return value must pickle. A
            module-level function is sent to fresh interpreters ("spawn"); one
            defined in a notebook or REPL, a lambda or a closure is forked.
        world_size: the number of processes (>= 1).
        *args: further arguments of ``fn``.
        timeout_s: seconds before every rank is killed and ``TimeoutError`` raised
            (120 by default; ``None`` for no limit).
        start_method: force ``"spawn"``, ``"fork"`` or ``"forkserver"``; with
            ``world_size=1``, also run ``fn`` in a child process.

    Returns:
        The ranks' return values, indexed by rank.

    Raises:
        LaunchError: a rank raised or died (see ``launch``).
        TimeoutError: ``timeout_s`` passed first.
        TypeError, ValueError: see ``launch``.
    """
    if not callable(fn):
        fail_type("run_ranks", "fn", fn, "callable")
    if world_size == 1 and start_method is None:
        return [fn(rank_ctx(1, 0), *args)]
    call: Callable[..., object] = _call_with_ctx  # fn's types are checked above
    payload: tuple[object, ...] = (fn, *args)
    results = launch(
        call,
        *payload,
        num_processes=world_size,
        timeout_s=timeout_s,
        start_method=start_method,
    )
    return cast("list[T]", results)
