"""A collective called on only some ranks fails fast, naming the call (guard_collective).

With ``ctx.collective_timeout`` set, the ranks that make a funcaccel collective
call get a ``RuntimeError`` naming it within the bound, instead of waiting for the
process group's timeout. That calls with the guard on give the same results as
without is checked by the guarded runs in ``test_collectives.py`` and
``test_checkpoint.py``.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from typing import Final

import pytest
import torch
from torch import nn
from torch._C._distributed_c10d import HashStore

from funcaccel._group import end_process_group
from funcaccel._group import start_process_group
from funcaccel._guard import guard_collective
from funcaccel._guard import hang_report_dir
from funcaccel._guard import settle_arrival
from funcaccel.checkpoint import save_checkpoint
from funcaccel.collectives import any_process
from funcaccel.collectives import gather
from funcaccel.collectives import reduce
from funcaccel.collectives import wait_for_everyone
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.launch import launch
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks
from tests.fixtures import outcome
from tests.fixtures import wait_for

BOUND_S: Final = 2.0
# Above the bound: the file store the tests rendezvous through polls once a second,
# and the machine is shared.
SLACK_S: Final = 8.0
_WAIT_S: Final = 90.0


def _rank_zero_only(ctx: DistributedContext, run: Path) -> dict[str, Any]:
    """Rank 0 calls five collectives alone; rank 1 waits them out, then calls late."""
    ctx = dataclasses.replace(
        ctx, collective_timeout=BOUND_S, hang_report_dir=str(run / "hangs")
    )
    done = run / "rank-0-done"
    checkpoints = run / "checkpoints"
    if ctx.is_main_process:
        out = {
            "save_checkpoint": outcome(
                lambda: save_checkpoint(ctx, checkpoints, models=nn.Linear(1, 1))
            ),
            "gather": outcome(lambda: gather(ctx, torch.ones(1))),
            "reduce": outcome(lambda: reduce(ctx, torch.ones(1), reduction="sum")),
            "wait_for_everyone": outcome(lambda: wait_for_everyone(ctx)),
            "any_process": outcome(lambda: any_process(ctx, True)),
            "written": checkpoints.exists() and any(checkpoints.iterdir()),
        }
        done.touch()
        return out
    # Never joins the five calls; waits (well past the bound) until rank 0 gave up
    # on all of them, then makes the first one late.
    wait_for(done, _WAIT_S)
    late = outcome(lambda: save_checkpoint(ctx, checkpoints, models=nn.Linear(1, 1)))
    return {"late save_checkpoint": late}


@pytest.fixture(scope="module")
def rank_zero_only(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("rank0")
    return run_ranks(_rank_zero_only, 2, tmp, start_method="forkserver")


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
    ctx = dataclasses.replace(
        ctx, collective_timeout=BOUND_S, hang_report_dir=str(run / "hangs")
    )
    rank, done = ctx.process_index, run / "ranks-0-1-done"
    out: dict[str, Any] = {}
    if rank == 1:
        out["mismatch"] = outcome(lambda: reduce(ctx, torch.ones(1), reduction="sum"))
    else:
        out["mismatch"] = outcome(lambda: gather(ctx, torch.ones(1)))
    if rank == 2:
        wait_for(done, _WAIT_S)
        return out
    out["missing"] = outcome(lambda: gather(ctx, torch.ones(1)))
    (run / f"rank-{rank}-done").touch()
    if (run / "rank-0-done").exists() and (run / "rank-1-done").exists():
        done.touch()
    return out


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("three")
    return run_ranks(_mismatch_then_missing, 3, tmp, start_method="forkserver")


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


def test_the_guard_is_off_with_one_process_or_when_turned_off() -> None:
    guard_collective(DistributedContext(collective_timeout=0.1), "gather")
    guard_collective(DistributedContext(), "gather")
    # Several processes but "off": nothing is checked, not even the group.
    hand_built = DistributedContext(
        num_processes=2,
        distributed_type=DistributedType.MULTI_CPU,
        collective_timeout="off",
    )
    guard_collective(hand_built, "gather")


def test_the_guard_is_on_by_default() -> None:
    # No bound given: the guard runs (bounded by the group's timeout), so it
    # needs the group.
    ctx = DistributedContext(
        num_processes=2, distributed_type=DistributedType.MULTI_CPU
    )
    assert ctx.collective_timeout is None
    with pytest.raises(RuntimeError, match=r"^gather: ctx has num_processes=2"):
        guard_collective(ctx, "gather")


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


class _CountingStore:
    """A HashStore shared by threads standing in for ranks; counts each rank's ops."""

    def __init__(self) -> None:
        self._store = HashStore()
        self.ops: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self) -> None:
        with self._lock:
            self.ops[threading.current_thread().name] += 1

    def add(self, key: str, value: int, /) -> int:
        self._count()
        return self._store.add(key, value)

    def compare_set(self, key: str, expected: str, desired: str, /) -> bytes:
        self._count()
        return self._store.compare_set(key, expected, desired)

    def wait(self, keys: list[str], timeout: timedelta, /) -> None:
        self._count()
        self._store.wait(keys, timeout)

    def get(self, key: str, /) -> bytes:
        self._count()
        return self._store.get(key)

    def set(self, key: str, value: str, /) -> None:
        self._count()
        self._store.set(key, value)

    def check(self, keys: list[str], /) -> bool:
        self._count()
        return self._store.check(keys)

    def delete_key(self, key: str, /) -> bool:
        self._count()
        return self._store.delete_key(key)

    def keys(self) -> int:
        return self._store.num_keys()


