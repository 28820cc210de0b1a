"""build_mesh / ParallelMesh; the loader, gather_for_metrics and wrap_model on a mesh.

Pure checks use hand-built meshes (``ParallelMesh.for_rank``, ``build_mesh`` on
``rank_ctx``); the multi-process checks run 2 or 4 gloo processes and compare with a
float64 one-process reference computed here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data import TensorDataset

from funcaccel.accumulate import accumulate_step
from funcaccel.collectives import gather_for_metrics
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.loader import LoaderState
from funcaccel.loader import iter_batches
from funcaccel.loader import shard_loader
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import build_mesh
from funcaccel.mesh import check_mesh
from funcaccel.model import FSDPOptions
from funcaccel.model import wrap_model
from funcaccel.testing import run_ranks
from tests.fixtures import Indexed
from tests.fixtures import SizedStream
from tests.fixtures import TpMLP
from tests.fixtures import rank_ctx

MESHES = [
    (1, 1, 2, 2),
    (1, 2, 1, 2),
    (1, 1, 1, 4),
    (1, 2, 3, 2),
    (2, 1, 2, 1),
    (2, 1, 1, 2),
    (2, 2, 1, 1),
]


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({}, (1, 1, 4, 1)),
        ({"dp_replicate": 2}, (1, 2, 2, 1)),
        ({"tp": 2}, (1, 1, 2, 2)),
        ({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, (1, 2, 1, 2)),
        ({"dp_shard": 1, "tp": -1}, (1, 1, 1, 4)),
        ({"dp_replicate": -1, "dp_shard": 1}, (1, 4, 1, 1)),
    ],
)
def test_build_mesh_fills_in_the_rest(
    sizes: dict[str, int], expected: tuple[int, int, int, int]
) -> None:
    mesh = build_mesh(rank_ctx(4, 0), **sizes)
    assert mesh.shape == expected
    assert mesh.device_mesh is None
    assert mesh.dim_names == ("pp", "dp_replicate", "dp_shard", "tp")


def test_every_rank_of_a_2x2x2_mesh_has_its_row_major_coordinates() -> None:
    seen = []
    for rank in range(8):
        mesh = build_mesh(rank_ctx(8, rank), dp_replicate=2, dp_shard=2, tp=2)
        p, r, s, t = mesh.coordinates
        assert (p, mesh.pp_rank) == (0, 0)
        assert rank == (r * 2 + s) * 2 + t
        assert (mesh.dp_rank, mesh.dp_size, mesh.tp_rank) == (r * 2 + s, 4, t)
        assert mesh == ParallelMesh.for_rank(rank, dp_replicate=2, dp_shard=2, tp=2)
        seen.append(mesh.coordinates)
    assert len(set(seen)) == 8


def test_dp_view_counts_data_parallel_ranks_only() -> None:
    views = [
        ParallelMesh.for_rank(g, dp_shard=2, tp=2).dp_view(rank_ctx(4, g))
        for g in range(4)
    ]
    assert [(v.num_processes, v.process_index) for v in views] == [
        (2, 0),
        (2, 0),
        (2, 1),
        (2, 1),
    ]
    tp_only = ParallelMesh.for_rank(1, tp=2).dp_view(rank_ctx(2, 1))
    assert (tp_only.num_processes, tp_only.distributed_type.value) == (1, "NO")
    ctx = rank_ctx(4, 3)
    assert ParallelMesh.for_rank(3, dp_shard=4).dp_view(ctx) is ctx


def test_pp_is_the_outermost_dimension_and_dp_counts_dp_dims_only() -> None:
    # 8 ranks as pp=2 x dp_shard=2 x tp=2: stage 0 holds ranks 0-3, stage 1 4-7.
    meshes = [build_mesh(rank_ctx(8, g), pp=2, tp=2) for g in range(8)]
    assert {m.shape for m in meshes} == {(2, 1, 2, 2)}
    for g, mesh in enumerate(meshes):
        p, r, s, t = mesh.coordinates
        assert g == ((p * 1 + r) * 2 + s) * 2 + t
        assert (mesh.pp_rank, mesh.dp_rank, mesh.dp_size, mesh.tp_rank) == (
            g // 4,
            (g // 2) % 2,
            2,
            g % 2,
        )
        assert mesh.pp_peer(1 - p) == (g + 4) % 8
        view = mesh.dp_view(rank_ctx(8, g))
        assert (view.num_processes, view.process_index) == (2, mesh.dp_rank)
    pp_only = ParallelMesh.for_rank(1, pp=2).dp_view(rank_ctx(2, 1))
    assert (pp_only.num_processes, pp_only.distributed_type.value) == (1, "NO")
    with pytest.raises(ValueError, match=r"pp \* dp_replicate \* dp_shard \* tp"):
        build_mesh(rank_ctx(4, 0), pp=3, dp_shard=1)
    with pytest.raises(ValueError, match=r"pp must be >= 1, or -1 .*got 0"):
        build_mesh(rank_ctx(4, 0), pp=0)


def test_build_mesh_refuses_sizes_that_do_not_make_the_world() -> None:
    ctx = rank_ctx(4, 0)
    with pytest.raises(
        ValueError, match=r"must be the world size \(4\); got 6\. .*\(product 6\)"
    ):
        build_mesh(ctx, dp_replicate=3, dp_shard=1, tp=2)
    with pytest.raises(ValueError, match=r"world size must be a multiple of 3; got 4"):
        build_mesh(ctx, tp=3)
    with pytest.raises(ValueError, match=r"sizes must be -1 \(the rest\) in one place"):
        build_mesh(ctx, dp_replicate=-1, tp=-1)
    with pytest.raises(ValueError, match=r"tp must be >= 1, or -1 .*got 0"):
        build_mesh(ctx, tp=0)
    with pytest.raises(TypeError, match=r"tp must be an int; got 2.0"):
        build_mesh(ctx, tp=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ctx must be a DistributedContext"):
        build_mesh(4, tp=2)  # type: ignore[arg-type]


def test_parallel_mesh_checks_its_fields() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\) .*; got 4\. Pass"):
        ParallelMesh.for_rank(4, dp_shard=2, tp=2)
    with pytest.raises(ValueError, match=r"ParallelMesh: dp_shard \(0\) must be >= 1"):
        ParallelMesh(dp_shard=0)
    with pytest.raises(TypeError, match=r"rank must be an int"):
        ParallelMesh(rank=True)
    mesh = ParallelMesh.for_rank(1, tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.tp = 1  # type: ignore[misc]


def test_check_mesh_refuses_a_mesh_of_another_rank_or_world() -> None:
    mesh = ParallelMesh.for_rank(1, tp=2)
    assert check_mesh("f", rank_ctx(2, 1), mesh) is mesh
    with pytest.raises(
        ValueError,
        match=r"^f: mesh must be for rank 0 of 2 \(ctx's\); got ParallelMesh\("
        r"pp=1, dp_replicate=1, dp_shard=1, tp=2, rank=1\)\. Build it with build_mesh",
    ):
        check_mesh("f", rank_ctx(2, 0), mesh)
    with pytest.raises(TypeError, match=r"f: mesh must be a ParallelMesh"):
        check_mesh("f", rank_ctx(2, 0), (1, 1, 2))


def _batches(loader: Any, state: LoaderState | None = None) -> list[list[int]]:
    records = iter_batches(loader) if state is None else iter_batches(loader, state)
    return [b.data.tolist() for b in records]


def _modes() -> list[dict[str, Any]]:
    return [
        {},
        {"split_batches": True},
        {"even_batches": False},
        {"dispatch_batches": False, "iterable": True},
    ]


@pytest.mark.parametrize("shape", MESHES)
@pytest.mark.parametrize("mode", _modes())
def test_shard_loader_on_a_mesh_shards_over_data_parallel_ranks_only(
    shape: tuple[int, int, int, int], mode: dict[str, Any]
) -> None:
    # Each rank reads what its data-parallel rank reads in a world of dp_size
    # processes; so the stages and tensor-parallel ranks of one data-parallel
    # coordinate read the same batches, and the dp ranks together read every
    # sample once (n = 24 divides every global batch).
    p, r, s, t = shape
    world, dp_size = p * r * s * t, r * s
    options = dict(mode)
    data: Any = SizedStream(24) if options.pop("iterable", False) else Indexed(24)
    dl = DataLoader(data, batch_size=2 * dp_size if options.get("split_batches") else 2)
    seen: dict[int, list[list[int]]] = {}
    for g in range(world):
        mesh = build_mesh(rank_ctx(world, g), pp=p, dp_replicate=r, dp_shard=s, tp=t)
        loader = shard_loader(rank_ctx(world, g), dl, mesh=mesh, **options)
        alone = shard_loader(rank_ctx(dp_size, mesh.dp_rank), dl, **options)
        got = _batches(loader)
        assert got == _batches(alone)
        assert loader.total_batch_size == alone.total_batch_size == 2 * dp_size
        assert len(loader) == len(alone)
        state = LoaderState(epoch=1, global_batches=1, global_batch_size=2 * dp_size)
        assert _batches(loader, state) == _batches(alone, state)
        # The same along pp and tp.
        assert seen.setdefault(mesh.dp_rank, got) == got
    everything = sorted(i for batches in seen.values() for b in batches for i in b)
    assert everything == list(range(24))


def test_shard_loader_refuses_a_mesh_of_another_rank() -> None:
    mesh = ParallelMesh.for_rank(1, tp=2)
    with pytest.raises(
        ValueError, match=r"shard_loader: mesh must be for rank 0 of 2 .*rank=1\)"
    ):
        shard_loader(rank_ctx(2, 0), DataLoader(Indexed(4), batch_size=2), mesh=mesh)


def _loader_on_mesh(ctx: DistributedContext) -> dict[str, Any]:
    mesh = build_mesh(ctx, tp=2)  # 1 x 2 x 2
    assert mesh.device_mesh is not None
    assert mesh.device_mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "tp")
    out: dict[str, Any] = {"coordinates": mesh.coordinates}
    torch.manual_seed(ctx.process_index)  # synchronised below by rng_types
    dl = DataLoader(Indexed(10), batch_size=3, shuffle=True)
    for dispatch in (False, True):
        loader = shard_loader(
            ctx, dl, mesh=mesh, dispatch_batches=dispatch, rng_types=["torch"], seed=3
        )
        batches, gathered = [], []
        for batch in iter_batches(loader, LoaderState(epoch=1)):
            batches.append(batch.data.tolist())
            gathered.append(gather_for_metrics(ctx, batch.data, batch=batch, mesh=mesh))
        out[f"batches_{dispatch}"] = batches
        out[f"gathered_{dispatch}"] = torch.cat(gathered).tolist()
        out[f"rng_{dispatch}"] = torch.rand(1).item()
    out["objects"] = gather_for_metrics(ctx, [ctx.process_index], batch=None, mesh=mesh)
    return out


@pytest.mark.distributed
def test_loader_and_gather_for_metrics_on_a_real_2x2_mesh() -> None:
    results = run_ranks(_loader_on_mesh, 4, start_method="forkserver")
    assert [r["coordinates"] for r in results] == [
        (0, 0, 0, 0),
        (0, 0, 0, 1),
        (0, 0, 1, 0),
        (0, 0, 1, 1),
    ]
    order = torch.randperm(10, generator=torch.Generator().manual_seed(3 + 1)).tolist()
    for dispatch in (False, True):
        key = f"batches_{dispatch}"
        assert results[0][key] == results[1][key] and results[2][key] == results[3][key]
        assert results[0][key] != results[2][key]
        for r in results:  # every sample once, in the epoch's order
            assert r[f"gathered_{dispatch}"] == order
            assert r[f"rng_{dispatch}"] == results[0][f"rng_{dispatch}"]
    assert all(r["objects"] == [0, 2] for r in results)


SAMPLES, GLOBAL_BATCH, K, EPOCHS, MAX_NORM = 40, 8, 2, 2, 0.3


def _mlp() -> TpMLP:
    torch.manual_seed(0)
    return TpMLP().double()


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=generator, dtype=torch.float64)
    y = torch.randn(SAMPLES, 3, generator=generator, dtype=torch.float64)
    return TensorDataset(x, y)


def _train(
    ctx: DistributedContext,
    model: nn.Module,
    batch_size: int,
    mesh: ParallelMesh | None,
    opt: torch.optim.Optimizer | None = None,
) -> None:
    # 5 global batches per epoch and k=2: windows of 2, 2 and a short last 1.
    if opt is None:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = shard_loader(ctx, DataLoader(_dataset(), batch_size=batch_size), mesh=mesh)
    grad = GradState(accumulation_steps=K)
    for epoch in range(EPOCHS):
        for batch in iter_batches(loader, LoaderState(epoch=epoch)):
            x, y = batch.data

            def loss_fn(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                return F.mse_loss(model(x), y)

            _, grad = accumulate_step(
                ctx,
                grad,
                model,
                opt,
                loss_fn,
                end_of_dataloader=batch.is_last,
                max_grad_norm=MAX_NORM,
            )


def _reference() -> dict[str, torch.Tensor]:
    model = _mlp()
    _train(rank_ctx(1, 0), model, GLOBAL_BATCH, None)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _train_on_meshes(
    ctx: DistributedContext,
    shapes: list[tuple[int, int, int, bool]],
    dtensor_between: bool = False,
) -> list[dict[str, Any]]:
    """``dtensor_between``: ``up`` hands ``down`` a DTensor, as uneven shards need."""
    out = []
    up = (
        ColwiseParallel(use_local_output=False)
        if dtensor_between
        else ColwiseParallel()
    )
    plan = {"up": up, "down": RowwiseParallel()}
    for r, s, t, use_fsdp in shapes:
        mesh = build_mesh(ctx, dp_replicate=r, dp_shard=s, tp=t)
        model = wrap_model(
            ctx,
            _mlp(),
            fsdp=FSDPOptions() if use_fsdp else None,
            mesh=mesh,
            tp_plan=plan if t > 1 else None,
        )
        _train(ctx, model, GLOBAL_BATCH // mesh.dp_size, mesh)
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        assert isinstance(inner, TpMLP)
        local_up, local_down = _local(inner.up.weight), _local(inner.down.weight)
        out.append(
            {
                "type": type(model).__name__,
                "local_up": tuple(local_up.shape),
                "local_down": tuple(local_down.shape),
                "params": {k: _full(v).detach() for k, v in model.state_dict().items()},
            }
        )
    return out


def _check_against_reference(
    results: list[list[dict[str, Any]]],
    expected_types: list[str],
    local_up: list[list[tuple[int, int]]],
) -> None:
    """``local_up[rank]``: that rank's local ``up.weight`` shape on each mesh."""
    reference = _reference()
    assert len(local_up) == len(results)
    for per_rank, shapes in zip(results, local_up, strict=True):
        for got, kind, shape in zip(per_rank, expected_types, shapes, strict=True):
            assert kind in got["type"]
            assert got["local_up"] == shape
            names = {k.removeprefix("module.") for k in got["params"]}
            assert names == set(reference)
            for name, value in got["params"].items():
                want = reference[name.removeprefix("module.")]
                assert torch.allclose(value, want, rtol=0, atol=1e-10), name


