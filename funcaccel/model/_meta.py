"""Models built on the ``meta`` device: ``materialize_meta``, one module at a time.

A model built under ``with torch.device("meta"):`` (or Accelerate's
``init_empty_weights``) has the shapes of its parameters but no storage.
``wrap_model`` shards it first (tensor parallelism, FSDP2: both work on meta
tensors), then materialises it here (``wrap_materialized``): every module that holds a meta parameter or
buffer of its own is visited in ``model.modules()`` order; its own tensors are
built **in full** on ``ctx.device`` and initialised (``init_fn(module)``, else
``module.reset_parameters()``), and each sharded (``DTensor``) parameter keeps
only this rank's part of the full value, taken without communication
(``distribute_tensor(full, mesh, placements, src_data_rank=None)``). The full
values are then dropped, so a rank holds at most one module's own tensors in full
besides its shards.

**Same values as building it whole.** Every rank draws the full values from the
global RNG in the same order, so with the same seed on every rank each rank's
shard is the slice of one and the same full model, and that model equals
building it whole on the CPU and running ``init_fn`` (or ``reset_parameters``)
on each module in ``model.modules()`` order. Standard layers initialise
themselves in their constructors in that order (children registered in
``__init__`` order), so ``torch.manual_seed(0); Net()`` and
``torch.manual_seed(0)`` followed by building ``Net()`` on meta and
``wrap_model`` give the same parameters. Drawing the values on the shards
instead would not: a random op on a shard draws different numbers than the same
op on the whole tensor.

With 2 FSDP2 ranks and ``nn.Linear(4, 8)`` on meta, both ranks draw the full
``8 x 4`` weight with ``reset_parameters``; rank 0 keeps rows 0-3, rank 1 rows
4-7, and the bias likewise; the full tensors are freed before the next module.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Final

import torch
from torch import nn

from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_dtensor
from funcaccel.context import DistributedContext
from funcaccel.model._rebind import as_optimizers
from funcaccel.model._rebind import rebind_by_name_

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "check_meta_init",
    "has_meta_tensors",
    "materialize_",
    "materialize_meta",
    "place_",
    "wrap_materialized",
]

_INIT_FN: Final = (
    "Pass init_fn=, a function that initialises one module's own parameters and "
    "buffers in place, or build the model on a real device."
)


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [
        *module.parameters(recurse=False),
        *(b for b in module.buffers(recurse=False) if b is not None),
    ]


def has_meta_tensors(model: nn.Module) -> bool:
    """Return whether any parameter or buffer of ``model`` is on the ``meta`` device.

    >>> with torch.device("meta"):
    ...     net = nn.Linear(2, 1)
    >>> has_meta_tensors(net), has_meta_tensors(nn.Linear(2, 1))
    (True, False)
    """
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _meta_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules(remove_duplicate=True)
        if any(t.is_meta for t in _own_tensors(module))
    ]


def check_meta_init(caller: str, model: nn.Module, init_fn: object) -> None:
    """Refuse, before anything changes, a meta model that cannot be initialised.

    A model without meta tensors passes whatever ``init_fn`` is, if callable.

    Raises:
        TypeError: ``init_fn`` is neither ``None`` nor callable.
        ValueError: ``init_fn`` is ``None`` and a module holding meta tensors of
            its own has no ``reset_parameters``; the message names it.
    """
    if init_fn is not None and not callable(init_fn):
        fail_type(caller, "init_fn", init_fn, "a function of one module or None")
    for name, module in _meta_modules(model) if init_fn is None else ():
        where = f"{name!r}" if name else "the root module"
        kind = type(module).__name__
        what = f"given: the model is on meta, and its module {where} ({kind}) has no reset_parameters()"
        if not callable(getattr(module, "reset_parameters", None)):
            fail_value(caller, "init_fn", init_fn, what, _INIT_FN)


def place_(model: nn.Module, device: torch.device) -> None:
    """Move ``model`` to ``device`` in place, as ``.to`` does, leaving meta tensors on meta."""
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device == device for t in tensors):
        # Nothing to move; fake tensors (estimate_memory) cannot be moved in place.
        return
    if not has_meta_tensors(model):
        model.to(device)
        return
    # model.to() cannot copy out of meta tensors; move the others one by one.
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if not param.is_meta and param.device != device:
                param.data = param.data.to(device)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def _initialise(module: nn.Module, init_fn: Callable[[nn.Module], None] | None) -> None:
    with torch.no_grad():
        if init_fn is not None:
            init_fn(module)
        else:
            module.reset_parameters()  # type: ignore[operator]


def materialize_(
    model: nn.Module,
    device: torch.device,
    init_fn: Callable[[nn.Module], None] | None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> None:
    """Give every meta tensor of ``model`` storage on ``device`` and initialise it, in place.

    ``check_meta_init`` has accepted ``model`` and ``init_fn``. A ``DTensor``
    parameter (tensor parallelism, FSDP2) receives only this rank's part of its
    full initial value; other tensors the full value. Modules without meta
    tensors of their own are left as they are. ``to_empty`` replaces the
    parameters, so ``optimizers`` are re-pointed at the new ones by name.
    """
    before = dict(model.named_parameters(remove_duplicate=False))
    for _, module in _meta_modules(model):
        module.to_empty(device=device, recurse=False)
        sharded: dict[str, DTensor] = {}
        for name, param in list(module.named_parameters(recurse=False)):
            if is_dtensor(param):
                sharded[name] = param
                full = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = nn.Parameter(full, param.requires_grad)
        _initialise(module, init_fn)
        if sharded:
            _keep_local_parts_(module, sharded)
    rebind_by_name_(optimizers, before, model)


def _keep_local_parts_(module: nn.Module, sharded: dict[str, DTensor]) -> None:
    """Copy this rank's part of each full stand-in into its ``DTensor``; put it back."""
    from torch.distributed.tensor import distribute_tensor

    for name, param in sharded.items():
        full = module._parameters[name]
        assert full is not None
        # src_data_rank=None: each rank slices its own (identical) full value.
        local = distribute_tensor(
            full.detach(), param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        with torch.no_grad():
            param.to_local().copy_(local)
        assert isinstance(param, nn.Parameter)
        module._parameters[name] = param


def materialize_meta(
    ctx: DistributedContext,
    model: nn.Module,
    init_fn: Callable[[nn.Module], None] | None = None,
    *,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
) -> nn.Module:
    """Give ``model``'s ``meta`` tensors storage on ``ctx.device`` and initialise them, in place.

    Each module holding meta parameters or buffers of its own, in
    ``model.modules()`` order, gets them in full, is initialised by
    ``init_fn(module)`` (under ``torch.no_grad()``; ``None``: its
    ``reset_parameters()``), and each sharded (``DTensor``) parameter keeps only
    this rank's part. With the same seed on every rank the values equal those of
    building the model whole. Call it after ``wrap_fsdp`` / ``wrap_mesh``, so that
    only this rank's shards get storage, or before ``wrap_ddp``, which needs the
    whole model. Modules without meta tensors, and a model with none, are left
    as they are; ``optimizers`` built on the meta parameters are re-pointed at
    the new ones. docs/mesh.md has the details.

    With 2 FSDP2 ranks and ``nn.Linear(4, 8)`` on meta, both ranks draw the full
    8 x 4 weight; rank 0 keeps rows 0-3 and rank 1 rows 4-7.

    Args:
        ctx: the distributed context (its ``device``).
        model: a module, sharded or not; changed in place.
        init_fn: initialises one module's own parameters and buffers in place.
        optimizers: optimizers built on ``model``'s meta parameters.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: ``init_fn`` is ``None`` and a module with meta tensors has no
            ``reset_parameters()``.

    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> with torch.device("meta"):
    ...     net = nn.Linear(2, 1)
    >>> materialize_meta(DistributedContext(), net).weight.is_meta
    False
    """
    caller = "materialize_meta"
    check_context(caller, ctx)
    model = check_type(caller, "model", model, nn.Module, what="a torch.nn.Module")
    opts = as_optimizers(caller, optimizers)
    check_meta_init(caller, model, init_fn)
    materialize_(model, ctx.device, init_fn, opts)
    return model


def wrap_materialized(
    ctx: DistributedContext,
    model: nn.Module,
    init_fn: Callable[[nn.Module], None] | None,
    optimizers: Sequence[torch.optim.Optimizer],
    wrap: Callable[[nn.Module], nn.Module],
    *,
    shards: bool,
) -> nn.Module:
    """Place ``model`` on ``ctx.device`` and return ``wrap(model)``, meta tensors given storage.

    ``check_meta_init`` has accepted ``model`` and ``init_fn``. A meta model is
    materialised after ``wrap`` when it ``shards`` a model that trains (so only
    this rank's shards get storage), else whole before it.
    """
    meta = has_meta_tensors(model)
    later = meta and shards and any(p.requires_grad for p in model.parameters())
    if meta and not later:
        materialize_(model, ctx.device, init_fn, optimizers)
    place_(model, ctx.device)
    wrapped = wrap(model)
    if later:
        materialize_(wrapped, ctx.device, init_fn, optimizers)
    return wrapped
