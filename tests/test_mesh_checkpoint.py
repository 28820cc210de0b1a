"""Checkpoints and exports of models wrapped on a mesh, resumed on other mesh shapes.

A float64 MLP trains over 2 epochs of 5 global batches with windows of 2 (so each
epoch ends with a short window of 1) and Adam. Each 2x2 run (HSDP, FSDP x TP,
DDP x TP on 4 gloo processes) trains without a break while saving a checkpoint
after its second optimizer step; that checkpoint is then resumed on 4x1 meshes
(FSDP2 over 4 ranks, DDP), on 1x2 (tensor parallelism only, 2 processes) and on
one process, and every resumed run must end where the unbroken one did (within
1e-10: the meshes reduce in different orders). A tensor-parallel-only run on 2
processes saves a sharded checkpoint too, which one process resumes, and so does
one on 3 (the width 8 split unevenly: 3, 3 and 2), resumed on 2 and on one.

Each trained model is exported with ``save_model``; every export is loaded with
``load_model`` into a freshly wrapped model (other initial values) of every 2x2
layout, into one built on ``meta`` (not initialised: the export fills it), on 2 and
3 tensor-parallel ranks and on one process: each must hold exactly the exported
tensors and compute what the saved model computes.

The three spawned runs (4, 3 and 2 processes) are shared by the tests below.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
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
from funcaccel.testing import run_ranks
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
TP3 = (1, 1, 3, False)
X = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(6, 4)


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(SAMPLES, 3, generator=generator, dtype=torch.float64)
    return TensorDataset(x, y)


def _plan(tp: int) -> dict[str, Any] | None:
    if tp == 1:
        return None
    # Uneven shards (width 8 over 3): down's input must arrive as a DTensor.
    up = ColwiseParallel() if 8 % tp == 0 else ColwiseParallel(use_local_output=False)
    return {"up": up, "down": RowwiseParallel()}


def _no_init(module: nn.Module) -> None:
    """Leave a meta model's new storage as it is: ``load_model`` fills all of it."""


def _wrapped(
    ctx: DistributedContext,
    shape: tuple[int, int, int, bool],
    *,
    seed: int = 0,
    meta: bool = False,
) -> tuple[nn.Module, torch.optim.Optimizer, ParallelMesh | None]:
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        net = TpMLP().double()
    if ctx.num_processes == 1:
        return net, torch.optim.Adam(net.parameters(), lr=0.05), None
    r, s, t, use_fsdp = shape
    mesh = build_mesh(ctx, dp_replicate=r, dp_shard=s, tp=t)
    model = wrap_model(
        ctx,
        net,
        fsdp=FSDPOptions() if use_fsdp else None,
        mesh=mesh,
        tp_plan=_plan(t),
        init_fn=_no_init if meta else None,
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.05), mesh


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in unwrap_model(model).state_dict().items()
    }


class _TiedTp(nn.Module):
    """A tensor-parallel body between an embedding and an output layer sharing its
    weight, and a buffer: the export holds ``embed.weight`` once."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4, dtype=torch.float64)
        self.body = TpMLP().double()
        self.head = nn.Linear(3, 5, bias=False, dtype=torch.float64)
        self.unembed = nn.Linear(4, 5, bias=False, dtype=torch.float64)
        self.unembed.weight = self.embed.weight
        self.register_buffer("scale", torch.full((5,), 2.0, dtype=torch.float64))

    def reset_parameters(self) -> None:  # the root's own tensor: the buffer
        nn.init.constant_(self.scale, 2.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        out: torch.Tensor = (
            self.head(self.body(hidden)) + self.unembed(hidden)
        ) * self.scale
        return out


TOKENS = torch.tensor([[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]])


def _tied(
    ctx: DistributedContext, shape: tuple[int, int, int, bool], seed: int, meta: bool
) -> nn.Module:
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        net = _TiedTp()
    r, s, t, use_fsdp = shape
    plan = {"body.up": ColwiseParallel(), "body.down": RowwiseParallel()}
    return wrap_model(
        ctx,
        net,
        fsdp=FSDPOptions() if use_fsdp else None,
        mesh=build_mesh(ctx, dp_replicate=r, dp_shard=s, tp=t),
        tp_plan=plan if t > 1 else None,
        init_fn=_no_init if meta else None,
    )


def _tied_round_trip(ctx: DistributedContext, tmp: Path) -> dict[str, Any]:
    """Export a tied model from FSDP x TP; load it into each 2x2 layout on meta."""
    model = _tied(ctx, SAVED_ON["fsdp_x_tp"], 0, meta=False)
    save_model(ctx, model, tmp / "export_tied")
    with torch.no_grad():
        out: dict[str, Any] = {"out": model(TOKENS)}
    for name, shape in SAVED_ON.items():
        loaded = _tied(ctx, shape, 1, meta=True)
        names = load_model(ctx, loaded, tmp / "export_tied")
        inner = unwrap_model(loaded)
        assert isinstance(inner, _TiedTp)
        with torch.no_grad():
            out[name] = {
                "names": names,
                "full": _full_params(loaded),
                "tied": inner.unembed.weight is inner.embed.weight,
                "out": loaded(TOKENS),
            }
    return out


def _local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's own part of each tensor (the whole one where it is not sharded)."""
    return {
        k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in unwrap_model(model).state_dict().items()
    }


