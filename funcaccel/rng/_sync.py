"""Set every rank's random generators to rank 0's states.

``shard_loader`` calls ``sync_rng_states`` at the start of each epoch for the
``rng_types`` it was given; users can call it directly for their own generators.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from funcaccel._typing import RngType
from funcaccel.collectives import broadcast_
from funcaccel.collectives import comm_device
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

    With two ranks seeded differently, after the call ``torch.rand(1)`` returns
    rank 0's value on both ranks.

    Raises:
        RuntimeError: ``ctx.num_processes > 1`` and no matching default group.
    """
    names = [name for name in rng_types if name != "generator" or generator]
    if ctx.num_processes == 1 or not names:
        return
    require_process_group(ctx, caller)
    for name in names:
        if name == "torch":
            torch.set_rng_state(_broadcast_state(ctx, torch.get_rng_state()))
        elif name == "cuda":
            state = torch.cuda.get_rng_state(ctx.device)
            torch.cuda.set_rng_state(_broadcast_state(ctx, state), ctx.device)
        elif generator is not None:
            generator.set_state(_broadcast_state(ctx, generator.get_state()))
