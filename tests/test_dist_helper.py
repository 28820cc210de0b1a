"""The multi-process helper itself: ranks, results and failures come back."""

from __future__ import annotations

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
from tests._dist import run_processes
from tests._dist import run_ranks


def _all_reduce_rank(ctx: DistributedContext, scale: int) -> tuple[int, float]:
    value = torch.tensor([float(ctx.process_index * scale)])
    dist.all_reduce(value)
    return ctx.process_index, float(value.item())


def _fail_on_rank_one(ctx: DistributedContext) -> None:
    if ctx.process_index == 1:
        msg = "deliberate failure on rank 1"
        raise ValueError(msg)


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_run_ranks_returns_each_rank_result(tmp_path: Path, world_size: int) -> None:
    results = run_ranks(_all_reduce_rank, world_size, tmp_path, 10)
    total = float(sum(10 * r for r in range(world_size)))
    assert results == [(r, total) for r in range(world_size)]


@pytest.mark.distributed
def test_run_ranks_reports_a_worker_exception(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="deliberate failure on rank 1"):
        run_ranks(_fail_on_rank_one, 2, tmp_path)


def _gloo_threads() -> int:
    """How many of gloo's worker threads this process runs."""
    tasks = Path("/proc/self/task")
    names = [(task / "comm").read_text().strip() for task in tasks.iterdir()]
    return names.count("pt_gloo_runloop")


def _record_start(rank: int, world_size: int, tmp_path: Path, slow: int) -> float:
    """Start the group (rank ``slow`` is slow to finish init); return when it returned."""
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
    returned = run_processes(_record_start, 3, tmp_path, 2)
    slow_init = float((tmp_path / "init_returned_2").read_text())
    assert all(when >= slow_init for when in returned), (returned, slow_init)


def _threads_after_end(
    rank: int, world_size: int, tmp_path: Path, late_import: bool
) -> tuple[bool, int, int, bool]:
    init = f"file://{tmp_path}/rendezvous"
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
    for bound, during, after, released in run_processes(
        _threads_after_end, 2, tmp_path, late_import
    ):
        # Started by funcaccel, torch's defaults never hold the group; started by
        # hand, they do until end_process_group releases them.
        assert bound is late_import
        assert during > 0
        assert after == 0
        assert released
