"""maybe_step_scheduler: rules, examples and errors (simulated ranks).

The rules: docs/accumulate.md#semantics-stepping-the-scheduler.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.lr_scheduler import OneCycleLR
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.accumulate import advance_grad_state
from funcaccel.context import DistributedContext
from funcaccel.kwargs import GradScalerKwargs
from funcaccel.loader import ShardedLoader
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.mesh import build_mesh
from funcaccel.mixed_precision import build_grad_scaler
from funcaccel.model import wrap_model
from funcaccel.scheduler import ScheduleCounts
from funcaccel.scheduler import maybe_step_scheduler
from funcaccel.scheduler import scheduler_steps_due
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

ONE = DistributedContext()


def _optimizer() -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)


def _simulate(
    ctx: DistributedContext,
    scheduler: LRScheduler,
    grad: GradState,
    flags: Sequence[bool],
    *,
    skipped: Sequence[bool] = (),
    counts_in: ScheduleCounts = "batches",
) -> tuple[list[int], list[int]]:
    """Walk micro-steps as accumulate_step would; return steps and _step_count."""
    steps, counts = [], []
    skips = list(skipped) or [False] * len(flags)
    for flag, skip in zip(flags, skips, strict=True):
        grad = advance_grad_state(grad, end_of_dataloader=flag, step_was_skipped=skip)
        if grad.sync_gradients and not grad.step_was_skipped:
            scheduler.optimizer.step()  # what accumulate_step does; torch checks it
        steps.append(
            maybe_step_scheduler(ctx, scheduler, grad, schedule_counts=counts_in)
        )
        counts.append(scheduler._step_count)
    return steps, counts


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize(
    ("counts_in", "expected"), [("batches", [1, 3, 3, 5]), ("updates", [1, 2, 2, 3])]
)
def test_spec_example_step_lr_two_ranks_k2(
    rank: int, counts_in: ScheduleCounts, expected: list[int]
) -> None:
    scheduler = StepLR(_optimizer(), step_size=1)
    flags = [False, False, False, True]  # 4 batches per rank
    _, counts = _simulate(
        rank_ctx(2, rank),
        scheduler,
        GradState(accumulation_steps=2),
        flags,
        counts_in=counts_in,
    )
    assert counts == expected


@pytest.mark.parametrize("rank", [0, 1])
def test_spec_example_one_cycle_total_3_two_ranks_never_steps_past_its_end(
    rank: int,
) -> None:
    scheduler = OneCycleLR(_optimizer(), max_lr=1.0, total_steps=3)
    steps, counts = _simulate(rank_ctx(2, rank), scheduler, GradState(), [False] * 3)
    assert counts == [3, 4, 4]
    assert steps == [2, 1, 0]


@pytest.mark.parametrize(
    ("counts_in", "step_with_optimizer"), [("updates", True), ("batches", False)]
)
def test_one_cycle_guard_applies_on_every_path(
    counts_in: ScheduleCounts, step_with_optimizer: bool
) -> None:
    optimizer = _optimizer()
    scheduler = OneCycleLR(optimizer, max_lr=1.0, total_steps=2)
    optimizer.step()
    steps = [
        maybe_step_scheduler(
            rank_ctx(4),
            scheduler,
            GradState(),
            schedule_counts=counts_in,
            step_with_optimizer=step_with_optimizer,
        )
        for _ in range(5)
    ]
    assert steps == [1, 1, 0, 0, 0]
    assert scheduler._step_count == 3


def test_spec_example_scaler_ok_inf_ok_one_process() -> None:
    ctx = dataclasses.replace(ONE, mixed_precision="fp16")
    scaler = build_grad_scaler(ctx, GradScalerKwargs(init_scale=4))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = StepLR(optimizer, step_size=1)
    grad, counts, steps = GradState(), [], []
    for factor in (1.0, float("inf"), 1.0):

        def loss_fn(factor: float = factor) -> torch.Tensor:
            out: torch.Tensor = model(torch.ones(1, 2))
            return out.float().sum() * factor

        _, grad = accumulate_step(ctx, grad, model, optimizer, loss_fn, scaler=scaler)
        steps.append(
            maybe_step_scheduler(ctx, scheduler, grad, schedule_counts="updates")
        )
        counts.append(scheduler._step_count)
    assert counts == [2, 2, 3]
    assert steps == [1, 0, 1]


@pytest.mark.parametrize(
    ("grad", "counts_in", "with_optimizer", "expected"),
    [
        (GradState(), "batches", True, 3),
        (GradState(), "updates", True, 1),
        (GradState(step_was_skipped=True), "batches", True, 0),
        (GradState(step_was_skipped=True), "batches", False, 1),
        (GradState(accumulation_steps=2, micro_step=1, sync_gradients=False), "batches", True, 0),
        (GradState(accumulation_steps=2, micro_step=1, sync_gradients=False), "updates", False, 1),
        (GradState(accumulation_steps=2, end_of_dataloader=True), "batches", True, 3),
    ],
)  # fmt: skip
def test_scheduler_steps_due_table_on_three_ranks(
    grad: GradState, counts_in: ScheduleCounts, with_optimizer: bool, expected: int
) -> None:
    for rank in range(3):
        due = scheduler_steps_due(
            rank_ctx(3, rank),
            grad,
            schedule_counts=counts_in,
            step_with_optimizer=with_optimizer,
        )
        assert due == expected


@settings(max_examples=60)
@given(
    p=st.integers(1, 4),
    k=st.integers(1, 4),
    counts_in=st.sampled_from(["updates", "batches"]),
    flags_skips=st.lists(st.tuples(st.booleans(), st.booleans()), max_size=30),
)
def test_scheduler_counts_applied_updates_times_processes(
    p: int, k: int, counts_in: ScheduleCounts, flags_skips: list[tuple[bool, bool]]
) -> None:
    grad = GradState(accumulation_steps=k)
    flags = [f for f, _ in flags_skips]
    skips = []
    for flag, skip in flags_skips:  # a skip is only possible on a syncing step
        after = advance_grad_state(grad, end_of_dataloader=flag)
        skips.append(skip and after.sync_gradients)
        grad = advance_grad_state(
            grad, end_of_dataloader=flag, step_was_skipped=skips[-1]
        )
    scheduler = StepLR(_optimizer(), step_size=1)
    steps, counts = _simulate(
        rank_ctx(p), scheduler, GradState(accumulation_steps=k), flags,
        skipped=skips, counts_in=counts_in,
    )  # fmt: skip
    per_update = 1 if counts_in == "updates" else p
    assert sum(steps) == per_update * grad.optimizer_steps
    assert scheduler._step_count == 1 + sum(steps)


def test_reduce_lr_on_plateau_takes_metrics() -> None:
    optimizer = _optimizer()
    scheduler = ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    optimizer.step()
    for metric in (1.0, 0.5):  # improving: the lr stays
        due = maybe_step_scheduler(
            ONE, scheduler, GradState(), schedule_counts="updates", metrics=metric
        )
        assert due == 1
    assert optimizer.param_groups[0]["lr"] == 1.0
    n = maybe_step_scheduler(
        rank_ctx(2), scheduler, GradState(), metrics=2.0, step_with_optimizer=False
    )
    assert n == 1
    assert optimizer.param_groups[0]["lr"] == 0.5
    assert scheduler.last_epoch == 3
    with pytest.raises(
        ValueError,
        match=r"maybe_step_scheduler: ReduceLROnPlateau steps on a metric but metrics=None",
    ):
        maybe_step_scheduler(ONE, scheduler, GradState())
    assert maybe_step_scheduler(
        ONE,
        scheduler,
        GradState(),
        schedule_counts="updates",
        metrics=torch.tensor(3.0),
    )
    for bad in ("0.5", torch.ones(2), object()):
        with pytest.raises(
            TypeError,
            match=r"maybe_step_scheduler: metrics must be a number or a one-element "
            r"tensor for ReduceLROnPlateau to compare; got",
        ):
            maybe_step_scheduler(ONE, scheduler, GradState(), metrics=bad)  # type: ignore[arg-type]
    assert scheduler.last_epoch == 4  # the refused calls did not step


def test_any_object_with_step_is_stepped() -> None:
    class Counter:
        def __init__(self) -> None:
            self.calls = 0

        def step(self) -> None:
            self.calls += 1

    counter = Counter()
    assert (
        maybe_step_scheduler(
            rank_ctx(3, 2), counter, GradState(), schedule_counts="batches"
        )
        == 3
    )
    assert counter.calls == 3


def test_maybe_step_scheduler_rejects_bad_input() -> None:
    scheduler = StepLR(_optimizer(), step_size=1)
    with pytest.raises(
        ValueError,
        match=r"maybe_step_scheduler: metrics=0.5 is only used by ReduceLROnPlateau, not StepLR",
    ):
        maybe_step_scheduler(ONE, scheduler, GradState(), metrics=0.5)
    with pytest.raises(
        TypeError,
        match=r"maybe_step_scheduler: scheduler must be an object with a step\(\) method",
    ):
        maybe_step_scheduler(ONE, object(), GradState())  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=r"maybe_step_scheduler: schedule_counts must be one of 'updates', "
        r"'batches'; got 'steps'\.",
    ):
        maybe_step_scheduler(ONE, scheduler, GradState(), schedule_counts="steps")  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"maybe_step_scheduler: step_with_optimizer must be a bool"
    ):
        maybe_step_scheduler(ONE, scheduler, GradState(), step_with_optimizer=None)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"maybe_step_scheduler: grad must be the GradState"
    ):
        maybe_step_scheduler(ONE, scheduler, True)  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"maybe_step_scheduler: ctx must be a DistributedContext"
    ):
        maybe_step_scheduler(2, scheduler, GradState())  # type: ignore[arg-type]
    with pytest.raises(
        TypeError, match=r"scheduler_steps_due: ctx must be a DistributedContext"
    ):
        scheduler_steps_due(None, GradState())  # type: ignore[arg-type]
    with pytest.raises(
        TypeError,
        match=r"(?s)maybe_step_scheduler: scheduler must be an LR scheduler, not an "
        r"optimizer; got .*\(SGD\)\. Its step\(\) would update the parameters; pass "
        r"the LR scheduler built on it\.",
    ):
        maybe_step_scheduler(ONE, scheduler.optimizer, GradState())
    assert scheduler._step_count == 1


def _loader(ctx: DistributedContext, *, split_batches: bool) -> ShardedLoader:
    data = TensorDataset(torch.arange(12.0))
    return shard_loader(
        ctx, DataLoader(data, batch_size=6), split_batches=split_batches
    )


@pytest.mark.parametrize(("p", "rank"), [(2, 0), (2, 1), (3, 0), (3, 2)])
@pytest.mark.parametrize("split", [False, True])
def test_maybe_step_scheduler_reads_split_batches_from_the_loader(
    p: int, rank: int, split: bool
) -> None:
    ctx = rank_ctx(p, rank)
    loader = _loader(ctx, split_batches=split)
    scheduler = StepLR(_optimizer(), step_size=1)
    scheduler.optimizer.step()
    assert maybe_step_scheduler(ctx, scheduler, GradState(), loader=loader) == (
        1 if split else p
    )
    assert scheduler_steps_due(ctx, GradState(), loader=loader) == (1 if split else p)


@pytest.mark.parametrize(
    ("p", "rank", "sizes", "streams"),
    [
        (4, 1, {"tp": 2}, 2),
        (4, 3, {"tp": 4}, 1),
        (8, 5, {"dp_replicate": 2, "tp": 2}, 4),
        (4, 2, {}, 4),
    ],
)
def test_a_loader_on_a_mesh_counts_its_data_parallel_ranks(
    p: int, rank: int, sizes: dict[str, int], streams: int
) -> None:
    # Tensor-parallel peers read the same batches: an update on p ranks uses up
    # dp_size of the original loader's batches, so a schedule counted in them
    # steps dp_size times (p times would run it tp times too fast).
    ctx = rank_ctx(p, rank)
    mesh = build_mesh(ctx, **sizes)
    data = DataLoader(TensorDataset(torch.arange(48.0)), batch_size=4)
    loader = shard_loader(ctx, data, mesh=mesh)
    assert loader.data_parallel_size == mesh.dp_size == streams
    assert len(loader) == 12 // streams
    assert scheduler_steps_due(ctx, GradState(), loader=loader) == streams
    scheduler = StepLR(_optimizer(), step_size=1)
    scheduler.optimizer.step()
    assert maybe_step_scheduler(ctx, scheduler, GradState(), loader=loader) == streams
    split = shard_loader(ctx, data, mesh=mesh, split_batches=True)
    assert scheduler_steps_due(ctx, GradState(), loader=split) == 1


@pytest.mark.parametrize(("p", "rank"), [(1, 0), (2, 1), (3, 2)])
def test_without_loader_or_schedule_counts_the_call_is_refused_on_any_world_size(
    p: int, rank: int
) -> None:
    # One process too: the count would be right there, but the same script
    # would fail only once scaled out.
    ctx = rank_ctx(p, rank)
    scheduler = StepLR(_optimizer(), step_size=1)
    scheduler.optimizer.step()
    accumulating = GradState(accumulation_steps=2, micro_step=1, sync_gradients=False)
    for grad in (GradState(), accumulating):  # refused on any micro-step
        with pytest.raises(
            ValueError,
            match=r"maybe_step_scheduler: neither loader= nor schedule_counts= says "
            rf"how the schedule's length is counted, .* \(this run has {p}\); got "
            r"loader=None, schedule_counts=None\. Pass loader=<the ShardedLoader "
            r"from shard_loader> .*schedule_counts='updates' .*"
            r"schedule_counts='batches'",
        ):
            maybe_step_scheduler(ctx, scheduler, grad)
    with pytest.raises(ValueError, match=r"scheduler_steps_due: neither loader="):
        scheduler_steps_due(ctx, GradState())
    assert scheduler._step_count == 1  # nothing stepped
    # Once per call: the question does not arise.
    once = maybe_step_scheduler(ctx, scheduler, GradState(), step_with_optimizer=False)
    assert once == 1


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("split", [False, True])
def test_split_batches_is_refused_with_its_replacement(p: int, split: bool) -> None:
    ctx = rank_ctx(p)
    scheduler = StepLR(_optimizer(), step_size=1)
    with pytest.raises(
        ValueError,
        match=rf"maybe_step_scheduler: split_batches must be left out: "
        rf"schedule_counts= replaced it; got {split}\. Pass "
        r"schedule_counts='batches' \(num_processes steps per update, what "
        r"split_batches=False did.*schedule_counts='updates' \(one step per "
        r"update, what split_batches=True did\)",
    ):
        maybe_step_scheduler(ctx, scheduler, GradState(), split_batches=split)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"scheduler_steps_due: split_batches must"):
        scheduler_steps_due(
            ctx,
            GradState(),
            schedule_counts="updates",
            split_batches=split,  # type: ignore[arg-type]
        )
    assert scheduler._step_count == 1


@pytest.mark.parametrize(("p", "rank"), [(2, 1), (3, 2)])
@pytest.mark.parametrize("split", [False, True])
def test_schedule_counts_updates_steps_once_per_update_whatever_the_loader(
    p: int, rank: int, split: bool
) -> None:
    ctx = rank_ctx(p, rank)
    loader = _loader(ctx, split_batches=split)
    for passed in (loader, None):
        due = scheduler_steps_due(
            ctx, GradState(), loader=passed, schedule_counts="updates"
        )
        assert due == 1
    # "batches" follows the loader (an unsplit one without a loader).
    batches = scheduler_steps_due(
        ctx, GradState(), loader=loader, schedule_counts="batches"
    )
    assert batches == (1 if split else p)
    assert scheduler_steps_due(ctx, GradState(), schedule_counts="batches") == p


def test_a_wrong_loader_is_refused() -> None:
    scheduler = StepLR(_optimizer(), step_size=1)
    with pytest.raises(
        TypeError,
        match=r"maybe_step_scheduler: loader must be the ShardedLoader shard_loader "
        r"returned; got list of 100 items \(list\)",
    ):
        wrong: Any = list(range(100))
        maybe_step_scheduler(rank_ctx(2), scheduler, GradState(), loader=wrong)
    assert scheduler._step_count == 1


def _split_worker(ctx: DistributedContext, split: bool) -> dict[str, Any]:
    # 8 samples in batches of 2 (4 single-process batches), k=1: the schedule
    # ends at _step_count 5 whether the batches are split or not.
    data = TensorDataset(torch.arange(8.0).unsqueeze(1))
    loader = shard_loader(ctx, DataLoader(data, batch_size=2), split_batches=split)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = StepLR(optimizer, step_size=1)
    grad = GradState()
    for batch in iter_batches(loader):
        (x,) = batch.data
        _, grad = accumulate_step(
            ctx, grad, model, optimizer, lambda: model(x).square().mean(),
            end_of_dataloader=batch.is_last,
        )  # fmt: skip
        maybe_step_scheduler(ctx, scheduler, grad, loader=loader)
    out: dict[str, Any] = {"count": scheduler._step_count}
    try:
        maybe_step_scheduler(ctx, scheduler, grad)
    except ValueError as error:
        out["forgotten"] = str(error)
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("split", [False, True])
def test_maybe_step_scheduler_follows_the_loader_on_two_processes(split: bool) -> None:
    for result in run_ranks(_split_worker, 2, split, start_method="forkserver"):
        assert result["count"] == 5
        assert result["forgotten"].startswith(
            "maybe_step_scheduler: neither loader= nor schedule_counts="
        )


def _nanogpt_worker(ctx: DistributedContext) -> dict[str, Any]:
    """A loop without a loader: each rank samples its own batches (as nanoGPT).

    The cosine-style schedule is counted in optimizer updates: 3 updates of
    ``k=2`` micro-steps each, ``LambdaLR`` reading the update number.
    """
    torch.manual_seed(100 + ctx.process_index)  # each rank its own batches
    model = wrap_model(ctx, torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    updates, k = 3, 2
    scheduler = LambdaLR(optimizer, lambda step: 1.0 - step / updates)
    grad, lrs, stepped = GradState(accumulation_steps=k), [], []
    for _ in range(updates * k):
        x = torch.randn(4, 2)
        _, grad = accumulate_step(
            ctx, grad, model, optimizer, lambda: model(x).square().mean()
        )
        stepped.append(
            maybe_step_scheduler(ctx, scheduler, grad, schedule_counts="updates")
        )
        lrs.append(scheduler.get_last_lr()[0])
    out: dict[str, Any] = {"stepped": stepped, "lrs": lrs}
    try:  # the call of a script written without the question
        maybe_step_scheduler(ctx, scheduler, grad)
    except ValueError as error:
        out["ambiguous"] = str(error)
    return out


@pytest.mark.distributed
def test_a_loop_without_a_loader_steps_once_per_update_on_two_ranks() -> None:
    for result in run_ranks(_nanogpt_worker, 2, start_method="forkserver"):
        assert result["stepped"] == [0, 1] * 3
        # lr after update u is 1 - u/3, on both ranks (not 1 - 2u/3)
        assert result["lrs"] == pytest.approx([1.0, 2 / 3, 2 / 3, 1 / 3, 1 / 3, 0.0])
        assert "neither loader= nor schedule_counts=" in result["ambiguous"]