def test_the_reference_clips_and_moves() -> None:
    # The equivalence tests below would be weak if clipping never happened.
    model = _mlp()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _dataset().tensors
    torch.autograd.backward(F.mse_loss(model(x[:GLOBAL_BATCH]), y[:GLOBAL_BATCH]))
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    )
    assert norm > MAX_NORM
    assert any((start[k] - v).abs().max() > 0.01 for k, v in _reference().items())


@pytest.mark.distributed
def test_hsdp_fsdp_x_tp_ddp_x_tp_on_4_ranks_match_one_process() -> None:
    shapes = [(2, 2, 1, True), (1, 2, 2, True), (2, 1, 2, False), (4, 1, 1, False)]
    results = run_ranks(_train_on_meshes, 4, shapes, start_method="forkserver")
    # up.weight is 8 x 4: halved by FSDP's dp_shard=2, by tp=2, or by both.
    _check_against_reference(
        results,
        ["FSDP", "FSDP", "FSDP", "DistributedDataParallel"],
        [[(4, 4), (2, 4), (4, 4), (8, 4)]] * 4,
    )


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world", "rows", "dtensor_between"), [(2, [4, 4], False), (3, [3, 3, 2], True)]
)
def test_tensor_parallel_only_on_2_and_3_ranks_matches_one_process(
    world: int, rows: list[int], dtensor_between: bool
) -> None:
    # On 3 ranks the width 8 does not divide: torch shards it unevenly, up's rows
    # (ColwiseParallel) and down's columns (RowwiseParallel) as 3, 3 and 2.
    results = run_ranks(
        _train_on_meshes,
        world,
        [(1, 1, world, False)],
        dtensor_between,
        start_method="forkserver",
    )
    _check_against_reference(results, ["MLP"], [[(n, 4)] for n in rows])
    assert [r[0]["local_down"] for r in results] == [(3, n) for n in rows]


