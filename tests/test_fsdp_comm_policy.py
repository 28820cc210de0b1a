"""FSDPOptions.accumulation_comm: three ways for gradients to travel, one result.

One 4-rank run (HSDP 2x2: 2 replicas of 2 shards) trains the same model with
each policy, eager and with compiled blocks, and counts the collectives of each
window with torch's ``CommDebugMode``; the asserts compare the parameters with a
one-process float64 reference over the whole global batches.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.mesh import build_mesh
from funcaccel.model import CompileOptions
from funcaccel.model import FSDPOptions
from funcaccel.model import compile_report
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks
from tests._fast_step_models import Block
from tests._fast_step_models import TinyNet
from tests._fast_step_models import batches
from tests._fast_step_models import loss_of

F64 = torch.float64
K = 3
STEPS = 5  # windows of 3 and a short 2
ROWS = 2
POLICIES = ("defer_all", "reduce_scatter_each_step", "defer_replica_all_reduce")

pytestmark = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning"
)


def _comm_mode() -> CommDebugMode:
    return CommDebugMode()  # type: ignore[no-untyped-call]  # torch leaves it untyped


def _train(
    ctx: DistributedContext,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    data: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    count: bool = False,
) -> tuple[list[float], list[dict[str, int]]]:
    """Train; with ``count``, the collectives of each micro-step (eager only:
    CommDebugMode is a dispatch mode, which dynamo refuses to trace under)."""
    grad = GradState(accumulation_steps=K)
    losses, comms = [], []
    for i, batch in enumerate(data):
        with _comm_mode() if count else contextlib.nullcontext() as mode:
            loss, grad = accumulate_step(
                ctx,
                grad,
                model,
                opt,
                functools.partial(loss_of, model, batch),
                end_of_dataloader=i == len(data) - 1,
            )
        if isinstance(mode, CommDebugMode):
            counts = mode.get_comm_counts().items()
            comms.append({str(op).split(".")[-1]: n for op, n in counts})
        losses.append(loss.item())
    return losses, comms


def _worker(ctx: DistributedContext) -> dict[str, Any]:
    rank = ctx.process_index
    data = [
        (x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS])
        for x, y in batches(STEPS, ROWS * ctx.num_processes)
    ]
    mesh = build_mesh(ctx, dp_replicate=2, dp_shard=2)
    out: dict[str, Any] = {}
    for policy in POLICIES:
        # Compiled blocks with the default and the replica-deferring policy (the
        # three differ only outside the blocks).
        for compiled in (False, True)[: 1 + (policy != "reduce_scatter_each_step")]:
            torch.manual_seed(0)
            net = TinyNet().to(F64)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            fsdp = FSDPOptions(shard_modules=[Block], accumulation_comm=policy)  # type: ignore[arg-type]
            options = CompileOptions(blocks=[Block], backend="aot_eager")
            model = wrap_model(
                ctx,
                net,
                mesh=mesh,
                fsdp=fsdp,
                optimizers=opt,
                compile=options if compiled else None,
            )
            losses, comms = _train(ctx, model, opt, data, count=not compiled)
            params = [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
            out[f"{policy}{'+compile' if compiled else ''}"] = (
                losses,
                params,
                comms,
                compile_report(model).graph_breaks,
            )
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_ranks(_worker, 4, timeout_s=300, start_method="forkserver")


def _reference() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = TinyNet().to(F64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(DistributedContext(), model, opt, batches(STEPS, ROWS * 4))
    return [p.detach() for p in model.parameters()]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("policy", "compiled"),
    [(p, False) for p in POLICIES]
    + [("defer_all", True), ("defer_replica_all_reduce", True)],
)
def test_every_policy_reaches_the_one_process_parameters_on_hsdp(
    four_ranks: list[dict[str, Any]], policy: str, compiled: bool
) -> None:
    want = _reference()
    key = f"{policy}{'+compile' if compiled else ''}"
    for result in four_ranks:
        _, params, _, breaks = result[key]
        assert breaks == 0
        for got, ref in zip(params, want, strict=True):
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-13)
    # The policies differ only in summation order: losses agree to round-off.
    for result in four_ranks:
        assert result[key][0] == pytest.approx(result["defer_all"][0], abs=1e-13)


@pytest.mark.distributed
def test_each_policy_communicates_when_it_says(
    four_ranks: list[dict[str, Any]],
) -> None:
    comms = {policy: four_ranks[0][policy][2] for policy in POLICIES}
    units = 5  # 4 blocks and the root
    # defer_all: nothing while the window is open (micro-steps 1, 2 and 4).
    for step in (0, 1, 3):
        assert comms["defer_all"][step].get("allreduce_", 0) == 0
    # Every policy reduces each unit at the window's last micro-step: one
    # reduce-scatter (in place, as an all-reduce on gloo) and one all-reduce
    # across the replicas per unit.
    for policy in POLICIES:
        for step in (2, 4):
            assert comms[policy][step]["allreduce_"] == 2 * units
    # reduce_scatter_each_step: the same on every micro-step.
    for step in (0, 1, 3):
        assert comms["reduce_scatter_each_step"][step]["allreduce_"] == 2 * units
    # defer_replica_all_reduce: the reduce-scatter only while the window is open.
    for step in (0, 1, 3):
        assert comms["defer_replica_all_reduce"][step]["allreduce_"] == units


def test_accumulation_comm_is_checked() -> None:
    with pytest.raises(
        ValueError, match=r"accumulation_comm must be one of 'defer_all'"
    ):
        FSDPOptions(accumulation_comm="never")  # type: ignore[arg-type]
    assert FSDPOptions().accumulation_comm == "defer_all"
