"""Switch gradient synchronisation off for a block, and back on for one backward.

``no_sync(ctx, model)`` is Accelerate's ``accelerator.no_sync(model)``: inside it
DDP skips its gradient all-reduce (FSDP2 its reduce-scatter), so gradients
accumulate locally. ``sync_in_backward(ctx, model)`` is Accelerate's
``trigger_sync_in_backward``: the backward run inside it all-reduces, even though
the forward passes ran in ``no_sync``. For plain accumulation prefer
``accumulate_step`` or ``sync_ctx``, which decide from a ``GradState`` and then
enter the same context as ``no_sync`` (``funcaccel._no_sync``).

With 2 ranks, two forward passes inside ``no_sync``, ``backward(loss_a)`` and
then ``backward(loss_b)`` inside ``sync_in_backward``: both ranks end with
``((ga0 + gb0) + (ga1 + gb1)) / 2``; without ``sync_in_backward`` rank ``r``
keeps its own ``ga_r + gb_r``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Final

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._compile import inside_compile
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_fsdp_module
from funcaccel._no_sync import no_sync_models
from funcaccel.context import DistributedContext

__all__ = ["no_sync", "sync_in_backward"]

_NOT_FSDP: Final = "a DDP or plain module, not an FSDP2 one"
_FSDP_FIX: Final = (
    "FSDP2 syncs according to set_requires_gradient_sync at backward time: run "
    "the last backward after leaving no_sync(ctx, model) instead."
)


def _check(caller: str, ctx: object, model: object) -> nn.Module:
    check_context(caller, ctx)
    module = check_type(caller, "model", model, nn.Module, what="an nn.Module")
    return inside_compile(module)


def no_sync(ctx: DistributedContext, model: nn.Module) -> AbstractContextManager[None]:
    """Return a context in which ``model``'s backward passes do not sync gradients.

    With several processes: DDP's ``model.no_sync()``; for an FSDP2 module,
    what its ``FSDPOptions.accumulation_comm`` says: by default
    ``set_requires_gradient_sync(False)``, set back to ``True`` on exit (on error
    too); ``"defer_replica_all_reduce"`` defers only HSDP's replica all-reduce,
    ``"reduce_scatter_each_step"`` keeps syncing (docs/fast_step.md). Other modules have no gradient sync to skip and get a null context, as
    does everything with one process. Run the forward passes inside it (DDP
    decides at forward time); the first backward after leaving it syncs the
    accumulated gradients.

    Per rank, with 2 ranks: ``backward`` inside leaves rank 0 with ``g0`` and
    rank 1 with ``g1``; one more forward and backward outside leaves both with
    ``(g0 + h0 + g1 + h1) / 2``.

    Raises:
        TypeError: ``ctx`` or ``model`` of the wrong type.
        ValueError: a DDP model built with ``static_graph=True``.
    """
    _check("no_sync", ctx, model)
    if ctx.num_processes == 1:
        return contextlib.nullcontext()
    return no_sync_models("no_sync", (model,))


@contextlib.contextmanager
def _ddp_sync(model: DistributedDataParallel) -> Iterator[None]:
    backward, forward = (
        model.require_backward_grad_sync,
        model.require_forward_param_sync,
    )
    model.require_backward_grad_sync = True
    model.require_forward_param_sync = True
    # The forward passes ran in no_sync, so DDP did not prepare its reducer for a
    # backward pass; prepare it here (as Accelerate does) so this one all-reduces.
    model.reducer.prepare_for_backward([])
    try:
        yield
    finally:
        model.require_backward_grad_sync = backward
        model.require_forward_param_sync = forward


def sync_in_backward(
    ctx: DistributedContext, model: nn.Module
) -> AbstractContextManager[None]:
    """Return a context whose backward pass syncs gradients after forwards in ``no_sync``.

    For a DDP ``model`` with several processes: sets
    ``require_backward_grad_sync`` and ``require_forward_param_sync`` to ``True``
    and prepares DDP's reducer, restoring both flags on exit. Run exactly one
    backward inside it, the last of the window: it all-reduces the gradients
    accumulated so far (earlier backwards included). A module that is not DDP
    gets a null context (nothing syncs), as does everything with one process.

    Per rank, with 2 ranks: forwards ``a`` and ``b`` in ``no_sync``,
    ``backward(loss_a)``, then ``backward(loss_b)`` inside this: both ranks hold
    ``(ga0 + gb0 + ga1 + gb1) / 2``.

    Raises:
        TypeError: ``ctx`` or ``model`` of the wrong type, or an FSDP2 module
            (run its last backward after leaving ``no_sync`` instead: FSDP2
            decides at backward time).
    """
    inner = _check("sync_in_backward", ctx, model)
    if ctx.num_processes == 1:
        return contextlib.nullcontext()
    if isinstance(inner, DistributedDataParallel):
        return _ddp_sync(inner)
    if is_fsdp_module(inner):
        fail_type("sync_in_backward", "model", model, _NOT_FSDP, _FSDP_FIX)
    return contextlib.nullcontext()
