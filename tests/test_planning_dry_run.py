"""dry_run: the training function at 8 ranks in this process, and what it catches.

The function is a small funcaccel loop (a mesh, wrap_model with FSDP2, a sharded
loader, accumulate_step, a reduce). The dry run must pass it as written, and
name each of three mistakes: a mesh that does not divide the world, a tp_plan
naming a module the model lacks, a collective only the main process calls; on
real tensors and on fake ones. On fake tensors a 4 GiB model runs without its
memory, value reads give the placeholders, and a batch the loader cannot shard
at the world size is named.
"""

from __future__ import annotations

import resource
from typing import Any
from typing import Literal

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

import funcaccel as fa
from funcaccel.planning import DryRunError
from funcaccel.planning import dry_run

Tensors = Literal["real", "fake"]
BOTH: tuple[Tensors, ...] = ("real", "fake")


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


@pytest.mark.parametrize("tensors", BOTH)
def test_dry_run_passes_a_correct_loop_on_ranks_0_1_and_7(tensors: Tensors) -> None:
    report = dry_run(_train, 2, world_size=8, tensors=tensors)
    assert report.ranks == (0, 1, 7)
    assert report.tensors == tensors
    counts = [len(calls) for calls in report.collectives]
    assert counts[0] == counts[1] == counts[2] > 0
    names = [name for name, _ in report.collectives[0]]
    assert names[-1] == "allreduce_"  # the reduce, last
    assert report.collectives[0][-1][1].startswith("test_planning_dry_run.py:")
    assert not dist.is_initialized()


@pytest.mark.parametrize("tensors", BOTH)
def test_dry_run_names_a_mesh_that_does_not_divide_the_world(tensors: Tensors) -> None:
    with pytest.raises(
        DryRunError,
        match=r"dry_run: rank 0 of 8 raised ValueError: build_mesh: the world size must be a multiple of 3",
    ) as caught:
        dry_run(lambda ctx: _train(ctx, 1, tp=3), world_size=8, tensors=tensors)
    assert isinstance(caught.value.__cause__, ValueError)
    assert not dist.is_initialized()


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")
@pytest.mark.parametrize("tensors", BOTH)
def test_dry_run_names_a_tp_plan_module_the_model_lacks(tensors: Tensors) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    plan = {"attn": ColwiseParallel()}
    with pytest.raises(
        DryRunError,
        match=r"rank 0 of 8 raised ValueError: wrap_model: every tp_plan key .* got 'attn'",
    ):
        dry_run(
            lambda ctx: _train(ctx, 1, tp=2, tp_plan=plan),
            world_size=8,
            tensors=tensors,
        )


@pytest.mark.parametrize("tensors", BOTH)
def test_dry_run_names_a_collective_only_the_main_process_calls(
    tensors: Tensors,
) -> None:
    def train(ctx: fa.DistributedContext) -> None:
        _train(ctx, 1, main_only_reduce=True)

    with pytest.raises(
        DryRunError,
        match=r"the ranks call different collectives: rank 0's call (\d+) is allgather_ at test_planning_dry_run.py:\d+ in _train, but rank 1 makes no call \1",
    ) as caught:
        dry_run(train, world_size=8, ranks=[0, 1], tensors=tensors)
    assert "if ctx.is_main_process" in str(caught.value)
    assert not dist.is_initialized()


