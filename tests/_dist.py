"""Run a function on several real processes with gloo on CPU.

Every multi-process test goes through ``run_ranks`` (or ``run_processes`` for a
test that starts its own group). Workers rendezvous through a ``file://`` store in
``tmp_path`` (no ports), each worker's return value comes back to the test, and an
exception in any worker fails the test with that worker's traceback.

Workers start and end the group as ``build_context`` and ``close_context`` do
(``start_process_group`` waits until every rank has joined, so a quick rank cannot
leave while another is still connecting; ``end_process_group`` ends the group's
threads before the worker exits). Nothing is retried: a failed set-up or exit
fails the test.

Workers are started from a fork server that has imported torch and funcaccel once,
so a test pays for the import once rather than per process, and no worker inherits
the test process's thread pools.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import Concatenate
from typing import Final
from typing import ParamSpec
from typing import TypeVar

from torch.multiprocessing.spawn import start_processes

from funcaccel._group import end_process_group
from funcaccel._group import start_process_group
from funcaccel.context import DistributedContext
from funcaccel.testing import rank_ctx

P = ParamSpec("P")
T = TypeVar("T")

TIMEOUT_S: Final = 120.0
_START_METHOD: Final = "forkserver"


def _spawn(fn: Callable[..., None], args: tuple[object, ...], nprocs: int) -> None:
    """Start ``nprocs`` workers ``fn(rank, *args)`` and wait, failing on a hang."""
    multiprocessing.get_context(_START_METHOD).set_forkserver_preload(
        ["torch", "torch.distributed", "funcaccel"]
    )
    # The one place the untyped torch.multiprocessing API is called.
    context = start_processes(  # type: ignore[no-untyped-call]
        fn, args=args, nprocs=nprocs, join=False, start_method=_START_METHOD
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            msg = f"run_ranks: workers did not finish within {TIMEOUT_S:.0f} s (hang?)"
            raise TimeoutError(msg)


def _result_path(tmp_path: Path, rank: int) -> Path:
    return tmp_path / f"rank_{rank}.result.pkl"


def _ranked_worker(
    rank: int,
    fn: Callable[..., object],
    world_size: int,
    tmp_path: Path,
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> None:
    start_process_group(
        "gloo",
        init_method=f"file://{tmp_path}/rendezvous",
        rank=rank,
        world_size=world_size,
    )
    try:
        ctx = rank_ctx(world_size, rank)
        result = fn(ctx, *args, **kwargs)
        _result_path(tmp_path, rank).write_bytes(pickle.dumps(result))
    finally:
        end_process_group()


def _plain_worker(
    rank: int,
    fn: Callable[..., object],
    world_size: int,
    tmp_path: Path,
    args: tuple[object, ...],
    kwargs: dict[str, object],
) -> None:
    result = fn(rank, world_size, tmp_path, *args, **kwargs)
    _result_path(tmp_path, rank).write_bytes(pickle.dumps(result))


def _collect(tmp_path: Path, world_size: int) -> list[Any]:
    return [
        pickle.loads(_result_path(tmp_path, rank).read_bytes())
        for rank in range(world_size)
    ]


def run_ranks(
    fn: Callable[Concatenate[DistributedContext, P], T],
    world_size: int,
    tmp_path: Path,
    *args: P.args,
    **kwargs: P.kwargs,
) -> list[T]:
    """Run ``fn(ctx, *args, **kwargs)`` on ``world_size`` gloo processes.

    Each worker initialises the default group through ``file://`` in ``tmp_path``,
    builds its ``DistributedContext`` (MULTI_CPU, gloo) by hand, calls ``fn`` and
    destroys the group in ``finally``. ``fn`` must be a module-level function; its
    arguments and return value must pickle.

    Returns:
        The workers' return values, indexed by rank.
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    _spawn(_ranked_worker, (fn, world_size, tmp_path, args, kwargs), world_size)
    results: list[T] = _collect(tmp_path, world_size)
    return results


def run_processes(
    fn: Callable[Concatenate[int, int, Path, P], T],
    world_size: int,
    tmp_path: Path,
    *args: P.args,
    **kwargs: P.kwargs,
) -> list[T]:
    """Run ``fn(rank, world_size, tmp_path, *args, **kwargs)`` with no group started.

    For tests of code that starts the group itself (``build_context``).
    """
    tmp_path.mkdir(parents=True, exist_ok=True)
    _spawn(_plain_worker, (fn, world_size, tmp_path, args, kwargs), world_size)
    results: list[T] = _collect(tmp_path, world_size)
    return results
