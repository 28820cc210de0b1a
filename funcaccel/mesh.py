"""N-D parallelism layout: ``ParallelMesh``, a frozen value, and ``build_mesh``.

A mesh lays the world's ranks out in four named dimensions, in this order:
``"pp"`` (pipeline stages, outermost), ``"dp_replicate"`` (copies of the model,
gradients all-reduced), ``"dp_shard"`` (FSDP2 shards) and ``"tp"``
(tensor-parallel groups, which see the same batches). Global rank ``g`` sits at
``(p, r, s, t)`` with ``g = ((p * dp_replicate + r) * dp_shard + s) * tp + t``
(row-major, as ``torch.distributed.device_mesh.init_device_mesh`` numbers them);
its data-parallel rank is ``r * dp_shard + s`` among ``dp_replicate * dp_shard``:
the pipeline stages and the tensor-parallel ranks of one data-parallel
coordinate read the same batches.

With 4 ranks as ``dp_shard=2, tp=2``: ranks 0 and 1 form tensor-parallel group
``dp=0``, ranks 2 and 3 group ``dp=1``; ranks 0 and 2 hold the two FSDP shards of
tensor-parallel slice ``t=0``. With 4 ranks as ``pp=2, dp_shard=2``: ranks 0 and 1
hold stage 0 (FSDP shards 0 and 1), ranks 2 and 3 stage 1; ranks 0 and 2 read
the same batches (data-parallel rank 0).

>>> [ParallelMesh.for_rank(g, dp_shard=2, tp=2).coordinates for g in range(4)]
[(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 0, 1, 1)]
>>> [ParallelMesh.for_rank(g, pp=2, dp_shard=2).dp_rank for g in range(4)]
[0, 1, 0, 1]
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING
from typing import Final

import torch.distributed as dist

from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType
from funcaccel.context import require_process_group

if TYPE_CHECKING:
    # Imported for real only where a group exists: the module imports slowly.
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "MESH_DIM_NAMES",
    "ParallelMesh",
    "build_mesh",
    "check_mesh",
    "mesh_report_rows",
]

MESH_DIM_NAMES: Final = ("pp", "dp_replicate", "dp_shard", "tp")
"""The dimension names of every mesh, outermost first."""
_REST: Final = "The sizes other than the -1 must multiply to a divisor of it."


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ParallelMesh:
    """Where this rank sits in a ``pp x dp_replicate x dp_shard x tp`` layout; never changed.

    Build one with ``build_mesh(ctx, ...)`` (which also builds the torch
    ``DeviceMesh`` when a process group exists) or, for any rank without a
    group, with ``ParallelMesh.for_rank``. Two meshes compare equal when their
    sizes and rank agree, whatever their ``device_mesh`` (which the repr leaves out).

    Args:
        pp: pipeline stages (ranks per pipeline, >= 1), the outermost dimension.
        dp_replicate: replicas of the model (>= 1).
        dp_shard: FSDP2 shards per replica (>= 1).
        tp: ranks per tensor-parallel group (>= 1).
        rank: this process's global rank, in ``[0, pp * dp_replicate * dp_shard * tp)``.
        device_mesh: the torch ``DeviceMesh`` with dimensions ``MESH_DIM_NAMES``,
            or ``None`` for a hand-built value (no process group).

    Raises:
        TypeError: a size or the rank is not an int.
        ValueError: a size below 1, or a rank outside the mesh.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    rank: int = 0
    device_mesh: DeviceMesh | None = dataclasses.field(
        default=None, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        owner = "ParallelMesh"
        for name in MESH_DIM_NAMES:
            check_int(owner, name, getattr(self, name), 1)
        check_type(owner, "rank", self.rank, int)
        where = f"in [0, {self.world_size}) for a mesh of shape {self.shape}"
        if not 0 <= self.rank < self.world_size:
            fail_value(owner, "rank", self.rank, where, "Pass this process's rank.")

    @classmethod
    def for_rank(
        cls,
        rank: int,
        *,
        pp: int = 1,
        dp_replicate: int = 1,
        dp_shard: int = 1,
        tp: int = 1,
    ) -> ParallelMesh:
        """Return rank ``rank``'s view of a mesh of these sizes, with no ``DeviceMesh``.

        >>> ParallelMesh.for_rank(3, dp_replicate=2, dp_shard=2).coordinates
        (0, 1, 1, 0)
        >>> ParallelMesh.for_rank(5, pp=2, dp_shard=2, tp=2).coordinates
        (1, 0, 0, 1)
        """
        return cls(
            pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, rank=rank
        )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(pp, dp_replicate, dp_shard, tp)``."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dim_names(self) -> tuple[str, str, str, str]:
        """``("pp", "dp_replicate", "dp_shard", "tp")``."""
        return MESH_DIM_NAMES

    @property
    def world_size(self) -> int:
        """The number of ranks the mesh lays out."""
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def coordinates(self) -> tuple[int, int, int, int]:
        """This rank's ``(pp, dp_replicate, dp_shard, tp)`` coordinates."""
        dp, t = divmod(self.rank, self.tp)
        dp, s = divmod(dp, self.dp_shard)
        p, r = divmod(dp, self.dp_replicate)
        return (p, r, s, t)

    @property
    def pp_rank(self) -> int:
        """This rank's pipeline rank (its stage, or first stage of several)."""
        return self.rank // (self.dp_size * self.tp)

    def pp_peer(self, pp_rank: int) -> int:
        """Return the global rank at pipeline rank ``pp_rank`` with this rank's other coordinates.

        >>> ParallelMesh.for_rank(1, pp=2, dp_shard=2).pp_peer(1)
        3
        """
        return self.rank + (pp_rank - self.pp_rank) * self.dp_size * self.tp

    @property
    def dp_size(self) -> int:
        """The number of data-parallel ranks: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: ``r * dp_shard + s``, shared by its tp group and stages."""
        return (self.rank // self.tp) % self.dp_size

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group."""
        return self.rank % self.tp

    def dp_view(self, ctx: DistributedContext) -> DistributedContext:
        """Return ``ctx`` as the data-parallel world sees it: ``dp_size`` ranks, this one ``dp_rank``.

        Only for arithmetic (which batches a rank reads): the view has no process
        group of its own; collectives run on ``ctx``.

        >>> from funcaccel.context import DistributedType
        >>> ctx = DistributedContext(
        ...     num_processes=4, process_index=3, distributed_type=DistributedType.MULTI_CPU
        ... )
        >>> view = ParallelMesh.for_rank(3, dp_shard=2, tp=2).dp_view(ctx)
        >>> view.num_processes, view.process_index
        (2, 1)
        """
        if self.tp == 1 and self.pp == 1:
            return ctx
        several = self.dp_size > 1
        return dataclasses.replace(
            ctx,
            num_processes=self.dp_size,
            process_index=self.dp_rank,
            distributed_type=ctx.distributed_type if several else DistributedType.NO,
            backend=ctx.backend if several else None,
        )


def _resolve(sizes: dict[str, int], world: int) -> dict[str, int]:
    """Fill in a ``-1`` size and check the product (errors name ``build_mesh``)."""
    caller = "build_mesh"
    for name, value in sizes.items():
        if check_type(caller, name, value, int) < 1 and value != -1:
            fail_value(caller, name, value, ">= 1, or -1 for the rest")
    rest = [name for name, value in sizes.items() if value == -1]
    known = math.prod(max(value, 1) for value in sizes.values())
    if len(rest) > 1:
        fail_value(caller, "the sizes", sizes, "-1 (the rest) in one place at most")
    if rest and world % known:
        fail_value(caller, "the world size", world, f"a multiple of {known}", _REST)
    if rest:
        sizes = {**sizes, rest[0]: world // known}
    product, dims = math.prod(sizes.values()), " * ".join(sizes)
    hint = f"Change the sizes {sizes} (product {product}), or leave one of them -1."
    if product != world:
        fail_value(caller, dims, product, f"the world size ({world})", hint)
    return sizes


def build_mesh(
    ctx: DistributedContext,
    *,
    pp: int = 1,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
) -> ParallelMesh:
    """Lay ``ctx``'s world out as ``pp x dp_replicate x dp_shard x tp``; ``-1`` is the rest.

    When ``ctx`` runs in a default process group (several processes) this is a
    collective: every rank calls it with the same sizes, and the result's
    ``device_mesh`` is ``init_device_mesh(ctx.device.type, shape,
    mesh_dim_names=MESH_DIM_NAMES)``. Without a group (one process, or a
    hand-built context such as ``rank_ctx(4, 2)``) ``device_mesh`` is ``None``
    and the value still gives the rank's coordinates.

    With 4 ranks, ``build_mesh(ctx, dp_replicate=2)`` is a 2x2 HSDP mesh: rank 3
    sits at ``(0, 1, 1, 0)``, data-parallel rank 3 of 4. ``build_mesh(ctx, pp=2)``
    gives two pipeline stages of two FSDP2 ranks each: rank 3 sits at
    ``(1, 0, 1, 0)``, stage 1, data-parallel rank 1 of 2 (as rank 1 on stage 0).

    >>> from funcaccel.context import DistributedType
    >>> ctx = DistributedContext(
    ...     num_processes=4, process_index=2, distributed_type=DistributedType.MULTI_CPU
    ... )
    >>> mesh = build_mesh(ctx, tp=2)
    >>> mesh.shape, mesh.coordinates, mesh.dp_rank, mesh.device_mesh is None
    ((1, 1, 2, 2), (0, 0, 1, 0), 1, True)

    Args:
        ctx: this process's context.
        pp: pipeline stages (ranks per pipeline), the outermost dimension.
        dp_replicate: replicas (gradients all-reduced between them).
        dp_shard: FSDP2 shards per replica.
        tp: ranks per tensor-parallel group.

    Returns:
        The mesh, for ``ctx.process_index``.

    Raises:
        TypeError: ``ctx`` or a size of the wrong type.
        ValueError: a size below 1 (other than -1), more than one -1, or sizes
            whose product is not ``ctx.num_processes``.
        RuntimeError: an initialised default group that does not match ``ctx``.
    """
    check_context("build_mesh", ctx)
    sizes = _resolve(
        {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp},
        ctx.num_processes,
    )
    device_mesh = None
    if ctx.num_processes > 1 and dist.is_available() and dist.is_initialized():
        require_process_group(ctx, "build_mesh")
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(sizes[name] for name in MESH_DIM_NAMES)
        device_mesh = init_device_mesh(
            ctx.device.type, shape, mesh_dim_names=MESH_DIM_NAMES
        )
    return ParallelMesh(**sizes, rank=ctx.process_index, device_mesh=device_mesh)


def check_mesh(caller: str, ctx: DistributedContext, mesh: object) -> ParallelMesh:
    """Return ``mesh`` after checking it is a ``ParallelMesh`` of ``ctx``'s world and rank.

    Raises:
        TypeError: ``mesh`` is not a ``ParallelMesh``.
        ValueError: its world size or rank differ from ``ctx``'s.
    """
    what = "a ParallelMesh (from build_mesh) or None"
    mesh = check_type(caller, "mesh", mesh, ParallelMesh, what=what)
    ours = f"for rank {ctx.process_index} of {ctx.num_processes} (ctx's)"
    hint = "Build it with build_mesh(ctx, ...) from this context."
    if (mesh.world_size, mesh.rank) != (ctx.num_processes, ctx.process_index):
        fail_value(caller, "mesh", mesh, ours, hint)
    return mesh


def mesh_report_rows(
    world_size: int, rank: int, sizes: tuple[int, ...]
) -> list[tuple[str, str]]:
    """Describe rank ``rank``'s place in a mesh of ``sizes`` as ``(key, value)`` rows.

    ``sizes`` is ``(dp_replicate, dp_shard, tp)`` or ``(pp, dp_replicate,
    dp_shard, tp)``, ``-1`` for the rest, resolved as ``build_mesh`` does; nothing
    is built. The rows name the dimensions given. For ``python -m funcaccel env
    --mesh``.

    >>> dict(mesh_report_rows(4, 3, (1, -1, 2)))["coordinates"]
    '(0, 1, 1)'
    >>> dict(mesh_report_rows(4, 3, (2, 1, -1, 1)))["pp_rank"]
    '1 of 2'

    Raises:
        TypeError, ValueError: sizes ``build_mesh`` would refuse.
    """
    names = MESH_DIM_NAMES[len(MESH_DIM_NAMES) - len(sizes) :]
    resolved = _resolve(dict(zip(names, sizes, strict=True)), world_size)
    mesh = ParallelMesh.for_rank(rank, **resolved)
    shown = mesh.coordinates[len(MESH_DIM_NAMES) - len(sizes) :]
    first = mesh.rank - mesh.tp_rank
    rows = [
        ("shape", " x ".join(f"{n}={v}" for n, v in resolved.items())),
        ("coordinates", str(shown)),
        ("dp_rank", f"{mesh.dp_rank} of {mesh.dp_size}"),
        ("tp_rank", f"{mesh.tp_rank} of {mesh.tp}"),
        ("tp group", str(list(range(first, first + mesh.tp)))),
    ]
    if "pp" in names:
        rows.insert(2, ("pp_rank", f"{mesh.pp_rank} of {mesh.pp}"))
    return rows
