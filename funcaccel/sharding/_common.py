"""What both kinds of shard share: the world-size checks and the loop-back take.

``shard_batch_sampler`` and ``shard_iterable_dataset`` check their arguments with
the same messages and pad a last round from the start of the epoch with
``take_cyclic``.

>>> take_cyclic([0, 1, 2], 2, 4)
[2, 0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from funcaccel._checks import check_bool
from funcaccel._checks import check_index
from funcaccel._checks import check_int

__all__ = ["check_world", "take_cyclic"]

_T = TypeVar("_T")


def check_world(
    where: str, num_processes: object, index: object, split: object, bs: int | None
) -> None:
    """Check ``num_processes``, ``process_index`` and the split batch size."""
    p = check_int(where, "num_processes", num_processes, 1)
    i = check_int(where, "process_index", index, 0)
    hint = f"pass this process's rank, below {p}."
    check_index(where, "process_index", i, "num_processes", p, hint)
    if check_bool(where, "split_batches", split) and (bs is None or bs % p):
        msg = (
            f"{where}: batch_size ({bs}) must be a multiple of num_processes ({p}) "
            f"when split_batches=True; use a batch size divisible by {p} or split_batches=False."
        )
        raise ValueError(msg)


def take_cyclic(source: Sequence[_T], start: int, count: int) -> list[_T]:
    """Return ``count`` items of ``cycle(source)`` from position ``start``."""
    if not source:
        return []
    return [source[(start + t) % len(source)] for t in range(count)]
