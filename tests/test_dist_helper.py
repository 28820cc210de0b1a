"""The harness every multi-process test uses, and the group it starts and ends.

Tests run ranks with ``funcaccel.testing.run_ranks(fn, world_size, *args,
start_method="forkserver")``; the few that start their own group call
``funcaccel.launch.launch(..., backend=None)``. These are the harness's promises
the suite relies on beyond tests/test_testing.py's: with the fork server, results
come back by rank, a raising rank fails the run with its traceback, one hanging
rank hits the timeout, one rank runs in a child with a group of one, and a rank
killed by a signal fails the run.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from funcaccel._group import end_process_group
from funcaccel._group import start_process_group
from funcaccel.context import DistributedContext
from funcaccel.launch import LaunchError
from funcaccel.launch import launch
from funcaccel.testing import run_ranks


def _all_reduce_rank(
    ctx: DistributedContext, scale: int
) -> tuple[int, float, int, bool | None]:
    """Return the rank, the all-reduced value, the parent process and whether the
    parent (the fork server) has torch's library loaded (None without /proc)."""
    value = torch.tensor([float(ctx.process_index * scale)])
    dist.all_reduce(value)
    maps = Path(f"/proc/{os.getppid()}/maps")
    preloaded = "libtorch_cpu" in maps.read_text() if maps.exists() else None
    return ctx.process_index, float(value.item()), os.getppid(), preloaded


def _fail_on_rank_one(ctx: DistributedContext) -> None:
    if ctx.process_index == 1:
        msg = "deliberate failure on rank 1"
        raise ValueError(msg)
    dist.barrier()  # rank 0 waits for rank 1, which never comes


def _hang_on_rank_one(ctx: DistributedContext) -> int:
    if ctx.process_index == 1:
        time.sleep(600)
    return ctx.process_index


def _alone_in_a_child(ctx: DistributedContext) -> tuple[int, bool, int, str]:
    return os.getpid(), dist.is_initialized(), dist.get_world_size(), ctx.backend or ""


def _killed(ctx: DistributedContext) -> None:
    del ctx  # one rank, which dies without a word
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_forkserver_ranks_return_their_results_by_rank(world_size: int) -> None:
    results = run_ranks(_all_reduce_rank, world_size, 10, start_method="forkserver")
    total = float(sum(10 * r for r in range(world_size)))
    assert [(rank, value) for rank, value, _, _ in results] == [
        (r, total) for r in range(world_size)
    ]
    # Forked by the fork server, not by this process, which had imported torch
    # before forking them (launch's preload), so no rank imported it again.
    parents = {parent for _, _, parent, _ in results}
    assert len(parents) == 1 and os.getpid() not in parents
    if Path("/proc/self/maps").exists():
        assert all(preloaded for _, _, _, preloaded in results)


@pytest.mark.distributed
def test_a_raising_forkserver_rank_fails_the_run_with_its_traceback() -> None:
    with pytest.raises(LaunchError, match=r"rank 1 of 2 raised ValueError") as info:
        run_ranks(_fail_on_rank_one, 2, start_method="forkserver", timeout_s=60)
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in info.value.traceback_text
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.distributed
def test_one_hanging_forkserver_rank_hits_the_timeout_and_is_named() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 did not return"):
        run_ranks(_hang_on_rank_one, 2, start_method="forkserver", timeout_s=10)
    assert time.monotonic() - start < 40


@pytest.mark.distributed
def test_one_rank_with_a_start_method_runs_in_a_child_with_a_group_of_one() -> None:
    [(pid, grouped, world, backend)] = run_ranks(
        _alone_in_a_child, 1, start_method="forkserver"
    )
    assert pid != os.getpid() and (grouped, world) == (True, 1)
    assert backend == ""  # rank_ctx(1, 0): one process, no backend in the context
    assert not dist.is_initialized()  # this process is left alone


@pytest.mark.distributed
def test_a_rank_killed_by_a_signal_fails_the_run() -> None:
    with pytest.raises(LaunchError, match=r"rank 0 of 1 was killed by signal 9"):
        run_ranks(_killed, 1, start_method="forkserver", timeout_s=60)


def _gloo_threads() -> int:
    """How many of gloo's worker threads this process runs."""
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    return names.count("pt_gloo_runloop")


def _record_start(tmp_path: Path, slow: int) -> float:
    """Start the group (rank ``slow`` is slow to finish init); return when it returned."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    original = dist.init_process_group

    def init_then_mark(*args: Any, **kwargs: Any) -> None:
        original(*args, **kwargs)
        if rank == slow:
            time.sleep(1.0)
        (tmp_path / f"init_returned_{rank}").write_text(repr(time.time()))

    dist.init_process_group = init_then_mark
    try:
        start_process_group(
            "gloo",
            init_method=f"file://{tmp_path}/rendezvous",
            world_size=world_size,
            rank=rank,
        )
        returned = time.time()
    finally:
        dist.init_process_group = original
        end_process_group()
    return returned


@pytest.mark.distributed
def test_no_rank_leaves_start_process_group_before_every_rank_joined(
    tmp_path: Path,
) -> None:
    # gloo's init_process_group returns once this rank's side of the mesh is up; a
    # rank that then ended the group at once failed a peer still connecting
    # ("connectFullMesh failed ... Connection closed by peer").
    returned = launch(
        _record_start,
        tmp_path,
        2,
        num_processes=3,
        backend=None,  # each rank starts the group itself
        start_method="forkserver",
        timeout_s=120,
    )
    slow_init = float((tmp_path / "init_returned_2").read_text())
    assert all(when >= slow_init for when in returned), (returned, slow_init)


def _threads_after_end(
    tmp_path: Path, late_import: bool
) -> tuple[bool, int, int, bool]:
    rank, init = int(os.environ["RANK"]), f"file://{tmp_path}/rendezvous"
    if late_import:
        # A group started outside funcaccel, then DDP (whose import of
        # torch._dynamo binds the live group into torch's default arguments).
        assert "torch.distributed.nn.functional" not in sys.modules
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    else:
        start_process_group("gloo", init_method=init, rank=rank, world_size=2)
    model = DistributedDataParallel(nn.Linear(2, 2))
    model(torch.ones(1, 2)).sum().backward()
    del model
    functional = sys.modules["torch.distributed.nn.functional"]
    bound = functional.all_reduce.__defaults__[-1] is not None
    during = _gloo_threads()
    end_process_group()
    released = functional.all_reduce.__defaults__[-1] is None
    return bound, during, _gloo_threads(), released


@pytest.mark.distributed
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")
@pytest.mark.parametrize("late_import", [False, True], ids=["ours", "user-started"])
def test_the_group_and_its_threads_end_in_end_process_group(
    tmp_path: Path, late_import: bool
) -> None:
    # Threads left alive into interpreter finalization aborted ranks at exit
    # ("terminate called without an active exception").
    for bound, during, after, released in launch(
        _threads_after_end,
        tmp_path,
        late_import,
        num_processes=2,
        backend=None,  # each rank starts the group itself
        start_method="forkserver",
        timeout_s=120,
    ):
        # Started by funcaccel, torch's defaults never hold the group; started by
        # hand, they do until end_process_group releases them.
        assert bound is late_import
        assert during > 0
        assert after == 0
        assert released
