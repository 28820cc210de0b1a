"""The multi-process helper itself: ranks, results and failures come back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessRaisedException

from funcaccel.context import DistributedContext
from tests._dist import _result_path
from tests._dist import _started_path
from tests._dist import run_ranks
from tests._dist import spawn_once_more_on_gloo_setup_failure


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


def _flaky_setup(rank: int, fail_in: str, tmp_path: Path, after_start: bool) -> None:
    """Fail as gloo's mesh set-up fails, the first time (before or after 'starting')."""
    if after_start:
        _started_path(tmp_path, rank).touch()
    if tmp_path.name == fail_in:
        msg = "Gloo connectFullMesh failed with [...] Connection closed by peer"
        raise RuntimeError(msg)
    _result_path(tmp_path, rank).write_bytes(b"ran")


def test_a_gloo_setup_failure_before_any_rank_started_runs_once_more(tmp_path: Path) -> None:
    used = spawn_once_more_on_gloo_setup_failure(
        _flaky_setup, (tmp_path.name,), (False,), 2, tmp_path
    )
    assert used == tmp_path / "after-gloo-setup-failure"
    assert all(_result_path(used, r).read_bytes() == b"ran" for r in range(2))


def test_a_failure_after_a_rank_started_is_not_run_again(tmp_path: Path) -> None:
    with pytest.raises(ProcessRaisedException, match="Gloo connectFullMesh failed"):
        spawn_once_more_on_gloo_setup_failure(
            _flaky_setup, (tmp_path.name,), (True,), 2, tmp_path
        )
    assert not (tmp_path / "after-gloo-setup-failure").exists()