def test_dry_run_refuses_bad_arguments() -> None:
    with pytest.raises(
        ValueError, match=r"dry_run: ranks must be ranks below world_size \(4\)"
    ):
        dry_run(_train, 1, world_size=4, ranks=[4])
    with pytest.raises(TypeError, match=r"dry_run: fn must be a function"):
        dry_run(3, world_size=4)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"dry_run: tensors must be one of 'real', 'fake'; got 'meta'"
    ):
        dry_run(_train, 1, world_size=4, tensors="meta")  # type: ignore[arg-type]


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def test_fake_dry_run_trains_a_4_gib_model_without_its_memory() -> None:
    width, seen = 16384, []  # 4 layers of 16384 x 16384 float32 weights: 4 GiB

    def train(ctx: fa.DistributedContext) -> None:
        mesh = fa.build_mesh(ctx, dp_shard=-1)
        layers = (nn.Linear(width, width, bias=False) for _ in range(4))
        net = nn.Sequential(*layers)
        seen.append(sum(p.numel() * p.element_size() for p in net.parameters()))
        model = fa.wrap_model(ctx, net, fsdp=fa.FSDPOptions(), mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        grad = fa.GradState(accumulation_steps=1)
        for _ in range(2):
            x = torch.randn(2, width)
            _, grad = fa.accumulate_step(
                ctx, grad, model, opt, lambda: model(x).square().mean()
            )
        assert grad.optimizer_steps == 2

    before = _peak_rss_bytes()
    dry_run(train, world_size=8, ranks=[0], tensors="fake")
    grown = _peak_rss_bytes() - before
    # Real, the weights alone are 4 GiB (then gradients and AdamW's two states);
    # fake, the run was measured to add about 90 MiB to the peak.
    assert seen == [4 * 2**30]
    assert grown < 2**30, f"peak RSS grew by {grown / 2**20:.0f} MiB"


def test_fake_dry_run_makes_fake_tensors_that_module_to_moves() -> None:
    kinds: list[tuple[bool, torch.dtype]] = []

    def train(ctx: fa.DistributedContext) -> None:
        net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        # Module.to swaps each fake parameter (torch.utils.swap_tensors), which
        # torch refuses for a tensor with a weak reference.
        net.to(ctx.device).to(torch.float64)
        kinds.extend((is_fake(p), p.dtype) for p in net.parameters())
        model = fa.wrap_model(ctx, net, fsdp=fa.FSDPOptions())
        shard = next(model.parameters())
        assert isinstance(shard, DTensor)
        kinds.append((is_fake(shard.to_local()), shard.dtype))

    report = dry_run(train, world_size=2, tensors="fake")
    assert report.tensors == "fake"
    assert kinds == [(True, torch.float64)] * 10  # 4 parameters and a shard, 2 ranks


def test_fake_dry_run_reads_placeholders_and_keeps_indices_real() -> None:
    read: list[object] = []

    def train(ctx: fa.DistributedContext) -> None:
        x = torch.randn(6) + 5.0
        read.extend([x.sum().item(), bool((x > 0).all()), int((x > 0).sum())])
        read.append(sorted(torch.randperm(6).tolist()))
        data = TensorDataset(torch.arange(6))
        loader = fa.shard_loader(ctx, DataLoader(data, batch_size=3, shuffle=True))
        read.append(sorted(i for (batch,) in loader for i in batch.tolist()))

    dry_run(train, world_size=1, tensors="fake")
    # The placeholders of a float, a bool and an integer; a permutation and the
    # loader's shuffled indices are real.
    assert read == [0.0, False, 1, list(range(6)), list(range(6))]


def test_fake_dry_run_takes_the_unskipped_side_of_the_fp16_scaler() -> None:
    skipped: list[bool] = []

    def train(ctx: fa.DistributedContext) -> None:
        model = fa.wrap_model(ctx, nn.Linear(8, 4), fsdp=fa.FSDPOptions())
        opt = torch.optim.AdamW(model.parameters())
        scaler = fa.build_grad_scaler(ctx)
        grad = fa.GradState(accumulation_steps=1)
        x = torch.randn(4, 8)
        _, grad = fa.accumulate_step(
            ctx, grad, model, opt, lambda: model(x).sum(), scaler=scaler
        )
        skipped.append(grad.step_was_skipped)

    # Real, the first fp16 step overflows at the initial scale and is skipped;
    # fake, the scaler's found-inf reads the placeholder 0.0 and the step runs.
    dry_run(train, world_size=2, ranks=[0], mixed_precision="fp16")
    dry_run(train, world_size=2, ranks=[0], mixed_precision="fp16", tensors="fake")
    assert skipped == [True, False]


def test_fake_dry_run_names_what_fake_tensors_cannot_run() -> None:
    def masked(ctx: fa.DistributedContext) -> None:
        del ctx  # one rank's tensors
        x = torch.randn(4)
        x = x[x > 0]  # a boolean mask: the output shape depends on values

    def compared(ctx: fa.DistributedContext) -> None:
        del ctx  # one rank's tensors
        x = torch.randn(4)
        assert torch.allclose(x, x.clone())

    def ddp(ctx: fa.DistributedContext) -> None:
        fa.wrap_model(ctx, nn.Linear(4, 4))

    def own_ddp(ctx: fa.DistributedContext) -> None:
        fa.wrap_ddp(ctx, nn.Linear(4, 4))

    with pytest.raises(
        DryRunError,
        match=r"rank 0 of 2 raised DynamicOutputShapeException: aten.nonzero.default \(an op whose output shape depends",
    ):
        dry_run(masked, world_size=2, tensors="fake")
    with pytest.raises(
        DryRunError,
        match=r"raised DataDependentOutputException: aten.allclose.default \(this op returns a Python value .* \{'bool': False, 'floating': 0.0, 'integer': 1\} by dtype",
    ):
        dry_run(compared, world_size=2, tensors="fake")
    with pytest.raises(
        DryRunError,
        match=r"rank 0 of 2 raised ValueError: wrap_model: DistributedDataParallel cannot wrap a model whose parameters are fake tensors .* tensors='real'",
    ):
        dry_run(ddp, world_size=2, tensors="fake")
    with pytest.raises(
        DryRunError, match=r"ValueError: wrap_ddp: DistributedDataParallel"
    ):
        dry_run(own_ddp, world_size=2, tensors="fake")
    for fn in (masked, compared, ddp, own_ddp):
        dry_run(fn, world_size=2)


def _load(
    ctx: fa.DistributedContext,
    samples: int,
    batch_size: int,
    *,
    split_batches: bool = False,
    even_batches: bool = True,
) -> None:
    """Two FSDP2 steps on a shuffled, sharded loader of ``samples`` samples."""
    mesh = fa.build_mesh(ctx, dp_shard=-1)
    model = fa.wrap_model(ctx, nn.Linear(8, 4), fsdp=fa.FSDPOptions(), mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())
    data = TensorDataset(torch.randn(samples, 8), torch.randn(samples, 4))
    loader = fa.shard_loader(
        ctx,
        DataLoader(data, batch_size=batch_size, shuffle=True),
        split_batches=split_batches,
        even_batches=even_batches,
    )
    grad = fa.GradState(accumulation_steps=1)
    for step, (x, y) in enumerate(loader):

        def loss_fn(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            return nn.functional.mse_loss(model(x), y)

        _, grad = fa.accumulate_step(ctx, grad, model, opt, loss_fn)
        if step == 1:
            break


@pytest.mark.parametrize("tensors", BOTH)
def test_dry_run_names_a_split_batch_the_world_does_not_divide(
    tensors: Tensors,
) -> None:
    def train(ctx: fa.DistributedContext) -> None:
        _load(ctx, 96, 12, split_batches=True)

    dry_run(train, world_size=4, tensors=tensors)  # 12 rows split 4 ways
    with pytest.raises(
        DryRunError,
        match=r"dry_run: rank 0 of 8 raised ValueError: shard_loader: batch_size \(12\) must be a multiple of num_processes \(8\) when split_batches=True",
    ) as caught:
        dry_run(train, world_size=8, tensors=tensors)
    assert isinstance(caught.value.__cause__, ValueError)
    assert not dist.is_initialized()


@pytest.mark.parametrize("tensors", BOTH)
def test_dry_run_names_ranks_the_loader_leaves_without_a_batch(
    tensors: Tensors,
) -> None:
    def train(ctx: fa.DistributedContext) -> None:
        _load(ctx, 8, 4, even_batches=False)  # two batches for eight ranks

    dry_run(train, world_size=2, tensors=tensors)
    with pytest.raises(
        DryRunError,
        match=r"the ranks call different collectives: rank 0's call 1 is \w+ at test_planning_dry_run.py:\d+ in loss_fn, but rank 7 makes no call 1 \(it made 0\)",
    ) as caught:
        dry_run(train, world_size=8, tensors=tensors)
    assert "even_batches=True" in str(caught.value)
