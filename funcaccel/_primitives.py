"""The communication device and the raw collectives other packages build on.

The loader's dispatch mode and the RNG sync send raw tensors from rank 0
(``broadcast_``); window item counts and per-rank codes are summed over ranks
(``all_reduce_ints``, ``exchange_codes``). With one process nothing is sent.
Private to funcaccel: ``funcaccel.collectives`` and the packages that communicate
import it; users get ``broadcast_`` from ``funcaccel.collectives``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch
import torch.distributed as dist

from funcaccel._guard import guard_collective
from funcaccel.context import DistributedContext

__all__ = ["all_reduce_ints", "broadcast_", "comm_device", "exchange_codes"]

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


def all_reduce_ints(
    ctx: DistributedContext, values: Sequence[int], *, caller: str
) -> list[int]:
    """Return the element-wise sum of ``values`` over every rank, on every rank.

    The one place funcaccel sends counts and flags: guarded under ``caller``'s
    name (``guard_collective``), then one all-reduce of an int64 tensor built on
    ``comm_device(ctx)`` (NCCL moves only CUDA tensors). Every rank passes as many
    values. With one process nothing is sent and no process group is needed.
    ``values`` is not modified; the caller has checked the process group.

    Args:
        ctx: the run's context.
        values: this rank's ints (each within int64).
        caller: the public function's name, for the guard's messages.

    Returns:
        A new list: ``values`` with one process, otherwise the sums over ranks.

    Example, with 2 ranks: rank 0 ``[3, 0]`` and rank 1 ``[4, 1]`` give
    ``[7, 1]`` on both.

    >>> all_reduce_ints(DistributedContext(), [3, 0], caller="example")
    [3, 0]
    """
    if ctx.num_processes == 1:
        return list(values)
    guard_collective(ctx, caller)
    tensor = torch.tensor(values, dtype=torch.int64, device=comm_device(ctx))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    sums: list[int] = tensor.tolist()
    return sums


def exchange_codes(ctx: DistributedContext, code: int, *, caller: str) -> list[int]:
    """Return every rank's ``code`` (a small int >= 0), indexed by rank.

    One ``all_reduce_ints`` of a ``num_processes``-long vector in which each rank
    fills only its own slot (``any_process``, ``main_process_first`` and
    ``find_executable_batch_size`` are built on it), guarded by
    ``ctx.collective_timeout`` under ``caller``'s name. The caller has checked
    the process group.

    >>> exchange_codes(DistributedContext(), 2, caller="example")
    [2]
    """
    slots = [0] * ctx.num_processes
    slots[ctx.process_index] = code
    return all_reduce_ints(ctx, slots, caller=caller)