def _tp_optimizer_built_first(ctx: DistributedContext) -> dict[str, Any]:
    """Accelerate's order: the optimizer exists before tensor parallelism."""
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    mesh = build_mesh(ctx, tp=2)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    wrapped = wrap_model(ctx, model, mesh=mesh, tp_plan=plan, optimizers=opt)
    _train(ctx, wrapped, GLOBAL_BATCH, mesh, opt)
    params = {k: _full(v).detach() for k, v in wrapped.state_dict().items()}
    unwrapped = _mlp()
    stale = torch.optim.SGD(unwrapped.parameters(), lr=0.5)
    forgotten = wrap_model(ctx, unwrapped, mesh=mesh, tp_plan=plan)
    try:
        _train(ctx, forgotten, GLOBAL_BATCH, mesh, stale)
    except ValueError as error:
        return {"params": params, "forgotten": str(error)}
    return {"params": params, "forgotten": None}


@pytest.mark.distributed
def test_an_optimizer_built_before_tensor_parallelism_is_re_pointed_or_refused() -> (
    None
):
    reference = _reference()
    for result in run_ranks(_tp_optimizer_built_first, 2, start_method="forkserver"):
        for name, value in result["params"].items():
            assert torch.allclose(value, reference[name], rtol=0, atol=1e-10), name
        assert result["forgotten"] is not None
        assert "holds none of the model's parameters" in result["forgotten"]


