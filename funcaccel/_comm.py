"""The few collectives the loader needs: RNG-state sync and tensor broadcast.

Every function here takes the context; with one process none of them communicates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final
from typing import Literal

import torch
import torch.distributed as dist

from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group

__all__ = ["RNG_TYPES", "RngType", "broadcast_", "comm_device", "sync_rng_states"]

RngType = Literal["torch", "cuda", "generator"]
"""A random generator ``shard_loader`` can synchronise from rank 0."""

RNG_TYPES: Final[tuple[RngType, ...]] = ("torch", "cuda", "generator")

_CPU: Final = torch.device("cpu")


def comm_device(ctx: DistributedContext) -> torch.device:
    """Return the device tensors must be on to travel through the default group.

    NCCL moves only CUDA tensors (``ctx.device``); gloo and the others take CPU ones.
    Needs an initialised default group when ``ctx.num_processes > 1``.

    >>> comm_device(DistributedContext()).type
    'cpu'
    """
    if ctx.num_processes > 1 and dist.get_backend() == "nccl":
        return ctx.device
    return _CPU


def broadcast_(ctx: DistributedContext, tensor: torch.Tensor) -> torch.Tensor:
    """Overwrite ``tensor`` in place with rank 0's values and return it.

    ``tensor`` must be contiguous, on ``comm_device(ctx)``, and have the same shape
    and dtype on every rank. Empty tensors are not sent (every rank skips them
    alike, since the shapes agree).
    """
    if ctx.num_processes > 1 and tensor.numel() > 0:
        dist.broadcast(tensor, src=0)
    return tensor


def _broadcast_state(ctx: DistributedContext, state: torch.Tensor) -> torch.Tensor:
    buffer = state.to(comm_device(ctx), copy=True).contiguous()
    return broadcast_(ctx, buffer).cpu()


def sync_rng_states(
    ctx: DistributedContext,
    rng_types: Sequence[RngType],
    generator: torch.Generator | None,
    *,
    caller: str,
) -> None:
    """Set the named generators of every rank to rank 0's states (SPEC §4.2 step 1).

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