def _arrive_all(
    store: _CountingStore, callers: list[str], timeout_s: float = 20.0
) -> list[Any]:
    """Every rank (a thread named by its rank) arrives once; return the decisions."""
    world = len(callers)
    results: list[Any] = [None] * world

    def arrive(rank: int) -> None:
        results[rank] = settle_arrival(
            store, rank, world, callers[rank], timedelta(seconds=timeout_s)
        )

    threads = [
        threading.Thread(target=arrive, args=(r,), name=str(r)) for r in range(world)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


@pytest.mark.parametrize("world", [2, 8, 64, 256])
def test_the_guard_costs_a_constant_number_of_store_operations_per_rank(
    world: int,
) -> None:
    store = _CountingStore()
    calls = 3
    for call in range(calls):
        decisions = _arrive_all(store, ["gather"] * world)
        assert decisions == [(None, call + 1)] * world
    # Five operations per rank and call whatever the world size; the last to
    # arrive at each call settles it and deletes the call before's keys (4 more).
    per_rank = sorted(store.ops[str(r)] for r in range(world))
    assert sum(per_rank) == 5 * calls * world + 1 * calls + 3 * (calls - 1)
    assert per_rank[-1] <= 5 * calls + 4 * calls
    # Keys of finished calls are deleted: what is left does not grow with calls.
    assert store.keys() <= world + 3 * 2


def test_a_rank_reaching_another_call_settles_a_mismatch_for_all() -> None:
    store = _CountingStore()
    decisions = _arrive_all(store, ["gather", "reduce", "gather"])
    kinds = {decision["kind"] for decision, _ in decisions}
    assert kinds == {"mismatch"}
    assert all(number == 1 for _, number in decisions)


def test_ranks_that_never_arrive_are_named_by_those_that_waited() -> None:
    store = _CountingStore()
    world = 4
    waited = [
        settle_arrival(store, rank, world, "gather", timedelta(seconds=0.2))
        for rank in (0, 2)
    ]
    for decision, number in waited:
        assert number == 1
        assert decision == {"kind": "missing", "rank": 0, "missing": [1, 2, 3]}


GROUP_TIMEOUT_S: Final = 3.0
_DEFAULT_CALLS: Final = ("save_checkpoint", "gather", "wait_for_everyone")


def _alone_with_defaults(tmp_path: Path) -> dict[str, Any]:
    """Rank 0 calls three collectives alone; no bound is set but the group's."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start_process_group(
        "gloo",
        init_method=f"file://{tmp_path}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=GROUP_TIMEOUT_S),
    )
    done = tmp_path / "rank-0-done"
    try:
        ctx = rank_ctx(world_size, rank)
        if rank != 0:
            wait_for(done, _WAIT_S)
            return {}
        calls: dict[str, Callable[[], object]] = {
            "save_checkpoint": lambda: save_checkpoint(
                ctx, tmp_path / "ckpt", models=nn.Linear(1, 1)
            ),
            "gather": lambda: gather(ctx, torch.ones(1)),
            "wait_for_everyone": lambda: wait_for_everyone(ctx),
        }
        out: dict[str, Any] = {name: outcome(call) for name, call in calls.items()}
        done.touch()
        # No hang_report_dir: the reports went to the default directory, which
        # this run's ranks share; list it, then remove it.
        reports = hang_report_dir(ctx)
        out["reports"] = str(reports), sorted(p.name for p in reports.iterdir())
        shutil.rmtree(reports)
        return out
    finally:
        end_process_group()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_by_default_a_call_on_rank_zero_only_fails_within_the_groups_timeout(
    tmp_path: Path, world_size: int
) -> None:
    # No collective_timeout: the bound is the group's own timeout (here 3 s),
    # and the error names the call and every rank that did not arrive.
    alone = launch(
        _alone_with_defaults,
        tmp_path,
        num_processes=world_size,
        backend=None,  # each rank starts a group with a 3 s timeout itself
        start_method="forkserver",
        timeout_s=120,
    )[0]
    others = ", ".join(str(r) for r in range(1, world_size))
    ranks = "rank" if world_size == 2 else "ranks"
    for call in _DEFAULT_CALLS:
        message, seconds = alone[call]
        assert message is not None, f"{call} returned on rank 0 alone"
        assert message.startswith(
            f"{call}: a collective call; {ranks} {others} did not reach it within "
            f"3 s: call {call} on every rank (not under `if ctx.is_main_process`)"
        ), message
        assert GROUP_TIMEOUT_S <= seconds < GROUP_TIMEOUT_S + SLACK_S
    reports, names = alone["reports"]
    assert reports.startswith(os.path.join(tempfile.gettempdir(), "funcaccel-hang-"))
    assert names == ["rank0.txt"]
    for call in _DEFAULT_CALLS:
        assert f"are in {reports}/rank0.txt (each rank" in alone[call][0]
