"""A collective called on only some ranks fails fast, naming the call (guard_collective).

With ``ctx.collective_timeout`` set, the ranks that make a funcaccel collective
call get a ``RuntimeError`` naming it within the bound, instead of waiting for the
process group's timeout. That calls with the guard on give the same results as
without is checked by the guarded runs in ``test_collectives.py`` and
``test_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from typing import Final

import pytest
import torch
from torch import nn

from funcaccel.checkpoint import save_checkpoint
from funcaccel.collectives import any_process
from funcaccel.collectives import gather
from funcaccel.collectives import guard_collective
from funcaccel.collectives import reduce
from funcaccel.collectives import wait_for_everyone
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from tests._dist import run_ranks

BOUND_S: Final = 2.0
# Above the bound: the file store the tests rendezvous through polls once a second,
# and the machine is shared.
SLACK_S: Final = 8.0
_WAIT_S: Final = 90.0
Outcome = tuple[str | None, float]


def _outcome(call: Callable[[], object]) -> Outcome:
    """Run ``call``; return its RuntimeError's message (or None) and the seconds taken."""
    start = time.monotonic()
    try:
        call()
    except RuntimeError as error:
        return str(error), time.monotonic() - start
    return None, time.monotonic() - start


def _wait_for(flag: Path) -> None:
    deadline = time.monotonic() + _WAIT_S
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _rank_zero_only(ctx: DistributedContext, run: Path) -> dict[str, Any]:
    """Rank 0 calls five collectives alone; rank 1 waits them out, then calls late."""
    ctx = dataclasses.replace(ctx, collective_timeout=BOUND_S)
    done = run / "rank-0-done"
    checkpoints = run / "checkpoints"
    if ctx.is_main_process:
        out = {
            "save_checkpoint": _outcome(
                lambda: save_checkpoint(ctx, checkpoints, models=nn.Linear(1, 1))
            ),
            "gather": _outcome(lambda: gather(ctx, torch.ones(1))),
            "reduce": _outcome(lambda: reduce(ctx, torch.ones(1), reduction="sum")),
            "wait_for_everyone": _outcome(lambda: wait_for_everyone(ctx)),
            "any_process": _outcome(lambda: any_process(ctx, True)),
            "written": checkpoints.exists() and any(checkpoints.iterdir()),
        }
        done.touch()
        return out
    # Never joins the five calls; waits (well past the bound) until rank 0 gave up
    # on all of them, then makes the first one late.
    _wait_for(done)
    late = _outcome(lambda: save_checkpoint(ctx, checkpoints, models=nn.Linear(1, 1)))
    return {"late save_checkpoint": late}


@pytest.fixture(scope="module")
def rank_zero_only(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("rank0")
    return run_ranks(_rank_zero_only, 2, tmp / "workers", tmp)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "call", ["save_checkpoint", "gather", "reduce", "wait_for_everyone", "any_process"]
)
def test_a_call_on_rank_zero_only_fails_there_within_the_bound(
    rank_zero_only: list[dict[str, Any]], call: str
) -> None:
    message, seconds = rank_zero_only[0][call]
    assert message is not None, f"{call} returned on rank 0 alone"
    assert message.startswith(
        f"{call}: a collective call; rank 1 did not reach it within 2 s: call {call} "
        "on every rank (not under `if ctx.is_main_process`)"
    )
    assert "end the run (close_context)" in message
    assert BOUND_S <= seconds < BOUND_S + SLACK_S


@pytest.mark.distributed
def test_a_failed_guard_writes_no_checkpoint(
    rank_zero_only: list[dict[str, Any]],
) -> None:
    assert rank_zero_only[0]["written"] is False


@pytest.mark.distributed
def test_a_rank_arriving_after_the_others_gave_up_fails_at_once(
    rank_zero_only: list[dict[str, Any]],
) -> None:
    message, seconds = rank_zero_only[1]["late save_checkpoint"]
    assert message is not None
    assert message.startswith(
        "save_checkpoint: a collective call; rank 1 did not reach it within 2 s (this "
        "rank arrived after rank 0 gave up waiting)"
    )
    assert seconds < BOUND_S  # it never waits for a call the others abandoned


def _mismatch_then_missing(ctx: DistributedContext, run: Path) -> dict[str, Any]:
    """3 ranks: rank 1 reaches reduce where the others gather; then rank 2 is absent."""
    ctx = dataclasses.replace(ctx, collective_timeout=BOUND_S)
    rank, done = ctx.process_index, run / "ranks-0-1-done"
    out: dict[str, Any] = {}
    if rank == 1:
        out["mismatch"] = _outcome(lambda: reduce(ctx, torch.ones(1), reduction="sum"))
    else:
        out["mismatch"] = _outcome(lambda: gather(ctx, torch.ones(1)))
    if rank == 2:
        _wait_for(done)
        return out
    out["missing"] = _outcome(lambda: gather(ctx, torch.ones(1)))
    (run / f"rank-{rank}-done").touch()
    if (run / "rank-0-done").exists() and (run / "rank-1-done").exists():
        done.touch()
    return out


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("three")
    return run_ranks(_mismatch_then_missing, 3, tmp / "workers", tmp)


@pytest.mark.distributed
def test_ranks_in_different_collectives_all_fail_naming_each(
    three_ranks: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(three_ranks):
        message, seconds = result["mismatch"]
        assert message is not None, rank
        caller = "reduce" if rank == 1 else "gather"
        assert message.startswith(
            f"{caller}: a collective call, but the ranks reached different "
            "collectives (rank 0: gather, rank 1: reduce, rank 2: gather); call the "
            "same funcaccel collectives in the same order on every rank."
        )
        assert seconds < BOUND_S  # all arrived: nothing to wait for


@pytest.mark.distributed
def test_every_rank_that_called_names_the_one_that_did_not(
    three_ranks: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        message, seconds = three_ranks[rank]["missing"]
        assert message is not None, rank
        assert message.startswith(
            "gather: a collective call; rank 2 did not reach it within 2 s: call "
            "gather on every rank"
        )
        assert BOUND_S <= seconds < BOUND_S + SLACK_S
    assert "missing" not in three_ranks[2]


def test_the_guard_is_off_with_one_process_or_without_a_bound() -> None:
    guard_collective(DistributedContext(collective_timeout=0.1), "gather")
    # Several processes but no bound: nothing is checked, not even the group.
    hand_built = DistributedContext(
        num_processes=2, distributed_type=DistributedType.MULTI_CPU
    )
    guard_collective(hand_built, "gather")


def test_the_guard_needs_a_process_group_when_on() -> None:
    ctx = DistributedContext(
        num_processes=2,
        distributed_type=DistributedType.MULTI_CPU,
        collective_timeout=1,
    )
    with pytest.raises(
        RuntimeError, match=r"^wait_for_everyone: ctx has num_processes=2"
    ):
        guard_collective(ctx, "wait_for_everyone")