def test_wrap_model_refuses_what_a_mesh_cannot_build() -> None:
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    tp = ParallelMesh.for_rank(0, tp=2)
    ctx = rank_ctx(2, 0)
    with pytest.raises(
        ValueError,
        match=r"tp_plan must be None without a mesh \(tp_plan needs a mesh with tp > 1\)",
    ):
        wrap_model(ctx, _mlp(), tp_plan=plan)
    with pytest.raises(
        ValueError, match=r"tp_plan must be a mapping .*\(the mesh has tp=2\)"
    ):
        wrap_model(ctx, _mlp(), mesh=tp)
    with pytest.raises(ValueError, match=r"tp_plan must be None on a mesh with tp=1"):
        wrap_model(
            ctx,
            _mlp(),
            mesh=ParallelMesh.for_rank(0, dp_shard=2),
            fsdp=FSDPOptions(),
            tp_plan=plan,
        )
    with pytest.raises(
        ValueError,
        match=r"every tp_plan key must be a submodule's name .*; got 'middle'",
    ):
        wrap_model(ctx, _mlp(), mesh=tp, tp_plan={"middle": ColwiseParallel()})
    with pytest.raises(
        TypeError, match=r"tp_plan\['up'\] must be a torch.*ParallelStyle"
    ):
        wrap_model(ctx, _mlp(), mesh=tp, tp_plan={"up": "colwise"})
    with pytest.raises(
        ValueError,
        match=r"fsdp must be an FSDPOptions on a mesh with dp_shard > 1 \(shape \(1, 1, 2, 1\)\); got None",
    ):
        wrap_model(ctx, _mlp(), mesh=ParallelMesh.for_rank(0, dp_shard=2))
    with pytest.raises(
        ValueError, match=r"fsdp must be None on a mesh with one data-parallel rank"
    ):
        wrap_model(ctx, _mlp(), mesh=tp, tp_plan=plan, fsdp=FSDPOptions())
    with pytest.raises(
        ValueError,
        match=r"reshard_after_forward must be a divisor of the mesh's dp_shard \(2\); got 3",
    ):
        wrap_model(
            rank_ctx(4, 0),
            _mlp(),
            mesh=ParallelMesh.for_rank(0, dp_shard=2, tp=2),
            tp_plan=plan,
            fsdp=FSDPOptions(reshard_after_forward=3),
        )
    with pytest.raises(
        ValueError,
        match=r"mesh must be for rank 1 of 2 \(ctx's\); got ParallelMesh\(.*rank=0\)",
    ):
        wrap_model(rank_ctx(2, 1), _mlp(), mesh=tp, tp_plan=plan)
    with pytest.raises(
        RuntimeError,
        match=r"has no DeviceMesh: .*build_mesh\(ctx, \.\.\.\) after build_context",
    ):
        wrap_model(ctx, _mlp(), mesh=tp, tp_plan=plan)
    net = _mlp()
    assert wrap_model(rank_ctx(1, 0), net, mesh=build_mesh(rank_ctx(1, 0))) is net


