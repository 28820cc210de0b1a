"""The strategy functions wrap_model composes, called on their own.

``wrap_ddp``, ``wrap_fsdp``, ``wrap_mesh``, ``wrap_deepspeed`` and
``materialize_meta`` each do one way of wrapping: on real ranks they give what
``wrap_model`` gives for the same arguments, and their errors name themselves.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel

from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import build_mesh
from funcaccel.model import DeepSpeedOptions
from funcaccel.model import FSDPOptions
from funcaccel.model import materialize_meta
from funcaccel.model import wrap_ddp
from funcaccel.model import wrap_deepspeed
from funcaccel.model import wrap_fsdp
from funcaccel.model import wrap_mesh
from funcaccel.model import wrap_model
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks

ONE = DistributedContext()
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _bad(value: object) -> Any:
    """``value``, typed so that a test can pass what the signature refuses."""
    return value


def _net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _seeded(meta: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    if not meta:
        return _net()
    with torch.device("meta"):
        return _net()


def _local(model: nn.Module) -> list[torch.Tensor]:
    return [
        (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


def _holds_model(optimizer: torch.optim.Optimizer, model: nn.Module) -> bool:
    params = list(model.parameters())
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return len(held) == len(params) and all(any(p is q for q in params) for p in held)


def _ddp_grads(ctx: DistributedContext, use_model: bool) -> tuple[str, torch.Tensor]:
    net = _seeded()
    kwargs = DistributedDataParallelKwargs(comm_hook="fp16")
    wrapped = wrap_model(ctx, net, kwargs) if use_model else wrap_ddp(ctx, net, kwargs)
    torch.manual_seed(1 + ctx.process_index)  # different data per rank
    wrapped(torch.randn(3, 4)).sum().backward()
    first = net[0]
    assert isinstance(first, nn.Linear)
    grad = first.weight.grad
    assert grad is not None
    return type(wrapped).__name__, grad.clone()


def _sharded(
    ctx: DistributedContext, use_model: bool, meta: bool
) -> tuple[list[torch.Tensor], bool]:
    net = _seeded(meta)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if use_model:
        model = wrap_model(ctx, net, fsdp=FSDPOptions(), optimizers=opt)
    else:
        model = wrap_fsdp(ctx, net, optimizers=opt)
        model = materialize_meta(ctx, model, optimizers=opt)
    return _local(model), _holds_model(opt, model)


def _on_mesh(
    ctx: DistributedContext, use_model: bool, mesh: ParallelMesh
) -> list[torch.Tensor]:
    net = _seeded()
    if use_model:
        return _local(wrap_model(ctx, net, mesh=mesh, tp_plan=PLAN))
    return _local(wrap_mesh(ctx, net, mesh, tp_plan=PLAN))


def _init_saw_shards(ctx: DistributedContext) -> list[bool]:
    """Whether each module ``init_fn`` initialised was already an FSDP unit."""
    seen: list[bool] = []

    def init(module: nn.Module) -> None:
        seen.append(isinstance(module, FSDPModule))
        module.reset_parameters()  # type: ignore[operator]

    fsdp = FSDPOptions(shard_modules=(nn.Linear,))
    wrap_model(ctx, _seeded(meta=True), fsdp=fsdp, init_fn=init)
    return seen


def _refused(call: Any) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "not refused"


def _worker(ctx: DistributedContext) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for label, use_model in (("strategy", False), ("wrap_model", True)):
        out[f"ddp_{label}"] = _ddp_grads(ctx, use_model)
        for meta in (False, True):
            out[f"fsdp_{label}_{meta}"] = _sharded(ctx, use_model, meta)
    out["init_saw_shards"] = _init_saw_shards(ctx)
    tp = build_mesh(ctx, dp_shard=1, tp=2)
    out["mesh_strategy"] = _on_mesh(ctx, False, tp)
    out["mesh_wrap_model"] = _on_mesh(ctx, True, tp)
    replicate = build_mesh(ctx, dp_replicate=2, dp_shard=1)
    out["mesh_meta_ddp"] = _refused(lambda: wrap_mesh(ctx, _seeded(True), replicate))
    out["ddp_meta"] = _refused(lambda: wrap_ddp(ctx, _seeded(True)))
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, start_method="forkserver")


@pytest.mark.distributed
def test_wrap_ddp_equals_wrap_model_on_two_ranks(results: list[dict[str, Any]]) -> None:
    for rank in results:
        kind, grad = rank["ddp_strategy"]
        assert kind == rank["ddp_wrap_model"][0] == "DistributedDataParallel"
        torch.testing.assert_close(grad, rank["ddp_wrap_model"][1], rtol=0, atol=0)
    # fp16-compressed all-reduce: both ranks hold the same mean gradient.
    torch.testing.assert_close(
        results[0]["ddp_strategy"][1], results[1]["ddp_strategy"][1], rtol=0, atol=0
    )


@pytest.mark.distributed
@pytest.mark.parametrize("meta", [False, True])
def test_wrap_fsdp_then_materialize_meta_equals_wrap_model(
    results: list[dict[str, Any]], meta: bool
) -> None:
    whole = _local(_seeded())
    for index, rank in enumerate(results):
        shards, rebound = rank[f"fsdp_strategy_{meta}"]
        expected, model_rebound = rank[f"fsdp_wrap_model_{meta}"]
        assert rebound and model_rebound  # the optimizer holds the new parameters
        for got, want, full in zip(shards, expected, whole, strict=True):
            assert torch.equal(got, want)
            # FSDP2 splits dim 0 in halves: rank 0 the first, rank 1 the second.
            assert torch.equal(got, full.chunk(2)[index])


@pytest.mark.distributed
def test_wrap_mesh_equals_wrap_model_with_tensor_parallelism(
    results: list[dict[str, Any]],
) -> None:
    for rank in results:
        for got, want in zip(
            rank["mesh_strategy"], rank["mesh_wrap_model"], strict=True
        ):
            assert torch.equal(got, want)
    up_rows = [rank["mesh_strategy"][0].shape[0] for rank in results]
    assert up_rows == [4, 4]  # ColwiseParallel: each rank 4 of the 8 rows


@pytest.mark.distributed
def test_ddp_strategies_refuse_a_meta_model(results: list[dict[str, Any]]) -> None:
    for rank in results:
        assert rank["ddp_meta"].startswith(
            "wrap_ddp: model must be a module on a real device: DDP broadcasts its "
            "parameters; got Sequential("
        )
        assert rank["ddp_meta"].endswith("materialize_meta(ctx, model).")
        assert rank["mesh_meta_ddp"].startswith("wrap_mesh: model must be a module")


@pytest.mark.distributed
def test_wrap_model_materialises_a_meta_model_after_sharding_it(
    results: list[dict[str, Any]],
) -> None:
    # Several ranks: the Linear units are FSDP2 shards when initialised (only
    # this rank's part gets storage); one process: nothing shards, so before.
    for rank in results:
        assert rank["init_saw_shards"] == [True, True]
    assert _init_saw_shards(ONE) == [False, False]


def test_materialize_meta_then_wrap_ddp_on_one_process() -> None:
    with pytest.raises(
        ValueError, match=r"^wrap_ddp: model must be a module on a real"
    ):
        wrap_ddp(ONE, _seeded(meta=True))
    net = _seeded(meta=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert materialize_meta(ONE, net, optimizers=opt) is net
    assert wrap_ddp(ONE, net) is net
    whole = _local(_seeded())
    assert all(torch.equal(a, b) for a, b in zip(_local(net), whole, strict=True))
    assert _holds_model(opt, net)
    assert materialize_meta(ONE, net) is net  # nothing on meta: nothing changes


def test_one_process_strategies_return_the_module() -> None:
    net = _net()
    assert wrap_fsdp(ONE, net) is net
    assert wrap_mesh(ONE, net, ParallelMesh()) is net
    assert wrap_ddp(ONE, net) is net


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (
            lambda: wrap_ddp(ONE, _bad({"w": 1})),
            r"^wrap_ddp: model must be a torch.nn.Module; got \{'w': 1\} \(dict\)",
        ),
        (
            lambda: wrap_ddp(ONE, _net(), _bad({"dim": 1})),
            r"^wrap_ddp: ddp_kwargs must be a DistributedDataParallelKwargs or None",
        ),
        (
            lambda: wrap_fsdp(ONE, _net(), _bad(True)),
            r"^wrap_fsdp: fsdp must be an FSDPOptions or None; got True \(bool\)",
        ),
        (
            lambda: wrap_fsdp(ONE, _net(), optimizers=_bad([3])),
            r"^wrap_fsdp: every item of optimizers must be an Optimizer; got 3",
        ),
        (
            lambda: wrap_mesh(_bad("ctx"), _net(), ParallelMesh()),
            r"^wrap_mesh: ctx must be a DistributedContext; got 'ctx'",
        ),
        (
            lambda: wrap_mesh(ONE, _net(), _bad((1, 1, 1))),
            r"^wrap_mesh: mesh must be a ParallelMesh \(from build_mesh\) or None",
        ),
        (
            lambda: materialize_meta(ONE, _net(), init_fn=_bad(3)),
            r"^materialize_meta: init_fn must be a function of one module or None",
        ),
        (
            lambda: wrap_deepspeed(ONE, _net(), _bad(3), optimizer=_optimizer()),
            r"^wrap_deepspeed: deepspeed must be a DeepSpeedOptions or None; got 3",
        ),
        (
            lambda: wrap_deepspeed(ONE, _net(), optimizer=_optimizer(), grad=_bad(3)),
            r"^wrap_deepspeed: grad must be the run's GradState or None; got 3 \(int\)",
        ),
    ],
)
def test_strategy_functions_name_themselves_in_type_errors(
    call: Any, match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        call()


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(_net().parameters(), lr=0.1)


def test_wrap_deepspeed_refuses_a_missing_optimizer() -> None:
    net = _net()
    for given in (None, [_optimizer()]):
        with pytest.raises(
            TypeError,
            match=r"^wrap_deepspeed: optimizer must be a torch.optim.Optimizer; got .*"
            r"Pass the one optimizer built on model.parameters\(\)\.$",
        ):
            wrap_deepspeed(ONE, net, optimizer=_bad(given))


def test_wrap_deepspeed_needs_a_process_group_before_importing_deepspeed() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(
        RuntimeError,
        match=r"^wrap_deepspeed: a DeepSpeed engine needs a torch.distributed process "
        r"group \(even with one process\)",
    ):
        wrap_deepspeed(ONE, net, DeepSpeedOptions(zero_stage=3), optimizer=opt)
    with pytest.raises(
        ValueError,
        match=r"^wrap_deepspeed: grad.sync_each_batch must be False for a DeepSpeed ",
    ):
        wrap_deepspeed(ONE, net, optimizer=opt, grad=GradState(sync_each_batch=True))


def test_wrap_mesh_names_itself_in_plan_errors() -> None:
    tp = ParallelMesh.for_rank(0, tp=2)
    with pytest.raises(ValueError, match=r"^wrap_mesh: tp_plan must be a mapping"):
        wrap_mesh(rank_ctx(2, 0), _net(), tp)
    with pytest.raises(ValueError, match=r"^wrap_mesh: fsdp must be an FSDPOptions"):
        wrap_mesh(rank_ctx(2, 0), _net(), ParallelMesh.for_rank(0, dp_shard=2))


def test_wrap_model_refuses_a_tp_plan_with_deepspeed() -> None:
    with pytest.raises(
        ValueError,
        match=r"^wrap_model: tp_plan must be None with deepspeed= .*Pass one of them",
    ):
        wrap_model(ONE, _net(), deepspeed=DeepSpeedOptions(), tp_plan=PLAN)
