"""Resuming with another accumulation: ``load_checkpoint(..., accumulation_steps=)``.

The same accumulation resumes as before; another one at a window boundary (where
every checkpoint ``save_checkpoint`` writes is) starts its first window at the
resume point; another one inside an open window is refused. The nanoGPT case: 2
ranks with windows of 2 resumed on 1 process with windows of 4 keep the global
batch and end where the 2-rank run ends (float64).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from funcaccel.accumulate import GradState
from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import read_checkpoint_meta
from funcaccel.checkpoint import save_checkpoint
from funcaccel.context import DistributedContext
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks

ONE = DistributedContext()
SAMPLES = 32
EPOCHS = 2
SAVE_AT = 3
Batch = tuple[torch.Tensor, torch.Tensor]


def _data() -> TensorDataset:
    x = torch.linspace(-1, 1, SAMPLES * 3, dtype=torch.float64).reshape(SAMPLES, 3)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    out: torch.Tensor = model(x)
    return (out - y).square().mean()


def _train(
    ctx: DistributedContext,
    root: Path,
    *,
    window: int,
    resume: Path | None = None,
    accumulation_steps: int | None = None,
) -> dict[str, Any]:
    """Train ``EPOCHS`` epochs (batch 2 per rank), saving after ``SAVE_AT`` steps."""
    torch.set_num_threads(1)
    model = wrap_model(ctx, _net(0 if resume is None else 9))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loader = shard_loader(ctx, DataLoader(_data(), batch_size=2, shuffle=True), seed=3)
    grad, state = GradState(accumulation_steps=window), LoaderState()
    if resume is not None:
        loaded = load_checkpoint(
            ctx,
            resume,
            models=model,
            optimizers=opt,
            accumulation_steps=accumulation_steps,
        )
        assert loaded.grad is not None and loaded.loader is not None
        grad, state = loaded.grad, loaded.loader
    path = None
    while state.epoch < EPOCHS:
        for batch in iter_batches(loader, state):
            loss_fn = functools.partial(_loss, model, batch.data)
            _, grad = accumulate_step(
                ctx, grad, model, opt, loss_fn, end_of_dataloader=batch.is_last
            )
            state = batch.state
            if (
                resume is None
                and grad.sync_gradients
                and grad.optimizer_steps == SAVE_AT
            ):
                path = save_checkpoint(
                    ctx, root, models=model, optimizers=opt, grad=grad, loader=state
                )
    params = [p.detach().clone() for p in unwrap_model(model).parameters()]
    return {"params": params, "grad": grad, "path": path}


@pytest.mark.distributed
def test_two_ranks_resumed_on_one_with_the_global_batch_kept_end_alike(
    tmp_path: Path,
) -> None:
    # 2 ranks x windows of 2 x batch 2 = 8 samples per step, 4 steps per epoch.
    train = functools.partial(_train, window=2)
    two = run_ranks(train, 2, tmp_path, start_method="forkserver")
    path = two[0]["path"]
    assert path is not None and two[0]["grad"].optimizer_steps == 8
    # nanoGPT's rescaling: 1 process, windows of 4 x batch 2 = 8 samples per step.
    one = _train(ONE, tmp_path, window=4, resume=path, accumulation_steps=4)
    assert one["grad"] == GradState(
        accumulation_steps=4, optimizer_steps=8, end_of_dataloader=True
    )
    for ours, theirs in zip(one["params"], two[0]["params"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    # Left out, the saved windows of 2 go on: 4 samples per step, twice the steps.
    kept = _train(ONE, tmp_path, window=4, resume=path)
    assert kept["grad"].accumulation_steps == 2
    assert kept["grad"].optimizer_steps == SAVE_AT + 10


def _plain_run(windows: list[int]) -> list[torch.Tensor]:
    """The reference: plain torch on the loader's batch order, windows of the sizes given."""
    loader = shard_loader(ONE, DataLoader(_data(), batch_size=2, shuffle=True), seed=3)
    batches = [
        b.data
        for epoch in range(EPOCHS)
        for b in iter_batches(loader, LoaderState(epoch=epoch))
    ]
    model = _net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    start = 0
    for size in windows:
        window = batches[start : start + size]
        loss: torch.Tensor = torch.stack([_loss(model, b) for b in window]).mean()
        torch.autograd.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        start += size
    assert start == len(batches)
    return [p.detach() for p in model.parameters()]


