"""``wrap_mesh``: a model on a ``ParallelMesh``; tensor parallelism, then data parallelism.

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
from typing import Final

import torch
from torch import nn

from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import summary
from funcaccel._dist_types import is_instance_if_loaded
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.kwargs import DistributedDataParallelKwargs
from funcaccel.mesh import ParallelMesh
from funcaccel.mesh import check_mesh
from funcaccel.model._ddp import changed_fields
from funcaccel.model._ddp import check_ddp
from funcaccel.model._ddp import ddp_
from funcaccel.model._ddp import refuse_meta
from funcaccel.model._fsdp import FSDP_OR_NONE
from funcaccel.model._fsdp import FSDPOptions
from funcaccel.model._fsdp import check_fsdp_options
from funcaccel.model._fsdp import shard_model
from funcaccel.model._meta import place_
from funcaccel.model._rebind import as_optimizers
from funcaccel.model._rebind import rebind_by_name_
from funcaccel.model._wrappers import check_unwrapped

__all__ = [
    "check_mesh_setup",
    "check_mesh_wrapping",
    "mesh_",
    "shard_over_dp",
    "wrap_mesh",
]

_PLAN_EXAMPLE: Final = (
    "Pass e.g. tp_plan={'up': ColwiseParallel(), 'down': RowwiseParallel()}."
)
_STYLE_TYPE: Final = ("torch.distributed.tensor.parallel.style", "ParallelStyle")
_STYLE: Final = "a torch.distributed.tensor.parallel ParallelStyle"
_STYLE_EXAMPLE: Final = "Use ColwiseParallel(), RowwiseParallel(), ..."
_SHARD_OR_REPLICATE: Final = (
    "Pass fsdp=FSDPOptions() to shard over it, or build the mesh with dp_shard=1 "
    "to replicate."
)
_TP_ONLY: Final = (
    "Pass fsdp=None for tensor parallelism only, or give the mesh dp_shard > 1."
)


def _check_plan(
    caller: str, mesh: ParallelMesh, tp_plan: object, model: nn.Module
) -> None:
    on_tp1 = f"None on a mesh with tp=1 (shape {mesh.shape})"
    if mesh.tp == 1 and tp_plan is not None:
        fail_value(caller, "tp_plan", tp_plan, on_tp1, "Build the mesh with tp > 1.")
    if mesh.tp == 1:
        return
    styles = f"a mapping of module names to torch parallel styles (the mesh has tp={mesh.tp})"
    if tp_plan is None or (isinstance(tp_plan, Mapping) and not tp_plan):
        fail_value(caller, "tp_plan", tp_plan, styles, _PLAN_EXAMPLE)
    plan = check_type(
        caller, "tp_plan", tp_plan, Mapping, what=styles, hint=_PLAN_EXAMPLE
    )
    names = [name for name, _ in model.named_modules()]
    submodule = (
        f"a submodule's name or a pattern with '*'; the model has {summary(names[1:])}"
    )
    for name, style in plan.items():
        check_type(caller, "every tp_plan key", name, str, what="a module name (str)")
        if not is_instance_if_loaded(style, *_STYLE_TYPE):
            fail_type(caller, f"tp_plan[{name!r}]", style, _STYLE, _STYLE_EXAMPLE)
        if "*" not in name and name not in names:
            fail_value(caller, "every tp_plan key", name, submodule)
    _check_uneven_rows(caller, mesh.tp, plan, model)


def _shard_sizes(size: int, parts: int) -> list[int]:
    """The sizes of torch's ``Shard`` pieces of ``size`` over ``parts`` ranks.

    >>> _shard_sizes(8, 3), _shard_sizes(8, 2), _shard_sizes(4, 3)
    ([3, 3, 2], [4, 4], [2, 2, 0])
    """
    chunk = -(-size // parts)
    return [max(0, min(chunk, size - i * chunk)) for i in range(parts)]


def _check_uneven_rows(
    caller: str, tp: int, tp_plan: Mapping[str, Any], model: nn.Module
) -> None:
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
            f"{caller}: tp_plan[{name!r}] is RowwiseParallel on an nn.Linear with "
            f"in_features={module.in_features}, which tp={tp} does not divide (its "
            f"ranks hold {_shard_sizes(module.in_features, tp)}); torch sizes a local "
            f"input as {tp} equal shards, so the forward would fail. Hand it a "
            "DTensor: give the layer that feeds it ColwiseParallel(use_local_output"
            "=False); or choose sizes that tp divides."
        )
        raise ValueError(msg)


def check_mesh_wrapping(
    caller: str,
    ctx: DistributedContext,
    model: nn.Module,
    mesh: ParallelMesh,
    tp_plan: object,
    fsdp: FSDPOptions | None,
    kwargs: DistributedDataParallelKwargs,
) -> None:
    """Refuse, before anything changes, a combination ``wrap_on_mesh`` cannot build.

    Raises:
        TypeError: a ``tp_plan`` that is not a mapping of names to parallel styles.
        ValueError: see ``wrap_mesh``.
        RuntimeError: several processes and a mesh without a ``DeviceMesh``.
    """
    shape = f"shape {mesh.shape}"
    if mesh.pp > 1:
        staged = (
            f"a mesh with pp=1 here ({shape}): pipeline stages are cut by wrap_model"
        )
        hint = "Pass wrap_model(ctx, model, mesh=mesh, pipeline=PipelineOptions(...))."
        fail_value(caller, "mesh", mesh, staged, hint)
    _check_plan(caller, mesh, tp_plan, model)
    unsharded = f"an FSDPOptions on a mesh with dp_shard > 1 ({shape})"
    if fsdp is None and mesh.dp_shard > 1:
        fail_value(caller, "fsdp", fsdp, unsharded, _SHARD_OR_REPLICATE)
    one_rank = f"None on a mesh with one data-parallel rank ({shape}): nothing to shard"
    if fsdp is not None and mesh.dp_size == 1 and ctx.num_processes > 1:
        fail_value(caller, "fsdp", fsdp, one_rank, _TP_ONLY)
    if fsdp is not None:
        check_fsdp_options(caller, ctx, fsdp, shard_size=mesh.dp_shard)
    no_ddp = f"None on a tensor-parallel mesh (tp={mesh.tp}), which DDP does not wrap"
    if kwargs != DistributedDataParallelKwargs() and mesh.tp > 1:
        fail_value(caller, "ddp_kwargs", changed_fields(kwargs), no_ddp)
    if ctx.num_processes > 1 and mesh.device_mesh is None:
        msg = f"{caller}: the mesh ({shape}) has no DeviceMesh: it was built by hand or before the process group started; build it with build_mesh(ctx, ...) after build_context()."
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
    return shard_over_dp(ctx, model, mesh, device_mesh, fsdp)


def shard_over_dp(
    ctx: DistributedContext,
    model: nn.Module,
    mesh: ParallelMesh,
    device_mesh: Any,
    fsdp: FSDPOptions | None,
) -> nn.Module:
    """Shard ``model`` in place with FSDP2 / HSDP over ``mesh``'s data-parallel dims.

    ``fsdp=None`` replicates it instead (dp_shard is 1 then): shards of one rank,
    nothing freed after forward, gradients all-reduced over ``dp_replicate``.
    """
    if mesh.dp_replicate > 1:
        dp_mesh = device_mesh["dp_replicate", "dp_shard"]
    else:
        dp_mesh = device_mesh["dp_shard"]
    options = FSDPOptions(reshard_after_forward=False) if fsdp is None else fsdp
    return shard_model(ctx, model, options, device_mesh=dp_mesh)


def check_mesh_setup(
    caller: str,
    ctx: DistributedContext,
    model: nn.Module,
    mesh: object,
    tp_plan: object,
    fsdp: FSDPOptions | None,
    kwargs: DistributedDataParallelKwargs,
) -> ParallelMesh:
    """Return ``mesh`` after refusing, before anything changes, what ``mesh_`` cannot build.

    Raises:
        TypeError, ValueError, RuntimeError: see ``wrap_mesh``.
    """
    mesh = check_mesh(caller, ctx, mesh)
    check_mesh_wrapping(caller, ctx, model, mesh, tp_plan, fsdp, kwargs)
    if fsdp is None:
        check_ddp(caller, ctx, kwargs)
    elif ctx.num_processes > 1:
        require_process_group(ctx, caller)
    return mesh


def mesh_(
    ctx: DistributedContext,
    mesh: ParallelMesh,
    tp_plan: Mapping[str, Any] | None,
    fsdp: FSDPOptions | None,
    kwargs: DistributedDataParallelKwargs,
    optimizers: Sequence[torch.optim.Optimizer],
    model: nn.Module,
) -> nn.Module:
    """Parallelize ``model`` on ``mesh`` (see ``wrap_mesh``); DDP where it only replicates.

    ``model`` comes last, so that ``wrap_model`` can bind the rest beforehand.
    """
    if ctx.num_processes == 1:
        return model
    wrapped = wrap_on_mesh(ctx, model, mesh, tp_plan, fsdp, optimizers)
    return ddp_(ctx, kwargs, model) if wrapped is None else wrapped


def wrap_mesh(
    ctx: DistributedContext,
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    tp_plan: Mapping[str, Any] | None = None,
    fsdp: FSDPOptions | None = None,
    ddp_kwargs: DistributedDataParallelKwargs | None = None,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
) -> nn.Module:
    """Move ``model`` to ``ctx.device`` and parallelize it in place on ``mesh``.

    ``tp_plan`` (module name or ``fnmatch`` pattern -> torch parallel style) is
    applied first with ``parallelize_module(model, mesh["tp"], tp_plan)``; then
    FSDP2 shards over ``mesh["dp_shard"]`` (HSDP over ``["dp_replicate",
    "dp_shard"]`` when ``dp_replicate > 1``); with ``fsdp=None`` a mesh that only
    replicates gets DDP (``ddp_kwargs``), or, when ``tp > 1``, FSDP2 shards of one
    rank (DDP cannot hold ``DTensor`` parameters). ``optimizers`` are re-pointed at
    the new parameters. A ``meta`` model is sharded as it is: give this rank's
    shards storage afterwards with ``materialize_meta``. ``wrap_model(ctx, model,
    mesh=..., tp_plan=..., fsdp=...)`` does the same and materialises for you.

    With 4 ranks, ``build_mesh(ctx, dp_shard=2, tp=2)``, ``fsdp=FSDPOptions()`` and
    ``tp_plan={"up": ColwiseParallel(), "down": RowwiseParallel()}`` on an 8-row
    ``up``: rank 1 holds rows 4-5 of ``up.weight`` (tensor-parallel half 1, FSDP
    shard 0) and rank 2 rows 2-3 (half 0, shard 1). docs/mesh.md has more.

    Args:
        ctx: the distributed context.
        model: the user's module, not wrapped yet; changed in place.
        mesh: ``build_mesh(ctx, ...)`` of this context.
        tp_plan: required exactly when ``mesh.tp > 1``.
        fsdp: FSDP2 options; required when ``mesh.dp_shard > 1``.
        ddp_kwargs: DDP options where the mesh replicates with DDP.
        optimizers: optimizers already built on ``model``'s parameters.

    Returns:
        ``model``, parallelized in place, or a DDP module wrapping it.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: what does not fit the mesh (docs/model.md lists it).
        RuntimeError: several processes and no process group or ``DeviceMesh``.

    >>> from funcaccel.context import DistributedContext
    >>> net, one = nn.Linear(2, 1), DistributedContext()
    >>> wrap_mesh(one, net, ParallelMesh()) is net  # one process: nothing to do
    True
    """
    caller, kind = "wrap_mesh", DistributedDataParallelKwargs
    model = check_unwrapped(caller, ctx, model)
    check_type(caller, "fsdp", fsdp, FSDPOptions, what=FSDP_OR_NONE, optional=True)
    kwargs = check_type(caller, "ddp_kwargs", ddp_kwargs, kind, optional=True)
    opts = as_optimizers(caller, optimizers)
    kwargs = kind() if kwargs is None else kwargs
    mesh = check_mesh_setup(caller, ctx, model, mesh, tp_plan, fsdp, kwargs)
    if fsdp is None and mesh.tp == 1 and mesh.dp_size > 1:
        refuse_meta(caller, model)  # DDP replicates the whole model
    place_(model, ctx.device)
    return mesh_(ctx, mesh, tp_plan, fsdp, kwargs, opts, model)
