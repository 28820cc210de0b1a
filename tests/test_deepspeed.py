"""DeepSpeed ZeRO through funcaccel's functions: options, windows, checkpoints.

The engine runs on CPU (``DS_ACCELERATOR=cpu``) with gloo; DeepSpeed's set-up takes
seconds, so every distributed check shares one spawned run of 2 processes.
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
from funcaccel import clip_grad_norm_
from funcaccel import latest_checkpoint
from funcaccel import load_checkpoint
from funcaccel import maybe_step_scheduler
from funcaccel import read_checkpoint_meta
from funcaccel import save_checkpoint
from funcaccel import save_model
from funcaccel import unwrap_model
from funcaccel import wrap_model
from funcaccel.checkpoint._deepspeed_state import check_engine_format
from funcaccel.context import DistributedContext
from funcaccel.model._deepspeed_options import merged_config
from funcaccel.testing import run_ranks
from tests.fixtures import rank_ctx

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

K = 3  # accumulation steps
MICRO = 7  # micro-steps per rank: windows of 3, 3 and a short 1
BATCH = 2  # samples per micro-batch per rank
DIM = 4
LR = 0.05


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(MICRO * world * BATCH, DIM, generator=gen)
    y = torch.randn(MICRO * world * BATCH, 2, generator=gen)
    return x, y


def _net(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 2))


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


def _batch(step: int, rank: int, world: int) -> slice:
    start = (step * world + rank) * BATCH
    return slice(start, start + BATCH)


def _reference(world: int) -> dict[str, torch.Tensor]:
    """One process: each window steps with the mean loss over its global samples."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    sched = _schedule(opt)
    x, y = _data(world)
    for first in range(0, MICRO, K):
        steps = range(first, min(first + K, MICRO))
        rows = torch.cat(
            [
                torch.arange(MICRO * world * BATCH)[_batch(s, r, world)]
                for s in steps
                for r in range(world)
            ]
        )
        loss = nn.functional.mse_loss(net(x[rows]), y[rows])
        torch.autograd.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _train(
    ctx: DistributedContext,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    grad: GradState,
    steps: range,
) -> GradState:
    x, y = _data(ctx.num_processes)
    for step in steps:
        rows = _batch(step, ctx.process_index, ctx.num_processes)
        _, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            lambda: nn.functional.mse_loss(model(x[rows]), y[rows]),
            end_of_dataloader=step == MICRO - 1,
        )
        maybe_step_scheduler(ctx, sched, grad, schedule_counts="updates")
    return grad


def _items_mask(world: int) -> torch.Tensor:
    """Which rows count (token-weighted windows): a different number per micro-batch."""
    rows = torch.arange(MICRO * world * BATCH)
    return ((rows % 3 != 0) | (rows % 7 == 0)).to(torch.float32)


