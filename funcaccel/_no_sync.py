"""The one context that switches gradient synchronisation off for some models.

``no_sync_models(caller, models)`` is entered by ``funcaccel.no_sync``, by
``sync_ctx`` and by ``accumulate_step`` on a micro-step that skips its sync: each
DDP module runs under its ``no_sync()``, each FSDP2 module with
``set_requires_gradient_sync(False)``. It lives in its own module, below both
``funcaccel.accumulate`` and ``funcaccel.sync``, so that ``import funcaccel``
(which loads ``accumulate``) still leaves ``funcaccel.sync`` unloaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING
from typing import Final

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from funcaccel._checks import fail_value
from funcaccel._compile import inside_compile
from funcaccel._dist_types import is_fsdp_module

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["no_sync_models"]

# Where wrap_model keeps FSDPOptions.accumulation_comm on a sharded root (the
# value of funcaccel.model._fsdp.ACCUMULATION_COMM_ATTRIBUTE, which this lower
# tier cannot import).
_COMM_ATTRIBUTE: Final = "_funcaccel_accumulation_comm"
_STATIC_GRAPH: Final = (
    "False to skip the gradient all-reduce (torch fails inside no_sync())"
)
_STATIC_FIX: Final = (
    "Build it with static_graph=False, or, with accumulate_step or sync_ctx, "
    "all-reduce on every micro-step with GradState(..., sync_each_batch=True)."
)


def no_sync_models(
    caller: str, models: tuple[nn.Module, ...]
) -> AbstractContextManager[None]:
    """Return the one context that switches gradient sync off for ``models``.

    ``no_sync``, ``sync_ctx`` and ``accumulate_step`` all enter this one (the
    last two only on a micro-step that skips its sync; the checks are theirs).
    Each DDP module (inside ``torch.compile``'s wrapper too) enters its
    ``no_sync()``; each FSDP2 module follows the ``FSDPOptions.accumulation_comm``
    it was sharded with: ``"defer_all"`` (the default) switches it to
    ``set_requires_gradient_sync(False)``, ``"defer_replica_all_reduce"`` to
    ``set_requires_all_reduce(False)`` (both set back to ``True`` on exit, on
    error too), ``"reduce_scatter_each_step"`` leaves it syncing; other modules
    are untouched. A single model, the usual case, gets its
    own context directly, without an ``ExitStack``, as this runs per micro-step.

    Raises:
        ValueError: a DDP module built with ``static_graph=True``, which cannot
            skip its all-reduce.
    """
    if len(models) == 1:
        return _no_sync_one(caller, models[0])
    return _no_sync_all(caller, models)


def _no_sync_one(caller: str, wrapped: nn.Module) -> AbstractContextManager[None]:
    # The rules of this function are no_sync_models's docstring.
    model = inside_compile(wrapped)
    if isinstance(model, DistributedDataParallel):
        if model.static_graph:
            name = "the model's DDP static_graph"
            fail_value(caller, name, True, _STATIC_GRAPH, _STATIC_FIX)
        manager: AbstractContextManager[None] = model.no_sync()
        return manager
    if is_fsdp_module(model):
        comm = getattr(model, _COMM_ATTRIBUTE, "defer_all")
        if comm == "defer_all":
            return _fsdp_no_sync(model)
        if comm == "defer_replica_all_reduce":
            return _fsdp_no_replica_all_reduce(model)
        assert comm == "reduce_scatter_each_step", comm
    return contextlib.nullcontext()


@contextlib.contextmanager
def _no_sync_all(caller: str, models: tuple[nn.Module, ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for model in models:
            stack.enter_context(_no_sync_one(caller, model))
        yield


@contextlib.contextmanager
def _fsdp_no_replica_all_reduce(model: FSDPModule) -> Iterator[None]:
    try:  # as in _fsdp_no_sync
        model.set_requires_all_reduce(False)
        yield
    finally:
        model.set_requires_all_reduce(True)


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    try:  # entered before the switch, so that a switch failing half-way is undone
        model.set_requires_gradient_sync(False)
        yield
    finally:
        model.set_requires_gradient_sync(True)
