"""A failed collective check leaves a report per rank and names the missing ranks' calls.

The guard itself (``funcaccel._guard``) is tested in ``test_collective_guard.py``;
this file covers what it leaves behind on failure: ``rank<r>.txt`` under
``ctx.hang_report_dir`` and, on the waiting rank, each missing rank's last known
funcaccel call. Kept apart so that each file stays one idea and short.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any
from typing import Final

import pytest
import torch

from funcaccel._guard import hang_report_dir
from funcaccel._guard import write_hang_report
from funcaccel.collectives import gather
from funcaccel.collectives import reduce
from funcaccel.collectives import wait_for_everyone
from funcaccel.context import DistributedContext
from funcaccel.testing import run_ranks
from tests.fixtures import Outcome
from tests.fixtures import outcome
from tests.fixtures import wait_for

BOUND_S: Final = 3.0
_WAIT_S: Final = 60.0
_RUN_TIMEOUT_S: Final = 60.0


def _alone_at_call_two(ctx: DistributedContext, run: Path) -> dict[str, Any]:
    """All ranks gather (call 1); rank 0 alone waits (call 2); rank 1 reduces late.

    Rank 1 calls ``reduce`` only once rank 0 gave up, so it reads rank 0's
    failure; any other rank finishes without another funcaccel call.
    """
    reports = run / "hangs"
    ctx = dataclasses.replace(
        ctx, collective_timeout=BOUND_S, hang_report_dir=str(reports)
    )
    done = run / "rank-0-done"
    out: dict[str, Any] = {"first": outcome(lambda: gather(ctx, torch.ones(1)))}
    if ctx.is_main_process:
        out["alone"] = outcome(lambda: wait_for_everyone(ctx))
        done.touch()
    else:
        wait_for(done, _WAIT_S)
        if ctx.process_index == 1:
            out["late"] = outcome(lambda: reduce(ctx, torch.ones(1)))
    return out


def _report(run: Path, rank: int) -> str:
    return (run / "hangs" / f"rank{rank}.txt").read_text(encoding="utf-8")


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_zero_only_call_names_the_missing_ranks_and_leaves_reports(
    tmp_path: Path, world_size: int
) -> None:
    results = run_ranks(
        _alone_at_call_two,
        world_size,
        tmp_path,
        timeout_s=_RUN_TIMEOUT_S,
        start_method="forkserver",
    )
    assert all(result["first"][0] is None for result in results)
    message, seconds = results[0]["alone"]
    assert message is not None
    others = ", ".join(str(r) for r in range(1, world_size))
    ranks = "rank" if world_size == 2 else "ranks"
    last = "; ".join(f"rank {r}: gather (call 1)" for r in range(1, world_size))
    assert message.startswith(
        f"wait_for_everyone: a collective call; {ranks} {others} did not reach it "
        f"within 3 s: call wait_for_everyone on every rank"
    ), message
    assert f"Last known funcaccel calls: {last}. " in message
    reports = tmp_path / "hangs"
    assert f"are in {reports / 'rank0.txt'} (each rank" in message
    assert f"writes rank<r>.txt in {reports};" in message
    assert BOUND_S <= seconds < BOUND_S + 10

    zero = _report(tmp_path, 0)
    assert zero.startswith("rank: 0\ncall: wait_for_everyone\ncall number: 2\n")
    assert "time: " in zero and "\nthread MainThread (id " in zero
    assert "in _alone_at_call_two" in zero  # this test's worker, on the stack
    assert "wait_for_everyone(ctx)" in zero

    # Rank 1 arrived after rank 0 gave up: it fails at once and reports too.
    late, late_seconds = results[1]["late"]
    assert late is not None
    assert "(this rank arrived after rank 0 gave up waiting)" in late
    assert "rank 1: arrived after the wait ran out (call 2)" in late
    assert f"are in {reports / 'rank1.txt'} (each rank" in late
    assert late_seconds < BOUND_S
    one = _report(tmp_path, 1)
    assert one.startswith("rank: 1\ncall: reduce\ncall number: 2\n")
    assert "in _alone_at_call_two" in one

    # A rank that made no further funcaccel call never failed, so wrote nothing.
    names = sorted(path.name for path in reports.iterdir())
    assert names == ["rank0.txt", "rank1.txt"]


def _different_calls(ctx: DistributedContext, run: Path) -> Outcome:
    """Rank 0 waits for everyone where the other ranks gather: a mismatch."""
    ctx = dataclasses.replace(
        ctx, collective_timeout=BOUND_S, hang_report_dir=str(run / "hangs")
    )
    if ctx.is_main_process:
        return outcome(lambda: wait_for_everyone(ctx))
    return outcome(lambda: gather(ctx, torch.ones(1)))


@pytest.mark.distributed
def test_ranks_in_different_collectives_each_leave_a_report(tmp_path: Path) -> None:
    results = run_ranks(
        _different_calls,
        3,
        tmp_path,
        timeout_s=_RUN_TIMEOUT_S,
        start_method="forkserver",
    )
    for rank, (message, _) in enumerate(results):
        assert message is not None
        assert f"are in {tmp_path / 'hangs' / f'rank{rank}.txt'}" in message
        call = "wait_for_everyone" if rank == 0 else "gather"
        report = _report(tmp_path, rank)
        assert report.startswith(f"rank: {rank}\ncall: {call}\ncall number: 1\n")
        assert "in _different_calls" in report


def test_the_default_report_directory_is_under_the_temporary_directory() -> None:
    default = Path(tempfile.gettempdir()) / f"funcaccel-hang-{os.getppid()}"
    assert hang_report_dir(DistributedContext()) == default
    chosen = DistributedContext(hang_report_dir="/shared/hangs")
    assert hang_report_dir(chosen) == Path("/shared/hangs")


def test_hang_report_dir_must_be_a_path() -> None:
    with pytest.raises(
        TypeError,
        match=r"^DistributedContext: hang_report_dir must be a str or None; got 3 \(int\)",
    ):
        DistributedContext(hang_report_dir=3)  # type: ignore[arg-type]


def test_a_report_that_cannot_be_written_is_told_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory", encoding="utf-8")
    sentence = write_hang_report(blocker / "hangs", 2, "gather", 7)
    assert sentence.startswith(
        f"Writing this rank's report to {blocker / 'hangs' / 'rank2.txt'} failed ("
    )
    assert sentence.endswith("set ctx.hang_report_dir to a writable directory.")


def test_a_report_names_the_rank_call_and_every_threads_stack(tmp_path: Path) -> None:
    sentence = write_hang_report(tmp_path, 2, "gather", 7)
    assert sentence.startswith("This rank's call and every thread's stack are in ")
    text = (tmp_path / "rank2.txt").read_text(encoding="utf-8")
    assert text.startswith("rank: 2\ncall: gather\ncall number: 7\ntime: ")
    assert "in test_a_report_names_the_rank_call_and_every_threads_stack" in text