def test_another_accumulation_at_a_window_boundary_starts_at_the_resume_point(
    tmp_path: Path,
) -> None:
    # 16 batches per epoch. Windows of 2 up to the save after step 3 (6 batches),
    # then windows of 4 to the end of epoch 0 (4, 4 and a short one of 2), then
    # epoch 1 in windows of 4.
    saved = _train(ONE, tmp_path, window=2)
    same = _train(ONE, tmp_path, window=2, resume=saved["path"], accumulation_steps=2)
    assert same["grad"] == saved["grad"]
    assert all(
        torch.equal(a, b) for a, b in zip(same["params"], saved["params"], strict=True)
    )
    other = _train(ONE, tmp_path, window=2, resume=saved["path"], accumulation_steps=4)
    assert other["grad"].accumulation_steps == 4
    assert other["grad"].optimizer_steps == SAVE_AT + 3 + 4
    expected = _plain_run([2, 2, 2, 4, 4, 2, 4, 4, 4, 4])
    for ours, theirs in zip(other["params"], expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def _open_window(path: Path) -> None:
    """Make the saved GradState one inside a window (which no save writes)."""
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["grad"].update(micro_step=1, sync_gradients=False)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_another_accumulation_inside_an_open_window_is_refused(tmp_path: Path) -> None:
    grad = GradState(accumulation_steps=2, optimizer_steps=5)
    path = save_checkpoint(ONE, tmp_path, grad=grad)
    assert load_checkpoint(ONE, path).grad == grad
    assert load_checkpoint(ONE, path, accumulation_steps=2).grad == grad
    changed = load_checkpoint(ONE, path, accumulation_steps=6).grad
    assert changed == GradState(accumulation_steps=6, optimizer_steps=5)
    assert read_checkpoint_meta(path).grad == grad  # the checkpoint is unchanged
    _open_window(path)
    opened = GradState(
        accumulation_steps=2, micro_step=1, sync_gradients=False, optimizer_steps=5
    )
    assert load_checkpoint(ONE, path, accumulation_steps=2).grad == opened
    with pytest.raises(
        ValueError,
        match=(
            r"^load_checkpoint: .* holds a GradState inside an accumulation window "
            r"\(micro_step=1 of accumulation_steps=2\), so accumulation_steps=6 cannot "
            r"take over: .* Pass accumulation_steps=2, or resume from a checkpoint "
            r"saved at a window boundary"
        ),
    ):
        load_checkpoint(ONE, path, accumulation_steps=6)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0, ValueError, r"accumulation_steps \(0\) must be >= 1"),
        ("4", TypeError, r"accumulation_steps must be an int; got '4' \(str\)"),
        (True, TypeError, r"accumulation_steps must be an int; got True \(bool\)"),
    ],
)
def test_load_rejects_a_bad_accumulation_steps(
    tmp_path: Path, value: object, error: type[Exception], match: str
) -> None:
    path = save_checkpoint(ONE, tmp_path, grad=GradState(accumulation_steps=2))
    kwargs: dict[str, Any] = {"accumulation_steps": value}
    with pytest.raises(error, match=r"^load_checkpoint: " + match):
        load_checkpoint(ONE, path, **kwargs)


def test_a_checkpoint_without_a_grad_state_ignores_the_accumulation(
    tmp_path: Path,
) -> None:
    path = save_checkpoint(ONE, tmp_path)
    assert load_checkpoint(ONE, path, accumulation_steps=4).grad is None
