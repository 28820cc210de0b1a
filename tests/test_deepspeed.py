"""DeepSpeed ZeRO through funcaccel's functions: options, windows, checkpoints.

The engine runs on CPU (``DS_ACCELERATOR=cpu``) with gloo; DeepSpeed's set-up takes
seconds, so the distributed cases share one spawned run per world size.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from funcaccel import DeepSpeedOptions
from funcaccel import GradState
from funcaccel import accumulate_step
from funcaccel import maybe_step_scheduler
from funcaccel import save_model
from funcaccel import unwrap_model
from funcaccel import wrap_model
from funcaccel.context import DistributedContext
from funcaccel.model._deepspeed_options import merged_config
from tests._dist import run_ranks
from tests.fixtures import rank_ctx

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

K = 3  # accumulation steps
MICRO = 7  # micro-steps per rank: windows of 3, 3 and a short 1
BATCH = 2  # samples per micro-batch per rank
DIM = 4


def _data(world: int, micro: int = MICRO) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(micro * world * BATCH, DIM, generator=gen)
    y = torch.randn(micro * world * BATCH, 2, generator=gen)
    return x, y


def _net() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 2))


def _batch(step: int, rank: int, world: int) -> slice:
    start = (step * world + rank) * BATCH
    return slice(start, start + BATCH)


def _reference(world: int, micro: int = MICRO) -> dict[str, torch.Tensor]:
    """One process: each window steps with the mean loss over its global samples."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    x, y = _data(world, micro)
    for first in range(0, micro, K):
        steps = range(first, min(first + K, micro))
        rows = torch.cat([torch.arange(micro * world * BATCH)[_batch(s, r, world)] for s in steps for r in range(world)])
        loss = nn.functional.mse_loss(net(x[rows]), y[rows])
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _train(
    ctx: DistributedContext,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    grad: GradState,
    steps: range,
    sched: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> GradState:
    x, y = _data(ctx.num_processes, len(steps) if steps.start == 0 else MICRO)
    last = steps.stop - 1 if steps.start == 0 else MICRO - 1
    for step in steps:
        rows = _batch(step, ctx.process_index, ctx.num_processes)
        _, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            lambda: nn.functional.mse_loss(model(x[rows]), y[rows]),
            end_of_dataloader=step == last,
        )
        if sched is not None:
            maybe_step_scheduler(ctx, sched, grad, split_batches=True)
    return grad


def _full_state(model: nn.Module, tmp: Path, ctx: DistributedContext) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    save_model(ctx, model, tmp)
    return load_file(str(tmp / "model.safetensors"))


def _ds_worker(ctx: DistributedContext, tmp: Path, micro: int = MICRO) -> dict[str, Any]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["LOCAL_RANK"] = str(ctx.local_process_index)
    warnings.simplefilter("ignore")  # DeepSpeed's own deprecation and log noise
    out: dict[str, Any] = {}
    # DDP through funcaccel.
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    ddp = wrap_model(ctx, net)
    _train(ctx, ddp, opt, GradState(accumulation_steps=K), range(micro))
    out["ddp"] = {k: v.detach().clone() for k, v in unwrap_model(ddp).state_dict().items()}
    for stage in (2, 3):
        net = _net()
        opt = torch.optim.Adam(net.parameters(), lr=0.05)
        grad = GradState(accumulation_steps=K)
        engine = wrap_model(ctx, net, deepspeed=DeepSpeedOptions(zero_stage=stage), optimizers=opt, grad=grad)
        grad = _train(ctx, engine, opt, grad, range(micro))
        out[f"zero{stage}"] = _full_state(engine, tmp / f"export{stage}", ctx)
        out[f"steps{stage}"] = grad.optimizer_steps
    return out


def _check_against_references(micro: int, tmp_path: Path) -> None:
    results = run_ranks(_ds_worker, 2, tmp_path, tmp_path, micro)
    reference = _reference(2, micro)
    for rank in results:
        for name in ("ddp", "zero2", "zero3"):
            assert rank[name].keys() == reference.keys(), name
            for key, value in reference.items():
                torch.testing.assert_close(rank[name][key], value, rtol=1e-6, atol=1e-7, msg=f"{name} {key}")
        assert rank["steps2"] == rank["steps3"] == -(-micro // K)


@pytest.mark.distributed
def test_zero2_and_zero3_full_windows_match_ddp_and_one_process(tmp_path: Path) -> None:
    _check_against_references(6, tmp_path)


@pytest.mark.distributed
def test_zero2_and_zero3_short_last_window_match_ddp(tmp_path: Path) -> None:
    _check_against_references(MICRO, tmp_path)


def test_config_conflict_names_both_values() -> None:
    options = DeepSpeedOptions(config={"gradient_accumulation_steps": 4})
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=4, but GradState.accumulation_steps is 2"):
        merged_config(rank_ctx(2, 0), options, GradState(accumulation_steps=2), caller="wrap_model")


def test_precision_conflict_names_both_values() -> None:
    options = DeepSpeedOptions(config={"bf16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"bf16.enabled=True, but ctx.mixed_precision is 'no'"):
        merged_config(rank_ctx(2, 0), options, GradState(), caller="wrap_model")


def test_options_field_disagreeing_with_config_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert DeepSpeedOptions(config=path).stage == 3
    with pytest.raises(ValueError, match=r"zero_stage=2 disagrees with the config's zero_optimization.stage=3"):
        DeepSpeedOptions(config=path, zero_stage=2)
    with pytest.raises(ValueError, match=r"must be 1, 2 or 3; got 0"):
        DeepSpeedOptions(zero_stage=0)