def _seen(model: nn.Module) -> dict[str, Any]:
    """What a test compares of a model: full and local tensors, and a forward."""
    with torch.no_grad():
        out = model(X)
    return {"full": _full_params(model), "local": _local_params(model), "out": out}


def _loaded(
    ctx: DistributedContext,
    shape: tuple[int, int, int, bool],
    export: Path,
    *,
    meta: bool = False,
) -> dict[str, Any]:
    """A new model on ``shape`` (seeded otherwise, or on meta) with ``export`` loaded."""
    model, _, _ = _wrapped(ctx, shape, seed=1, meta=meta)
    before = None if meta else _full_params(model)
    names = load_model(ctx, model, export)
    return {"before": before, "names": names, **_seen(model)}


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
        out[f"seen_{name}"] = _seen(model)
        save_model(ctx, model, tmp / f"export_{name}")
        for other, resume_shape in RESUMED_ON_4.items():
            path = tmp / name / "checkpoint-000001"
            _, out[f"{name}->{other}"] = _train(ctx, resume_shape, resume_from=path)
    for name, shape in SAVED_ON.items():
        export = tmp / f"export_{name}"
        for other, other_shape in SAVED_ON.items():
            out[f"{name}=>{other}"] = _loaded(ctx, other_shape, export)
        out[f"{name}=>meta_{name}"] = _loaded(ctx, shape, export, meta=True)
    out["tied"] = _tied_round_trip(ctx, tmp)
    return out


