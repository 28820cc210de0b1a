"""Set every rank's random generators to rank 0's states.

``shard_loader`` calls ``sync_rng_states`` at the start of each epoch for the
``rng_types`` it was given; users can call it directly for their own generators.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from funcaccel._checks import check_type
from funcaccel._ctx_checks import check_context
from funcaccel._guard import guard_collective
from funcaccel._primitives import comm_device
from funcaccel._rng_types import check_rng_types
from funcaccel._typing import RngType
from funcaccel.collectives import broadcast_
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group

__all__ = ["sync_rng_states"]


def _broadcast_state(ctx: DistributedContext, state: torch.Tensor) -> torch.Tensor:
    buffer = state.to(comm_device(ctx), copy=True).contiguous()
    return broadcast_(ctx, buffer).cpu()


def sync_rng_states(
    ctx: DistributedContext,
    rng_types: Sequence[RngType],
    generator: torch.Generator | None = None,
    *,
    caller: str = "sync_rng_states",
) -> None:
    """Set the named generators of every rank to rank 0's states.

    The rules: docs/loader.md#semantics-epoch-order-and-rng-synchronisation step 1.

    ``"torch"`` is torch's default CPU generator, ``"cuda"`` the generator of
    ``ctx.device`` and ``"generator"`` is ``generator`` (skipped when ``None``).
    Nothing happens with one process, or when nothing is left to synchronise.
    Changes the generators' states in place.

    With two ranks seeded differently (rank 0 ``torch.manual_seed(0)``, rank 1
    ``torch.manual_seed(1)``), after ``sync_rng_states(ctx, ["torch"])`` a
    ``torch.rand(1)`` returns rank 0's value on both ranks. It is a collective:
    call it on every rank (``ctx.collective_timeout`` bounds the wait).

    Raises:
        TypeError: ``ctx`` is not a context, ``rng_types`` not a sequence of
            names, or ``generator`` not a ``torch.Generator``.
        ValueError: a name other than ``"torch"``, ``"cuda"`` or ``"generator"``,
            or ``"cuda"`` on a context whose device is not a GPU.
        RuntimeError: ``ctx.num_processes > 1`` and no matching default group.

    >>> sync_rng_states(DistributedContext(), ["torch"])  # one process: nothing to do
    """
    check_context(caller, ctx)
    names_given = check_rng_types(caller, rng_types, ctx)
    what = "a torch.Generator or None"
    check_type(
        caller, "generator", generator, torch.Generator, what=what, optional=True
    )
    names = [name for name in names_given if name != "generator" or generator]
    if ctx.num_processes == 1 or not names:
        return
    require_process_group(ctx, caller)
    guard_collective(ctx, caller)
    for name in names:
        if name == "torch":
            torch.set_rng_state(_broadcast_state(ctx, torch.get_rng_state()))
        elif name == "cuda":
            state = torch.cuda.get_rng_state(ctx.device)
            torch.cuda.set_rng_state(_broadcast_state(ctx, state), ctx.device)
        elif generator is not None:
            generator.set_state(_broadcast_state(ctx, generator.get_state()))
