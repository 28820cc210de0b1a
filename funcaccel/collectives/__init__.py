"""Collectives over nested tensors: gather, broadcast, reduce, pad, gather for metrics.

``_ops.py`` holds the public functions; ``_exchange.py`` what ranks agree on before
moving tensors; ``_pad.py`` the padding arithmetic; ``_primitives.py`` the
communication device and the raw collectives on it (the in-place broadcast that
the loader and RNG sync build on, ``all_reduce_ints`` for every count and flag
funcaccel sends);
``_process_sync.py`` barriers, flags agreed across ranks and
``split_between_processes``;
``_guard.py`` the check, under ``ctx.collective_timeout``, that every rank reached
the same collective (``guard_collective``, for every function that communicates).
"""

from __future__ import annotations

from funcaccel.collectives._guard import guard_collective
from funcaccel.collectives._ops import BatchInfo
from funcaccel.collectives._ops import Reduction
from funcaccel.collectives._ops import broadcast
from funcaccel.collectives._ops import broadcast_object
from funcaccel.collectives._ops import gather
from funcaccel.collectives._ops import gather_for_metrics
from funcaccel.collectives._ops import gather_object
from funcaccel.collectives._ops import pad_across_processes
from funcaccel.collectives._ops import reduce
from funcaccel.collectives._pad import pad_tensor
from funcaccel.collectives._primitives import all_reduce_ints
from funcaccel.collectives._primitives import broadcast_
from funcaccel.collectives._primitives import comm_device
from funcaccel.collectives._process_sync import all_processes
from funcaccel.collectives._process_sync import any_process
from funcaccel.collectives._process_sync import exchange_codes
from funcaccel.collectives._process_sync import padded_count
from funcaccel.collectives._process_sync import split_between_processes
from funcaccel.collectives._process_sync import wait_for_everyone

__all__ = [
    "all_processes",
    "all_reduce_ints",
    "any_process",
    "exchange_codes",
    "padded_count",
    "split_between_processes",
    "wait_for_everyone",
    "BatchInfo",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "comm_device",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "guard_collective",
    "pad_across_processes",
    "pad_tensor",
    "reduce",
    "Reduction",
]
