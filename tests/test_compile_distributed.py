"""Compiled blocks on 2 and 4 gloo ranks: DDP, FSDP2, HSDP 2x2, tensor parallelism, meta.

One spawned run per world size trains every configuration and returns the
losses and full parameters; the asserts compare them with a one-process float64
reference computed here (the mean loss over the whole global batch of each
micro-step, a window of 2 micro-steps, the last window short). Blocks compile
with "aot_eager" and ``fullgraph=True``: the no-sync context, autocast and the
window's rescaling run around them without a graph break.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel

from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.mesh import build_mesh
from funcaccel.model import ActivationCheckpointOptions
from funcaccel.model import CompileOptions
from funcaccel.model import FSDPOptions
from funcaccel.model import apply_activation_checkpointing
from funcaccel.model import compile_blocks
from funcaccel.model import compile_report
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_fsdp
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks
from tests._fast_step_models import Block
from tests._fast_step_models import TinyNet
from tests._fast_step_models import batches
from tests._fast_step_models import loss_of
from tests.fixtures import TpMLP

F64 = torch.float64
K = 2
STEPS = 5  # micro-steps per rank: windows of 2, 2 and a short 1
ROWS = 2  # rows per rank and micro-step
CHEAP = CompileOptions(blocks=[Block], backend="aot_eager")

pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
)


def _global_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(STEPS, ROWS * world)


def _rank_part(
    batch: tuple[torch.Tensor, torch.Tensor], rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch
    return x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]


def _train(
    ctx: DistributedContext,
    model: nn.Module,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    opt: torch.optim.Optimizer,
) -> list[float]:
    grad = GradState(accumulation_steps=K)
    losses = []
    for i, batch in enumerate(data):
        loss, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            functools.partial(loss_of, model, batch),
            end_of_dataloader=i == len(data) - 1,
        )
        losses.append(loss.item())
    return losses


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
        for p in unwrap_model(model).parameters()
    ]


def reference(world: int) -> list[torch.Tensor]:
    """One process, whole global batches: the parameters every run must reach."""
    torch.manual_seed(0)
    model = TinyNet().to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(DistributedContext(), model, _global_batches(world), opt)
    return [p.detach() for p in model.parameters()]


def _run(
    ctx: DistributedContext, build: Any, data: list[Any]
) -> tuple[list[float], list[torch.Tensor], Any]:
    torch.manual_seed(0)
    net = TinyNet().to(F64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = build(net, opt)
    losses = _train(ctx, model, data, opt)
    return losses, _full(model), compile_report(model)


def _two_rank_worker(ctx: DistributedContext) -> dict[str, Any]:
    rank = ctx.process_index
    data = [_rank_part(b, rank) for b in _global_batches(2)]
    fsdp = FSDPOptions(shard_modules=[Block])
    ac = ActivationCheckpointOptions(blocks=[Block])
    builds = {
        "ddp": lambda net, opt: wrap_model(ctx, net),
        "ddp+compile": lambda net, opt: wrap_model(ctx, net, compile=CHEAP),
        "fsdp": lambda net, opt: wrap_model(ctx, net, fsdp=fsdp, optimizers=opt),
        "fsdp+compile": lambda net, opt: wrap_model(
            ctx, net, fsdp=fsdp, optimizers=opt, compile=CHEAP
        ),
        "fsdp+ac+compile": lambda net, opt: wrap_model(
            ctx,
            net,
            fsdp=fsdp,
            optimizers=opt,
            compile=CHEAP,
            activation_checkpointing=ac,
        ),
    }
    out: dict[str, Any] = {name: _run(ctx, b, data) for name, b in builds.items()}
    # A meta model: materialised shard by shard, then checkpointed and compiled.
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = TinyNet()
    model = wrap_model(
        ctx, meta, fsdp=fsdp, compile=CHEAP, activation_checkpointing=ac
    ).to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out["meta"] = (_train(ctx, model, data, opt), _full(model), compile_report(model))
    # Tensor parallelism (tp=2) with the whole model compiled.
    torch.manual_seed(0)
    tp_net = TpMLP().to(F64)
    x = torch.randn(3, 4, dtype=F64)
    want = tp_net(x)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    mesh = build_mesh(ctx, dp_shard=1, tp=2)
    tp_model = wrap_model(
        ctx,
        tp_net,
        mesh=mesh,
        tp_plan=plan,
        compile=CompileOptions(backend="aot_eager"),
    )
    diff = (tp_model(x) - want).abs().max().item()
    out["tp"] = (diff, compile_report(tp_model).graphs)
    # Wrong orders by hand: compile after sharding; a torch.compile wrapper inside.
    sharded = wrap_fsdp(ctx, TinyNet(), fsdp)
    try:
        compile_blocks(sharded, CHEAP)
    except ValueError as err:
        out["refused_after"] = str(err)
    ddp = wrap_model(ctx, TinyNet())
    try:
        apply_activation_checkpointing(ddp, ActivationCheckpointOptions())
    except ValueError as err:
        out["refused_ddp"] = str(err)
    inner: nn.Module = torch.compile(Block(8), backend="aot_eager")  # type: ignore[assignment]
    try:
        wrap_fsdp(ctx, nn.Sequential(inner), FSDPOptions())
    except ValueError as err:
        out["refused_wrapper"] = str(err)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_ranks(_two_rank_worker, 2, timeout_s=300, start_method="forkserver")


@pytest.mark.distributed
@pytest.mark.parametrize(
    "name", ["ddp", "ddp+compile", "fsdp", "fsdp+compile", "fsdp+ac+compile", "meta"]
)
def test_two_ranks_reach_the_one_process_parameters(
    two_ranks: list[dict[str, Any]], name: str
) -> None:
    want = reference(2)
    for result in two_ranks:
        _, params, report = result[name]
        for got, ref in zip(params, want, strict=True):
            # aot_eager runs the same kernels as eager: float64 agrees to
            # round-off of the all-reduce order (measured: below 1e-15).
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
        if "compile" in name or name == "meta":
            assert report.graphs == 2 and report.graph_breaks == 0
    assert two_ranks[0][name][1] and all(
        torch.equal(a, b)
        for a, b in zip(two_ranks[0][name][1], two_ranks[1][name][1], strict=True)
    )


@pytest.mark.distributed
def test_compiled_losses_equal_eager_losses_on_two_ranks(
    two_ranks: list[dict[str, Any]],
) -> None:
    for result in two_ranks:
        for eager, compiled in (("ddp", "ddp+compile"), ("fsdp", "fsdp+compile")):
            assert result[eager][0] == pytest.approx(result[compiled][0], abs=1e-12)
        # RowwiseParallel sums the two halves' products by an all-reduce.
        diff, graphs = result["tp"]
        assert diff < 1e-14 and graphs == 1


@pytest.mark.distributed
def test_wrong_orders_by_hand_are_refused_on_two_ranks(
    two_ranks: list[dict[str, Any]],
) -> None:
    for result in two_ranks:
        assert "already wrapped (FSDP2" in result["refused_after"]
        assert "is a torch.compile wrapper" in result["refused_wrapper"]
        assert "already wrapped (DistributedDataParallel)" in result["refused_ddp"]