def _items_reference(world: int) -> dict[str, torch.Tensor]:
    """One process: each window steps with its summed loss over its counted items."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    x, y = _data(world)
    mask = _items_mask(world)
    for first in range(0, MICRO, K):
        steps = range(first, min(first + K, MICRO))
        rows = torch.cat(
            [
                torch.arange(MICRO * world * BATCH)[_batch(s, r, world)]
                for s in steps
                for r in range(world)
            ]
        )
        errors = (net(x[rows]) - y[rows]) ** 2 * mask[rows, None]
        items = mask[rows].sum() * 2
        torch.autograd.backward(errors.sum() / items)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _train_items(
    ctx: DistributedContext,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    grad: GradState,
) -> GradState:
    x, y = _data(ctx.num_processes)
    mask = _items_mask(ctx.num_processes)
    for step in range(MICRO):
        rows = _batch(step, ctx.process_index, ctx.num_processes)
        m = mask[rows]
        _, grad = accumulate_step(
            ctx,
            grad,
            model,
            opt,
            lambda: ((model(x[rows]) - y[rows]) ** 2 * m[:, None]).sum(),
            end_of_dataloader=step == MICRO - 1,
            num_items=int(m.sum().item()) * 2,
        )
    return grad


def _full_state(
    model: nn.Module, tmp: Path, ctx: DistributedContext
) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    save_model(ctx, model, tmp)
    return load_file(str(tmp / "model.safetensors"))


def _engine(
    ctx: DistributedContext, stage: int, seed: int = 1
) -> tuple[
    nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, GradState
]:
    net = _net(seed)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    sched = _schedule(opt)
    grad = GradState(accumulation_steps=K)
    # ZeRO-3 would keep parameters this small whole on every rank; partition all.
    config = (
        {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
        if stage == 3
        else None
    )
    options = DeepSpeedOptions(config=config, zero_stage=stage)
    engine = wrap_model(
        ctx, net, deepspeed=options, optimizers=opt, scheduler=sched, grad=grad
    )
    return engine, opt, sched, grad


def _refused(call: Any) -> str:
    try:
        call()
    except ValueError as error:
        return str(error)
    return "not refused"


def _ds_worker(ctx: DistributedContext, tmp: Path) -> dict[str, Any]:
    """Every distributed check in one spawned run (DeepSpeed's set-up is slow)."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["LOCAL_RANK"] = str(ctx.local_process_index)
    warnings.simplefilter("ignore")  # DeepSpeed's own deprecation and log noise
    out: dict[str, Any] = {}
    # DDP through funcaccel.
    net = _net()
    opt: torch.optim.Optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    ddp = wrap_model(ctx, net)
    _train(ctx, ddp, opt, _schedule(opt), GradState(accumulation_steps=K), range(MICRO))
    out["ddp"] = {
        k: v.detach().clone() for k, v in unwrap_model(ddp).state_dict().items()
    }
    for stage in (2, 3):
        engine, opt, sched, grad = _engine(ctx, stage)
        grad = _train(ctx, engine, opt, sched, grad, range(MICRO))
        out[f"zero{stage}"] = _full_state(engine, tmp / f"export{stage}", ctx)
        out[f"steps{stage}"] = grad.optimizer_steps
        out[f"local{stage}"] = sum(p.numel() for p in unwrap_model(engine).parameters())
        out[f"clip{stage}"] = _refused(
            lambda: clip_grad_norm_(engine.parameters(), 1.0)
        )
        if stage == 2:
            out["with_optimizer"] = _refused(
                lambda: save_checkpoint(
                    ctx, tmp / "refused", models=engine, optimizers=opt
                )
            )
    # Token-weighted windows (num_items): funcaccel's DDP and ZeRO-2.
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    ddp = wrap_model(ctx, net)
    _train_items(ctx, ddp, opt, GradState(accumulation_steps=K))
    out["ddp_items"] = {
        k: v.detach().clone() for k, v in unwrap_model(ddp).state_dict().items()
    }
    engine, opt, _, grad = _engine(ctx, 2)
    grad = _train_items(ctx, engine, opt, grad)
    out["zero2_items"] = _full_state(engine, tmp / "export_items", ctx)
    out["steps_items"] = grad.optimizer_steps
    # Stop after the first window, resume in a fresh engine (other initial
    # weights), finish: the same bits as the unbroken runs above.
    for stage in (2, 3):
        engine, opt, sched, grad = _engine(ctx, stage)
        grad = _train(ctx, engine, opt, sched, grad, range(K))
        run = tmp / f"run{stage}"
        saved = save_checkpoint(ctx, run, models=engine, grad=grad)
        out[f"saved_files{stage}"] = sorted(read_checkpoint_meta(saved).files)
        engine, opt, sched, _ = _engine(ctx, stage, seed=5)
        loaded = load_checkpoint(ctx, latest_checkpoint(run) or saved, models=engine)
        assert loaded.grad is not None
        grad = _train(ctx, engine, opt, sched, loaded.grad, range(K, MICRO))
        out[f"resumed{stage}"] = _full_state(
            engine, tmp / f"export_resumed{stage}", ctx
        )
        out[f"resumed_steps{stage}"] = grad.optimizer_steps
        out[f"resumed_lr{stage}"] = sched.get_last_lr()
    return out


@pytest.mark.distributed
def test_zero_stages_on_two_ranks(tmp_path: Path) -> None:
    """ZeRO-2 and ZeRO-3 over windows of 3, 3 and a short 1 equal DDP and one
    process; ZeRO-3's export is the full model; a stop and resume ends bit for bit
    like the unbroken run; clip_grad_norm_ on an engine's parameters is refused."""
    results = run_ranks(_ds_worker, 2, tmp_path, start_method="forkserver")
    reference = _reference(2)
    for rank in results:
        for name in ("ddp", "zero2", "zero3"):
            assert rank[name].keys() == reference.keys(), name
            for key, value in reference.items():
                torch.testing.assert_close(
                    rank[name][key], value, rtol=1e-6, atol=1e-7, msg=f"{name} {key}"
                )
        assert rank["steps2"] == rank["steps3"] == 3
        assert rank["local2"] == 58 and rank["local3"] == 0  # ZeRO-3 partitioned them
        for stage in (2, 3):
            assert "Pass max_grad_norm=1.0 to accumulate_step" in rank[f"clip{stage}"]
            for key, value in rank[f"zero{stage}"].items():
                assert torch.equal(rank[f"resumed{stage}"][key], value), (stage, key)
            assert rank[f"resumed_steps{stage}"] == 3
            assert rank[f"resumed_lr{stage}"] == [LR * 0.5**3]
            assert any(
                name.startswith("deepspeed/state/")
                for name in rank[f"saved_files{stage}"]
            )
        assert "pass optimizers=() with it" in rank["with_optimizer"]
        items_reference = _items_reference(2)
        assert rank["steps_items"] == 3
        for name in ("ddp_items", "zero2_items"):
            for key, value in items_reference.items():
                torch.testing.assert_close(
                    rank[name][key], value, rtol=1e-6, atol=1e-7, msg=f"{name} {key}"
                )
    # The ZeRO-3 export loads into the plain model, every parameter whole.
    plain = _net(seed=7)
    plain.load_state_dict(results[0]["zero3"], strict=True)
    for key, value in reference.items():
        torch.testing.assert_close(plain.state_dict()[key], value, rtol=1e-6, atol=1e-7)


def test_engine_checkpoint_format_mismatch_is_refused(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"holds a DeepSpeed engine's checkpoint; pass the engine"
    ):
        check_engine_format(
            "deepspeed", 2, [nn.Linear(1, 1)], 2, tmp_path, "load_checkpoint"
        )
    check_engine_format("torch", 2, [nn.Linear(1, 1)], 2, tmp_path, "load_checkpoint")


def test_config_conflict_names_both_values() -> None:
    options = DeepSpeedOptions(config={"gradient_accumulation_steps": 4})
    with pytest.raises(
        ValueError,
        match=r"gradient_accumulation_steps=4, but GradState.accumulation_steps is 2",
    ):
        merged_config(
            "wrap_model", rank_ctx(2, 0), options, GradState(accumulation_steps=2)
        )


def test_precision_conflict_names_both_values() -> None:
    options = DeepSpeedOptions(config={"bf16": {"enabled": True}})
    with pytest.raises(
        ValueError, match=r"bf16.enabled=True, but ctx.mixed_precision is 'no'"
    ):
        merged_config("wrap_model", rank_ctx(2, 0), options, GradState())


def test_options_field_disagreeing_with_config_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert DeepSpeedOptions(config=path).stage == 3
    with pytest.raises(
        ValueError,
        match=r"zero_stage=2 disagrees with the config's zero_optimization.stage=3",
    ):
        DeepSpeedOptions(config=path, zero_stage=2)
    with pytest.raises(
        ValueError,
        match=r"^DeepSpeedOptions: the ZeRO stage must be one of 1, 2, 3; got 0\. For "
        r"replicated training without ZeRO use wrap_model's DDP path",
    ):
        DeepSpeedOptions(zero_stage=0)
