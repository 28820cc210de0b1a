"""Local SGD: parameters are averaged across ranks every ``local_sgd_steps`` steps."""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.local_sgd import LocalSGDCount
from funcaccel.local_sgd import LocalSGDState
from funcaccel.local_sgd import local_sgd_ctx
from funcaccel.local_sgd import local_sgd_step
from funcaccel.local_sgd import should_average
from funcaccel.model import wrap_model
from funcaccel.sync import no_sync
from funcaccel.testing import rank_ctx
from funcaccel.testing import run_ranks

Step = tuple[torch.Tensor, torch.Tensor]  # flat parameters before and after


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def _train(
    ctx: DistributedContext, k: int, steps: int, ddp: bool
) -> tuple[list[Step], int]:
    torch.manual_seed(0)  # the same start on every rank
    net = nn.Linear(2, 1)
    model = wrap_model(ctx, net) if ddp else net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = LocalSGDState(local_sgd_steps=k, count="optimizer_steps")
    grad = GradState(accumulation_steps=2)
    history: list[Step] = []
    window = no_sync(ctx, model) if ddp else contextlib.nullcontext()
    with window:  # a DDP model must not sync its gradients (Accelerate's LocalSGD)
        for step in range(2 * steps):  # 2 micro-batches per optimizer step
            x = torch.full((4, 2), float(ctx.process_index + 1) + step / 3)
            y = x.sum(dim=1, keepdim=True) * (ctx.process_index + 2)
            _, grad = accumulate_step(
                ctx, grad, model, opt, lambda: ((model(x) - y) ** 2).mean()
            )
            before = _flat(model)
            state = local_sgd_step(ctx, state, model, grad=grad)
            if grad.sync_gradients:
                history.append((before, _flat(model)))
    return history, state.steps


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "ddp"), [(2, False), (3, False), (2, True)], ids=str
)
def test_parameters_are_the_ranks_mean_every_k_steps_and_local_between(
    world_size: int, ddp: bool
) -> None:
    k, steps = 2, 5
    results = run_ranks(_train, world_size, k, steps, ddp, start_method="forkserver")
    assert [counted for _, counted in results] == [steps] * world_size
    for s in range(steps):
        befores = [history[s][0] for history, _ in results]
        afters = [history[s][1] for history, _ in results]
        if (s + 1) % k == 0:
            mean = torch.stack(befores).mean(dim=0)
            for after in afters:
                assert torch.equal(after, afters[0])  # bit for bit on every rank
                torch.testing.assert_close(after, mean)
        else:
            assert all(torch.equal(b, a) for b, a in zip(befores, afters, strict=True))
            assert not torch.equal(afters[0], afters[1])  # each rank its own


def test_local_sgd_step_counts_only_optimizer_steps_when_asked() -> None:
    ctx, model = rank_ctx(1, 0), nn.Linear(1, 1)
    state = LocalSGDState(local_sgd_steps=2, count="optimizer_steps")
    open_window = GradState(accumulation_steps=2, micro_step=1, sync_gradients=False)
    assert local_sgd_step(ctx, state, model, grad=open_window) is state
    after = local_sgd_step(ctx, state, model, grad=GradState())
    assert after == dataclasses.replace(state, steps=1) and state.steps == 0


def test_local_sgd_step_counts_every_call_by_default() -> None:
    ctx, model = rank_ctx(1, 0), nn.Linear(1, 1)
    state = LocalSGDState(local_sgd_steps=2)
    assert state.count == "micro_batches"  # Accelerate's LocalSGD.step()
    assert local_sgd_step(ctx, local_sgd_step(ctx, state, model), model).steps == 2


@pytest.mark.parametrize(
    ("count", "grad", "match"),
    [
        (
            "micro_batches",
            GradState(),
            r"local_sgd_step: grad must be None when state.count is 'micro_batches'"
            r".*count='optimizer_steps'",
        ),
        (
            "optimizer_steps",
            None,
            r"local_sgd_step: grad must be the GradState accumulate_step returned"
            r".*got None.*Pass grad=grad",
        ),
    ],
)
def test_local_sgd_step_refuses_a_grad_that_contradicts_the_counting(
    count: LocalSGDCount, grad: GradState | None, match: str
) -> None:
    state = LocalSGDState(local_sgd_steps=2, count=count)
    with pytest.raises(ValueError, match=match):
        local_sgd_step(rank_ctx(1, 0), state, nn.Linear(1, 1), grad=grad)


K, LOCAL_SGD_STEPS, MICRO_BATCHES = 2, 3, 8


def _batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(4, 3)
    x = x * (rank + 1) + i / 7
    return x, (x**2).sum(dim=1, keepdim=True) - rank


def _mse(model: nn.Module, rank: int, i: int) -> torch.Tensor:
    x, y = _batch(rank, i)
    loss: torch.Tensor = ((model(x) - y) ** 2).mean()
    return loss


