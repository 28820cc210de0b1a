"""The multi-process helper itself: ranks, results and failures come back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from funcaccel.context import DistributedContext
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
