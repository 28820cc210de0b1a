"""Checkpoints and exports of models wrapped on a mesh, resumed on other mesh shapes.

A float64 MLP trains over 2 epochs of 5 global batches with windows of 2 (so each
epoch ends with a short window of 1) and Adam. Each 2x2 run (HSDP, FSDP x TP,
DDP x TP on 4 gloo processes) trains without a break while saving a checkpoint
after its second optimizer step; that checkpoint is then resumed on 4x1 meshes
(FSDP2 over 4 ranks, DDP), on 1x2 (tensor parallelism only, 2 processes) and on
one process, and every resumed run must end where the unbroken one did (within
1e-10: the meshes reduce in different orders). A tensor-parallel-only run on 2
processes saves a sharded checkpoint too, which one process resumes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from funcaccel.accumulate import accumulate_step
from funcaccel.checkpoint import load_checkpoint
from funcaccel.checkpoint import load_model
from funcaccel.checkpoint import read_checkpoint_meta
from funcaccel.checkpoint import save_checkpoint
from funcaccel.checkpoint import save_model
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import build_mesh
from funcaccel.model import FSDPOptions
from funcaccel.model import unwrap_model
from funcaccel.model import wrap_model
from tests._dist import run_ranks
from tests.fixtures import TpMLP

SAMPLES, GLOBAL_BATCH, K, EPOCHS, SAVE_AT = 40, 8, 2, 2, 2
# (dp_replicate, dp_shard, tp, fsdp)
SAVED_ON = {
    "hsdp": (2, 2, 1, True),
    "fsdp_x_tp": (1, 2, 2, True),
    "ddp_x_tp": (2, 1, 2, False),
}
RESUMED_ON_4 = {"fsdp_4x1": (1, 4, 1, True), "ddp_4x1": (4, 1, 1, False)}
RESUMED_ON_2 = {"tp_1x2": (1, 1, 2, False)}


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(SAMPLES, 3, generator=generator, dtype=torch.float64)
    return TensorDataset(x, y)


def _wrapped(
    ctx: DistributedContext, shape: tuple[int, int, int, bool]
) -> tuple[nn.Module, torch.optim.Optimizer, ParallelMesh | None]:
    torch.manual_seed(0)
    net = TpMLP().double()
    if ctx.num_processes == 1:
        return net, torch.optim.Adam(net.parameters(), lr=0.05), None
    r, s, t, use_fsdp = shape
    mesh = build_mesh(ctx, dp_replicate=r, dp_shard=s, tp=t)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()} if t > 1 else None
    model = wrap_model(
        ctx, net, fsdp=FSDPOptions() if use_fsdp else None, mesh=mesh, tp_plan=plan
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.05), mesh


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in unwrap_model(model).state_dict().items()
    }


def _train(
    ctx: DistributedContext,
    shape: tuple[int, int, int, bool],
    *,
    save_to: Path | None = None,
    resume_from: Path | None = None,
) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """Train from scratch (saving after ``SAVE_AT`` steps) or from a checkpoint."""
    model, opt, mesh = _wrapped(ctx, shape)
    dp_size = 1 if mesh is None else mesh.dp_size
    loader = shard_loader(
        ctx, DataLoader(_dataset(), batch_size=GLOBAL_BATCH // dp_size), mesh=mesh
    )
    grad, start = GradState(accumulation_steps=K), LoaderState(epoch=0)
    if resume_from is not None:
        loaded = load_checkpoint(ctx, resume_from, models=model, optimizers=opt)
        assert loaded.grad is not None and loaded.loader is not None
        grad, start = loaded.grad, loaded.loader
    for epoch in range(start.epoch, EPOCHS):
        state = start if epoch == start.epoch else LoaderState(epoch=epoch)
        for batch in iter_batches(loader, state):
            x, y = batch.data

            def loss_fn(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return F.mse_loss(model(x), y)

            _, grad = accumulate_step(
                ctx, grad, model, opt, loss_fn, end_of_dataloader=batch.is_last
            )
            if (
                save_to is not None
                and grad.sync_gradients
                and grad.optimizer_steps == SAVE_AT
            ):
                save_checkpoint(
                    ctx,
                    save_to,
                    models=model,
                    optimizers=opt,
                    grad=grad,
                    loader=batch.state,
                )
    return model, _full_params(model)


def _on_4_ranks(ctx: DistributedContext, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, shape in SAVED_ON.items():
        model, out[f"unbroken_{name}"] = _train(ctx, shape, save_to=tmp / name)
        save_model(ctx, model, tmp / f"export_{name}")
        for other, resume_shape in RESUMED_ON_4.items():
            path = tmp / name / "checkpoint-000001"
            _, out[f"{name}->{other}"] = _train(ctx, resume_shape, resume_from=path)
    return out


def _on_2_ranks(ctx: DistributedContext, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Tensor parallelism alone (DTensor parameters, no FSDP2) is saved sharded too.
    _, out["unbroken_tp"] = _train(ctx, RESUMED_ON_2["tp_1x2"], save_to=tmp / "tp")
    for name in SAVED_ON:
        for other, shape in RESUMED_ON_2.items():
            path = tmp / name / "checkpoint-000001"
            _, out[f"{name}->{other}"] = _train(ctx, shape, resume_from=path)
    return out


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in got.items():
        assert torch.allclose(value, want[key], rtol=0, atol=1e-10), key


@pytest.mark.distributed
def test_a_checkpoint_saved_on_2x2_resumes_on_4x1_1x2_and_one_process(
    tmp_path: Path,
) -> None:
    four = run_ranks(_on_4_ranks, 4, tmp_path / "four", tmp_path)
    two = run_ranks(_on_2_ranks, 2, tmp_path / "two", tmp_path)
    _, reference = _train(DistributedContext(), (1, 1, 1, False))
    one_process = DistributedContext()
    for name in SAVED_ON:
        meta = read_checkpoint_meta(tmp_path / name / "checkpoint-000001")
        assert meta.state_format == "dcp" and meta.world_size == 4
        assert meta.grad is not None and meta.grad.optimizer_steps == SAVE_AT
        for rank in four:
            _close(rank[f"unbroken_{name}"], reference)
            for other in RESUMED_ON_4:
                _close(rank[f"{name}->{other}"], rank[f"unbroken_{name}"])
        for rank in two:
            for other in RESUMED_ON_2:
                _close(rank[f"{name}->{other}"], four[0][f"unbroken_{name}"])
        path = tmp_path / name / "checkpoint-000001"
        _, alone = _train(one_process, (1, 1, 1, False), resume_from=path)
        _close(alone, four[0][f"unbroken_{name}"])
        # save_model gathered the full tensors of the mesh-wrapped model.
        exported = TpMLP().double()
        load_model(one_process, exported, tmp_path / f"export_{name}")
        _close(_full_params(exported), four[0][f"unbroken_{name}"])
    assert (
        read_checkpoint_meta(tmp_path / "tp" / "checkpoint-000001").state_format
        == "dcp"
    )
    _, alone = _train(
        one_process, (1, 1, 1, False), resume_from=tmp_path / "tp" / "checkpoint-000001"
    )
    _close(two[0]["unbroken_tp"], reference)
    _close(alone, reference)