def _accelerate_rule(
    net: nn.Module, rank: int, world_size: int, count: LocalSGDCount
) -> torch.Tensor:
    """Accelerate 1.15's LocalSGD loop, in plain PyTorch: local grads, own counter.

    ``LocalSGD.step()`` runs after every micro-batch of ``accelerator.accumulate``
    and counts it; every ``local_sgd_steps`` counts, and once more on leaving the
    ``with LocalSGD``, each parameter becomes ``all_reduce(sum) / world_size``.
    ``count="optimizer_steps"`` counts closed windows instead.
    """
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    def average() -> None:
        with torch.no_grad():
            for param in net.parameters():
                total = param.detach().clone()
                dist.all_reduce(total)
                param.copy_(total / world_size)

    counted = 0
    for i in range(MICRO_BATCHES):
        torch.autograd.backward(_mse(net, rank, i) / K)
        closes = (i + 1) % K == 0
        if closes:
            opt.step()
            opt.zero_grad()
        if count == "micro_batches" or closes:
            counted += 1
            if counted % LOCAL_SGD_STEPS == 0:
                average()
    average()
    return _flat(net)


def _local_sgd_against_reference(
    ctx: DistributedContext, count: LocalSGDCount
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = nn.Linear(3, 1).double()
    reference = _accelerate_rule(
        copy.deepcopy(net), ctx.process_index, ctx.num_processes, count
    )
    other: LocalSGDCount = (
        "optimizer_steps" if count == "micro_batches" else "micro_batches"
    )
    other_rule = _accelerate_rule(
        copy.deepcopy(net), ctx.process_index, ctx.num_processes, other
    )
    model = wrap_model(ctx, net)  # DDP: local_sgd_ctx must keep it from syncing
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = LocalSGDState(local_sgd_steps=LOCAL_SGD_STEPS, count=count)
    grad = GradState(accumulation_steps=K)
    with local_sgd_ctx(ctx, state, model):
        for i in range(MICRO_BATCHES):
            _, grad = accumulate_step(
                ctx, grad, model, opt, lambda: _mse(model, ctx.process_index, i)
            )
            by_steps = state.count == "optimizer_steps"
            state = local_sgd_step(ctx, state, model, grad=grad if by_steps else None)
    return _flat(model), reference, other_rule


@pytest.mark.distributed
@pytest.mark.parametrize("count", ["micro_batches", "optimizer_steps"])
def test_local_sgd_matches_accelerates_counting_or_the_chosen_one(
    count: LocalSGDCount,
) -> None:
    results = run_ranks(_local_sgd_against_reference, 2, count)
    for params, reference, other_rule in results:
        assert torch.equal(params, reference)
        assert not torch.allclose(params, other_rule)  # the counting matters here
    assert torch.equal(results[0][0], results[1][0])  # averaged on exit


def _disabled_trains_as_ddp(ctx: DistributedContext) -> tuple[bool, torch.Tensor]:
    torch.manual_seed(0)
    model = wrap_model(ctx, nn.Linear(3, 1).double())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = LocalSGDState(local_sgd_steps=1, enabled=False)
    grad = GradState(accumulation_steps=K)
    with local_sgd_ctx(ctx, state, model):  # a null context: gradients all-reduce
        syncs = bool(model.require_backward_grad_sync)
        for i in range(4):
            _, grad = accumulate_step(
                ctx, grad, model, opt, lambda: _mse(model, ctx.process_index, i)
            )
            state = local_sgd_step(ctx, state, model)
    return syncs, _flat(model)


@pytest.mark.distributed
def test_disabled_local_sgd_ctx_leaves_ddp_syncing() -> None:
    (syncs0, params0), (syncs1, params1) = run_ranks(_disabled_trains_as_ddp, 2)
    assert syncs0 and syncs1
    assert torch.equal(params0, params1)  # the same all-reduced updates


def test_local_sgd_ctx_checks_its_arguments() -> None:
    state = LocalSGDState(local_sgd_steps=2)
    with pytest.raises(TypeError, match=r"local_sgd_ctx: state must be"):
        local_sgd_ctx(rank_ctx(1, 0), 2, nn.Linear(1, 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"local_sgd_ctx: average_on_exit must be"):
        local_sgd_ctx(rank_ctx(1, 0), state, nn.Linear(1, 1), average_on_exit=1)  # type: ignore[arg-type]


def test_disabled_local_sgd_never_averages() -> None:
    state = LocalSGDState(local_sgd_steps=1, steps=4, enabled=False)
    assert not should_average(state)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"local_sgd_steps": 0}, ValueError, r"local_sgd_steps \(0\) must be >= 1"),
        ({"local_sgd_steps": 2, "steps": -1}, ValueError, r"steps \(-1\) must be >= 0"),
        ({"local_sgd_steps": 2.0}, TypeError, r"local_sgd_steps must be an int"),
        (
            {"local_sgd_steps": 2, "count": "steps"},
            ValueError,
            r"count must be one of 'micro_batches', 'optimizer_steps'; got 'steps'",
        ),
        (
            {"local_sgd_steps": 2, "enabled": 1},
            TypeError,
            r"enabled must be a bool; got 1 \(int\)",
        ),
    ],
)
def test_local_sgd_state_validates_its_fields(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        LocalSGDState(**kwargs)  # type: ignore[arg-type]
