"""Collectives over nested tensors: gather, broadcast, reduce, pad, gather for metrics.

``_ops.py`` holds the public functions; ``_exchange.py`` what ranks agree on before
moving tensors; ``_pad.py`` the padding arithmetic; ``_process_sync.py`` barriers,
flags agreed across ranks and ``split_between_processes``. The plumbing every
package that communicates shares lives in private top-level modules:
``funcaccel._primitives`` (the communication device, the in-place ``broadcast_``
re-exported here, the int sums every count and flag travels in) and
``funcaccel._guard`` (the check, under ``ctx.collective_timeout``, that every rank
reached the same collective).
"""

from __future__ import annotations

from funcaccel._primitives import broadcast_
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
from funcaccel.collectives._process_sync import all_processes
from funcaccel.collectives._process_sync import any_process
from funcaccel.collectives._process_sync import padded_count
from funcaccel.collectives._process_sync import split_between_processes
from funcaccel.collectives._process_sync import wait_for_everyone

__all__ = [
    "all_processes",
    "any_process",
    "BatchInfo",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "pad_across_processes",
    "pad_tensor",
    "padded_count",
    "reduce",
    "Reduction",
    "split_between_processes",
    "wait_for_everyone",
]
