"""build_mesh / ParallelMesh; the loader, gather_for_metrics and wrap_model on a mesh.

Pure checks use hand-built meshes (``ParallelMesh.for_rank``, ``build_mesh`` on
``rank_ctx``); the multi-process checks run 2 or 4 gloo processes and compare with a
float64 one-process reference computed here.
"""

from __future__ import annotations

import dataclasses

import pytest

from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import build_mesh
from funcaccel.mesh import check_mesh
from tests.fixtures import rank_ctx


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        ({}, (1, 4, 1)),
        ({"dp_replicate": 2}, (2, 2, 1)),
        ({"tp": 2}, (1, 2, 2)),
        ({"dp_replicate": 2, "dp_shard": 1, "tp": 2}, (2, 1, 2)),
        ({"dp_shard": 1, "tp": -1}, (1, 1, 4)),
        ({"dp_replicate": -1, "dp_shard": 1}, (4, 1, 1)),
    ],
)
def test_build_mesh_fills_in_the_rest(
    sizes: dict[str, int], expected: tuple[int, int, int]
) -> None:
    mesh = build_mesh(rank_ctx(4, 0), **sizes)
    assert mesh.shape == expected
    assert mesh.device_mesh is None
    assert mesh.dim_names == ("dp_replicate", "dp_shard", "tp")


def test_every_rank_of_a_2x2x2_mesh_has_its_row_major_coordinates() -> None:
    seen = []
    for rank in range(8):
        mesh = build_mesh(rank_ctx(8, rank), dp_replicate=2, dp_shard=2, tp=2)
        r, s, t = mesh.coordinates
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


def test_build_mesh_refuses_sizes_that_do_not_make_the_world() -> None:
    ctx = rank_ctx(4, 0)
    with pytest.raises(
        ValueError, match=r"product 6.*world size \(4\)|world size \(4\).*product 6"
    ):
        build_mesh(ctx, dp_replicate=3, dp_shard=1, tp=2)
    with pytest.raises(ValueError, match=r"not a multiple of 3"):
        build_mesh(ctx, tp=3)
    with pytest.raises(ValueError, match=r"at most one size may be -1"):
        build_mesh(ctx, dp_replicate=-1, tp=-1)
    with pytest.raises(ValueError, match=r"tp must be >= 1, or -1 .*got 0"):
        build_mesh(ctx, tp=0)
    with pytest.raises(TypeError, match=r"tp must be an int; got 2.0"):
        build_mesh(ctx, tp=2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"ctx must be a DistributedContext"):
        build_mesh(4, tp=2)  # type: ignore[arg-type]


def test_parallel_mesh_checks_its_fields() -> None:
    with pytest.raises(ValueError, match=r"rank \(4\) must be in \[0, 4\)"):
        ParallelMesh.for_rank(4, dp_shard=2, tp=2)
    with pytest.raises(ValueError, match=r"dp_shard must be >= 1; got 0"):
        ParallelMesh(dp_shard=0)
    with pytest.raises(TypeError, match=r"rank must be an int"):
        ParallelMesh(rank=True)
    mesh = ParallelMesh.for_rank(1, tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mesh.tp = 1  # type: ignore[misc]


def test_check_mesh_refuses_a_mesh_of_another_rank_or_world() -> None:
    mesh = ParallelMesh.for_rank(1, tp=2)
    assert check_mesh(rank_ctx(2, 1), mesh, "f") is mesh
    with pytest.raises(
        ValueError,
        match=r"f: mesh of shape \(1, 1, 2\) is for rank 1 of 2, but ctx is rank 0 of 2",
    ):
        check_mesh(rank_ctx(2, 0), mesh, "f")
    with pytest.raises(TypeError, match=r"f: mesh must be a ParallelMesh"):
        check_mesh(rank_ctx(2, 0), (1, 1, 2), "f")
