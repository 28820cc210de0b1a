"""Models built on the ``meta`` device: materialised by ``wrap_model``, one module at a time.

A model built under ``with torch.device("meta"):`` (or Accelerate's
``init_empty_weights``) has the shapes of its parameters but no storage.
``wrap_model`` shards it first (tensor parallelism, FSDP2: both work on meta
tensors), then materialises it here: every module that holds a meta parameter or
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

import torch
from torch import nn

from funcaccel._checks import fail_type
from funcaccel._dist_types import is_dtensor
from funcaccel.model._fsdp import rebind_by_name_

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = ["check_meta_init", "has_meta_tensors", "materialize_"]


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
    if init_fn is not None:
        return
    for name, module in _meta_modules(model):
        if not callable(getattr(module, "reset_parameters", None)):
            where = repr(name) if name else "the root module"
            msg = (
                f"{caller}: the model is on the meta device, and its module {where} "
                f"({type(module).__name__}) holds meta tensors but has no "
                "reset_parameters(); pass init_fn=, a function that initialises "
                "one module's own parameters and buffers in place, or build the "
                "model on a real device."
            )
            raise ValueError(msg)


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