def test_wrap_model_refuses_uneven_rowwise_inputs_that_arrive_as_local_tensors() -> (
    None
):
    # tp=3 does not divide down's 8 inputs: from a local tensor torch would size
    # them 9, 9 and 6; a ColwiseParallel handing on DTensors makes it work.
    tp3 = ParallelMesh.for_rank(0, tp=3)
    ctx = rank_ctx(3, 0)
    with pytest.raises(
        ValueError,
        match=r"wrap_model: tp_plan\['down'\] is RowwiseParallel on an nn.Linear "
        r"with in_features=8, which tp=3 does not divide \(its ranks hold \[3, 3, 2\]\)"
        r".*ColwiseParallel\(use_local_output=False\)",
    ):
        wrap_model(
            ctx,
            _mlp(),
            mesh=tp3,
            tp_plan={"up": ColwiseParallel(), "down": RowwiseParallel()},
        )
    # Accepted (refused only later, for the hand-built mesh's missing DeviceMesh):
    # a DTensor input, an input given as replicated, or sizes that tp divides.
    for plan in (
        {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()},
        {"down": RowwiseParallel(input_layouts=Replicate())},
        {"up": ColwiseParallel()},
    ):
        with pytest.raises(RuntimeError, match=r"has no DeviceMesh"):
            wrap_model(ctx, _mlp(), mesh=tp3, tp_plan=plan)
    with pytest.raises(RuntimeError, match=r"has no DeviceMesh"):
        wrap_model(
            rank_ctx(2, 0),
            _mlp(),
            mesh=ParallelMesh.for_rank(0, tp=2),
            tp_plan={"up": ColwiseParallel(), "down": RowwiseParallel()},
        )
