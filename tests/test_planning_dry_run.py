"""dry_run: the training function at 8 ranks in this process, and what it catches.

The function is a small funcaccel loop (a mesh, wrap_model with FSDP2, a sharded
loader, accumulate_step, a reduce). The dry run must pass it as written, and
name each of three mistakes: a mesh that does not divide the world, a tp_plan
naming a module the model lacks, a collective only the main process calls.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

import funcaccel as fa
from funcaccel.planning import DryRunError
from funcaccel.planning import dry_run


def _train(
    ctx: fa.DistributedContext,
    steps: int,
    *,
    tp: int = 1,
    tp_plan: dict[str, Any] | None = None,
    main_only_reduce: bool = False,
) -> None:
    mesh = fa.build_mesh(ctx, dp_shard=-1, tp=tp)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = fa.wrap_model(ctx, net, fsdp=fa.FSDPOptions(), mesh=mesh, tp_plan=tp_plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    loader = fa.shard_loader(ctx, DataLoader(data, batch_size=4))
    grad = fa.GradState(accumulation_steps=2)
    loss = torch.zeros(())
    for step, (x, y) in enumerate(loader):

        def loss_fn(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return nn.functional.mse_loss(model(x), y)

        loss, grad = fa.accumulate_step(ctx, grad, model, opt, loss_fn)
        if step + 1 == steps:
            break
    total = fa.reduce(ctx, loss.detach())
    if ctx.is_main_process:
        print(f"loss {float(total):.3f}")
        if main_only_reduce:
            fa.reduce(ctx, loss.detach())  # the mistake: rank 0 alone waits here


def test_dry_run_passes_a_correct_loop_on_ranks_0_1_and_7() -> None:
    report = dry_run(_train, 2, world_size=8)
    assert report.ranks == (0, 1, 7)
    counts = [len(calls) for calls in report.collectives]
    assert counts[0] == counts[1] == counts[2] > 0
    names = [name for name, _ in report.collectives[0]]
    assert names[-1] == "allreduce_"  # the reduce, last
    assert report.collectives[0][-1][1].startswith("test_planning_dry_run.py:")
    assert not dist.is_initialized()


def test_dry_run_names_a_mesh_that_does_not_divide_the_world() -> None:
    with pytest.raises(
        DryRunError,
        match=r"dry_run: rank 0 of 8 raised ValueError: build_mesh: the world size must be a multiple of 3",
    ) as caught:
        dry_run(lambda ctx: _train(ctx, 1, tp=3), world_size=8)
    assert isinstance(caught.value.__cause__, ValueError)
    assert not dist.is_initialized()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
def test_dry_run_names_a_tp_plan_module_the_model_lacks() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    plan = {"attn": ColwiseParallel()}
    with pytest.raises(
        DryRunError,
        match=r"rank 0 of 8 raised ValueError: wrap_model: every tp_plan key .* got 'attn'",
    ):
        dry_run(lambda ctx: _train(ctx, 1, tp=2, tp_plan=plan), world_size=8)


def test_dry_run_names_a_collective_only_the_main_process_calls() -> None:
    def train(ctx: fa.DistributedContext) -> None:
        _train(ctx, 1, main_only_reduce=True)

    with pytest.raises(
        DryRunError,
        match=r"the ranks call different collectives: rank 0's call (\d+) is allgather_ at test_planning_dry_run.py:\d+ in _train, but rank 1 makes no call \1",
    ) as caught:
        dry_run(train, world_size=8, ranks=[0, 1])
    assert "if ctx.is_main_process" in str(caught.value)
    assert not dist.is_initialized()


def test_dry_run_refuses_bad_arguments() -> None:
    with pytest.raises(
        ValueError, match=r"dry_run: ranks must be ranks below world_size \(4\)"
    ):
        dry_run(_train, 1, world_size=4, ranks=[4])
    with pytest.raises(TypeError, match=r"dry_run: fn must be a function"):
        dry_run(3, world_size=4)  # type: ignore[arg-type]
