"""``wrap_model`` on a ``ParallelMesh``: tensor parallelism, then data parallelism.

Tensor parallelism comes first: ``parallelize_module(model, mesh["tp"], tp_plan)``
turns the planned parameters into ``DTensor`` shards over each tensor-parallel
group. Data parallelism then runs over the ``dp_replicate x dp_shard`` ranks:

| mesh | ``fsdp`` | data parallelism |
|---|---|---|
| ``dp_shard > 1`` | ``FSDPOptions`` | FSDP2 over ``["dp_shard"]``; HSDP over ``["dp_replicate", "dp_shard"]`` when ``dp_replicate > 1`` too |
| ``dp_replicate > 1``, ``dp_shard == 1``, ``tp == 1`` | ``None`` | DDP (the whole world) |
| ``dp_replicate > 1``, ``dp_shard == 1``, ``tp > 1`` | ``None`` | replication by FSDP2 over ``["dp_replicate", "dp_shard"]`` (shards of one rank): DDP cannot hold ``DTensor`` parameters |
| ``dp_replicate == dp_shard == 1`` | ``None`` | none (tensor parallelism only) |
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from funcaccel._checks import summary
from funcaccel._dist_types import is_instance_if_loaded
from funcaccel.context import DistributedContext
from funcaccel.mesh import ParallelMesh
from funcaccel.model._fsdp import FSDPOptions
from funcaccel.model._fsdp import check_fsdp_options
from funcaccel.model._fsdp import rebind_by_name_
from funcaccel.model._fsdp import shard_model

__all__ = ["check_mesh_wrapping", "wrap_on_mesh"]

_WHERE = "wrap_model"


def _check_plan(mesh: ParallelMesh, tp_plan: object, model: nn.Module) -> None:
    if mesh.tp == 1:
        if tp_plan is not None:
            msg = (
                f"{_WHERE}: tp_plan was given but the mesh has tp=1 (shape "
                f"{mesh.shape}); build the mesh with tp > 1, or pass tp_plan=None."
            )
            raise ValueError(msg)
        return
    if not isinstance(tp_plan, Mapping) or not tp_plan:
        msg = (
            f"{_WHERE}: the mesh has tp={mesh.tp}, so tp_plan must map module names "
            f"to torch parallel styles; got {summary(tp_plan)}. Pass e.g. "
            "tp_plan={'up': ColwiseParallel(), 'down': RowwiseParallel()}."
        )
        raise (TypeError if tp_plan is not None else ValueError)(msg)
    names = [name for name, _ in model.named_modules()]
    for name, style in tp_plan.items():
        if not isinstance(name, str):
            msg = f"{_WHERE}: tp_plan keys must be module names (str); got {name!r}."
            raise TypeError(msg)
        if not is_instance_if_loaded(
            style, "torch.distributed.tensor.parallel.style", "ParallelStyle"
        ):
            msg = (
                f"{_WHERE}: tp_plan[{name!r}] must be a torch.distributed.tensor."
                f"parallel ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...); "
                f"got {summary(style)} ({type(style).__name__})."
            )
            raise TypeError(msg)
        if "*" not in name and name not in names:
            msg = (
                f"{_WHERE}: tp_plan names {name!r}, which is not a submodule of the "
                f"model; its submodules are {summary(names[1:])}."
            )
            raise ValueError(msg)
    _check_uneven_rows(mesh.tp, tp_plan, model)


def _shard_sizes(size: int, parts: int) -> list[int]:
    """The sizes of torch's ``Shard`` pieces of ``size`` over ``parts`` ranks.

    >>> _shard_sizes(8, 3), _shard_sizes(8, 2), _shard_sizes(4, 3)
    ([3, 3, 2], [4, 4], [2, 2, 0])
    """
    chunk = -(-size // parts)
    return [max(0, min(chunk, size - i * chunk)) for i in range(parts)]


def _check_uneven_rows(tp: int, tp_plan: Mapping[str, Any], model: nn.Module) -> None:
    """Refuse a ``RowwiseParallel`` ``nn.Linear`` whose local input torch cannot size.

    Its input is sharded on the last dimension; a plain (local) tensor is made a
    ``DTensor`` with ``DTensor.from_local``, which takes the global size to be the
    local size times ``tp``. When ``tp`` does not divide ``in_features`` that is
    wrong on every rank and the forward fails, unless the input arrives as a
    ``DTensor`` already: a ``ColwiseParallel(use_local_output=False)`` in the plan
    hands one on. With tp=3 and ``down = nn.Linear(8, 3)`` the ranks hold 3, 3
    and 2 of the 8 inputs, and torch would read them as 9, 9 and 6.
    """
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.parallel import RowwiseParallel

    if any(
        isinstance(style, ColwiseParallel) and not style.use_local_output
        for style in tp_plan.values()
    ):
        return
    modules = dict(model.named_modules())
    for name, style in tp_plan.items():
        module = modules.get(name)
        if not (
            isinstance(style, RowwiseParallel)
            and isinstance(module, nn.Linear)
            and isinstance(style.input_layouts[0], Shard)
            and module.in_features % tp
        ):
            continue
        msg = (
            f"{_WHERE}: tp_plan[{name!r}] is RowwiseParallel on an nn.Linear with "
            f"in_features={module.in_features}, which tp={tp} does not divide (its "
            f"ranks hold {_shard_sizes(module.in_features, tp)}); torch sizes a local "
            f"input as {tp} equal shards, so the forward would fail. Hand it a "
            "DTensor: give the layer that feeds it ColwiseParallel(use_local_output"
            "=False); or choose sizes that tp divides."
        )
        raise ValueError(msg)


def check_mesh_wrapping(
    ctx: DistributedContext,
    model: nn.Module,
    mesh: ParallelMesh,
    tp_plan: object,
    fsdp: FSDPOptions | None,
    ddp_options_set: bool,
) -> None:
    """Refuse, before anything changes, a combination ``wrap_on_mesh`` cannot build.

    Raises:
        TypeError: a ``tp_plan`` that is not a mapping of names to parallel styles.
        ValueError: see ``wrap_model``.
        RuntimeError: several processes and a mesh without a ``DeviceMesh``.
    """
    _check_plan(mesh, tp_plan, model)
    if fsdp is None and mesh.dp_shard > 1:
        msg = (
            f"{_WHERE}: the mesh has dp_shard={mesh.dp_shard} (shape {mesh.shape}) "
            "but fsdp=None; pass fsdp=FSDPOptions() to shard over it, or build the "
            "mesh with dp_shard=1 to replicate."
        )
        raise ValueError(msg)
    if fsdp is not None and mesh.dp_size == 1 and ctx.num_processes > 1:
        msg = (
            f"{_WHERE}: fsdp was given but the mesh (shape {mesh.shape}) has one "
            "data-parallel rank, so there is nothing to shard over; pass fsdp=None "
            "for tensor parallelism only, or give the mesh dp_shard > 1."
        )
        raise ValueError(msg)
    if fsdp is not None:
        check_fsdp_options(ctx, fsdp, _WHERE, shard_size=mesh.dp_shard)
    if ddp_options_set and mesh.tp > 1:
        msg = (
            f"{_WHERE}: ddp_kwargs configure DDP, which a tensor-parallel mesh "
            f"(tp={mesh.tp}) does not use; pass ddp_kwargs=None."
        )
        raise ValueError(msg)
    if ctx.num_processes > 1 and mesh.device_mesh is None:
        msg = (
            f"{_WHERE}: the mesh (shape {mesh.shape}) has no DeviceMesh: it was "
            "built by hand or before the process group started; build it with "
            "build_mesh(ctx, ...) after build_context()."
        )
        raise RuntimeError(msg)


def wrap_on_mesh(
    ctx: DistributedContext,
    model: nn.Module,
    mesh: ParallelMesh,
    tp_plan: Mapping[str, Any] | None,
    fsdp: FSDPOptions | None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> nn.Module | None:
    """Parallelize ``model`` in place on ``mesh``; ``None`` when DDP should wrap it.

    ``check_mesh_wrapping`` has accepted the arguments, and ``ctx`` has several
    processes (so ``mesh.device_mesh`` exists).
    """
    device_mesh = mesh.device_mesh
    assert device_mesh is not None
    before = dict(model.named_parameters(remove_duplicate=False))
    wrapped = _parallelize(ctx, model, mesh, device_mesh, tp_plan, fsdp)
    if wrapped is not None:
        # Both tensor parallelism and FSDP2 replace parameters: re-point each
        # optimizer from the original parameters to the final ones, by name.
        rebind_by_name_(optimizers, before, wrapped)
    return wrapped


def _parallelize(
    ctx: DistributedContext,
    model: nn.Module,
    mesh: ParallelMesh,
    device_mesh: Any,
    tp_plan: Mapping[str, Any] | None,
    fsdp: FSDPOptions | None,
) -> nn.Module | None:
    if mesh.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        assert tp_plan is not None
        parallelize_module(model, device_mesh["tp"], dict(tp_plan))
    if mesh.dp_size == 1:
        return model
    if fsdp is None and mesh.tp == 1:
        return None  # dp_shard == 1: DDP over the whole world
    if mesh.dp_replicate > 1:
        dp_mesh = device_mesh["dp_replicate", "dp_shard"]
    else:
        dp_mesh = device_mesh["dp_shard"]
    # Replication of a tensor-parallel model: shards of one rank, nothing to free.
    options = FSDPOptions(reshard_after_forward=False) if fsdp is None else fsdp
    return shard_model(ctx, model, options, device_mesh=dp_mesh)