def _on_3_ranks(ctx: DistributedContext, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model, out["unbroken_tp3"] = _train(ctx, TP3, save_to=tmp / "tp3")
    out["seen_tp3"] = _seen(model)
    save_model(ctx, model, tmp / "export_tp3")
    out["tp3=>tp3"] = _loaded(ctx, TP3, tmp / "export_tp3")
    out["fsdp_x_tp=>tp3"] = _loaded(ctx, TP3, tmp / "export_fsdp_x_tp")
    return out


def _on_2_ranks(ctx: DistributedContext, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Tensor parallelism alone (DTensor parameters, no FSDP2) is saved sharded too.
    _, out["unbroken_tp"] = _train(ctx, RESUMED_ON_2["tp_1x2"], save_to=tmp / "tp")
    for name in (*SAVED_ON, "tp3"):
        for other, shape in RESUMED_ON_2.items():
            path = tmp / name / "checkpoint-000001"
            _, out[f"{name}->{other}"] = _train(ctx, shape, resume_from=path)
    for name in ("fsdp_x_tp", "tp3"):
        export = tmp / f"export_{name}"
        out[f"{name}=>tp_1x2"] = _loaded(ctx, RESUMED_ON_2["tp_1x2"], export)
    return out


@dataclasses.dataclass(frozen=True)
class Runs:
    """The shared runs' per-rank results, and the directory they saved into."""

    tmp: Path
    four: list[dict[str, Any]]
    three: list[dict[str, Any]]
    two: list[dict[str, Any]]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("mesh_checkpoint")
    four = run_ranks(_on_4_ranks, 4, tmp, start_method="forkserver")
    three = run_ranks(_on_3_ranks, 3, tmp, start_method="forkserver")
    two = run_ranks(_on_2_ranks, 2, tmp, start_method="forkserver")
    return Runs(tmp, four, three, two)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in got.items():
        assert torch.allclose(value, want[key], rtol=0, atol=1e-10), key


@pytest.mark.distributed
def test_a_checkpoint_saved_on_2x2_resumes_on_4x1_1x2_and_one_process(
    runs: Runs,
) -> None:
    tmp_path, four, two = runs.tmp, runs.four, runs.two
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


@pytest.mark.distributed
def test_a_checkpoint_saved_on_3_uneven_tp_ranks_resumes_on_2_and_one_process(
    runs: Runs,
) -> None:
    path = runs.tmp / "tp3" / "checkpoint-000001"
    meta = read_checkpoint_meta(path)
    assert meta.state_format == "dcp" and meta.world_size == 3
    _, reference = _train(DistributedContext(), (1, 1, 1, False))
    # up's 8 rows and down's 8 columns are split 3, 3 and 2.
    rows = [r["seen_tp3"]["local"]["up.weight"].shape[0] for r in runs.three]
    cols = [r["seen_tp3"]["local"]["down.weight"].shape[1] for r in runs.three]
    assert rows == cols == [3, 3, 2]
    for rank in runs.three:
        _close(rank["unbroken_tp3"], reference)
    for rank in runs.two:
        _close(rank["tp3->tp_1x2"], runs.three[0]["unbroken_tp3"])
    _, alone = _train(DistributedContext(), (1, 1, 1, False), resume_from=path)
    _close(alone, runs.three[0]["unbroken_tp3"])
    # save_model wrote the full tensors, gathered from the uneven shards.
    saved = load_file(runs.tmp / "export_tp3" / "model.safetensors")
    _equal(saved, runs.three[0]["unbroken_tp3"])


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for key, value in got.items():
        assert torch.equal(value, want[key]), key


def _check_loaded(
    loaded: dict[str, Any], saved: dict[str, torch.Tensor], source: dict[str, Any]
) -> None:
    """``loaded`` holds exactly the export ``saved`` of the model ``source`` saw."""
    if loaded["before"] is not None:  # it started from other values
        assert all(not torch.equal(loaded["before"][k], v) for k, v in saved.items())
    assert sorted(loaded["names"]) == sorted(saved)
    _equal(loaded["full"], saved)
    assert torch.allclose(loaded["out"], source["out"], rtol=0, atol=1e-12)


@pytest.mark.distributed
def test_an_export_loads_into_every_mesh_layout_meta_and_one_process(
    runs: Runs,
) -> None:
    exports = {
        name: load_file(runs.tmp / f"export_{name}" / "model.safetensors")
        for name in (*SAVED_ON, "tp3")
    }
    for name, saved in exports.items():
        _equal(
            saved, (runs.three if name == "tp3" else runs.four)[0][f"unbroken_{name}"]
        )
    for name in SAVED_ON:
        for rank in runs.four:
            source = rank[f"seen_{name}"]
            for other in (*SAVED_ON, f"meta_{name}"):
                loaded = rank[f"{name}=>{other}"]
                _check_loaded(loaded, exports[name], source)
                if other.removeprefix("meta_") == name:
                    # The same layout: each rank holds what the saved model held,
                    # and computes the same, to the last bit.
                    _equal(loaded["local"], source["local"])
                    assert torch.equal(loaded["out"], source["out"])
    for index, rank in enumerate(runs.three):
        _check_loaded(rank["tp3=>tp3"], exports["tp3"], rank["seen_tp3"])
        # Each rank holds its slice of the uneven split: rows (up) or columns
        # (down) 0-2, 3-5 and 6-7; down's bias is replicated.
        rows = slice(3 * index, min(3 * index + 3, 8))
        for loaded, name in (
            (rank["tp3=>tp3"], "tp3"),
            (rank["fsdp_x_tp=>tp3"], "fsdp_x_tp"),
        ):
            local, saved = loaded["local"], exports[name]
            assert torch.equal(local["up.weight"], saved["up.weight"][rows])
            assert torch.equal(local["up.bias"], saved["up.bias"][rows])
            assert torch.equal(local["down.weight"], saved["down.weight"][:, rows])
            assert torch.equal(local["down.bias"], saved["down.bias"])
        _equal(rank["tp3=>tp3"]["local"], rank["seen_tp3"]["local"])
        _check_loaded(
            rank["fsdp_x_tp=>tp3"], exports["fsdp_x_tp"], runs.four[0]["seen_fsdp_x_tp"]
        )
    for rank in runs.two:
        _check_loaded(
            rank["fsdp_x_tp=>tp_1x2"],
            exports["fsdp_x_tp"],
            runs.four[0]["seen_fsdp_x_tp"],
        )
        _check_loaded(rank["tp3=>tp_1x2"], exports["tp3"], runs.three[0]["seen_tp3"])
    one_process = DistributedContext()
    for name, saved in exports.items():
        alone, _, _ = _wrapped(one_process, (1, 1, 1, False), seed=1)
        before = _full_params(alone)
        load_model(one_process, alone, runs.tmp / f"export_{name}")
        source = (runs.three if name == "tp3" else runs.four)[0][f"seen_{name}"]
        _check_loaded(
            {"before": before, "names": tuple(saved), **_seen(alone)}, saved, source
        )


@pytest.mark.distributed
def test_a_tied_weight_and_a_buffer_load_into_meta_models_on_every_2x2_layout(
    runs: Runs,
) -> None:
    saved = load_file(runs.tmp / "export_tied" / "model.safetensors")
    assert "unembed.weight" not in saved and "embed.weight" in saved
    assert torch.equal(saved["scale"], torch.full((5,), 2.0, dtype=torch.float64))
    for rank in runs.four:
        tied = rank["tied"]
        for name in SAVED_ON:
            loaded = tied[name]
            assert sorted(loaded["names"]) == sorted(saved)
            assert loaded["tied"]
            _equal(
                {k: v for k, v in loaded["full"].items() if k != "unembed.weight"},
                saved,
            )
            assert torch.equal(loaded["full"]["unembed.weight"], saved["embed.weight"])
            assert torch.allclose(loaded["out"], tied["out"], rtol=0, atol=1e-12)
