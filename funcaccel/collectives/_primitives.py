"""The in-place tensor broadcast and the communication device other packages build on.

The loader's dispatch mode and the RNG sync send raw tensors from rank 0; with one
process nothing is sent.
"""

from __future__ import annotations

from typing import Final

import torch
import torch.distributed as dist

from funcaccel.context import DistributedContext

__all__ = ["broadcast_", "comm_device"]

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
