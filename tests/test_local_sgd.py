"""Local SGD: parameters are averaged across ranks every ``local_sgd_steps`` steps."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from funcaccel.accumulate import accumulate_step
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.local_sgd import LocalSGDState
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
    state = LocalSGDState(local_sgd_steps=k)
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


def test_local_sgd_step_counts_only_optimizer_steps() -> None:
    ctx, model = rank_ctx(1, 0), nn.Linear(1, 1)
    state = LocalSGDState(local_sgd_steps=2)
    open_window = GradState(accumulation_steps=2, micro_step=1, sync_gradients=False)
    assert local_sgd_step(ctx, state, model, grad=open_window) is state
    after = local_sgd_step(ctx, state, model, grad=GradState())
    assert after == LocalSGDState(local_sgd_steps=2, steps=1) and state.steps == 0


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
