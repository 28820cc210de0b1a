"""What both kinds of shard share: the loop-back take.

``shard_batch_sampler`` and ``shard_iterable_dataset`` pad a last round from the
start of the epoch with ``take_cyclic`` (their argument checks, shared with
``shard_loader``, are ``funcaccel._world.check_world``).

>>> take_cyclic([0, 1, 2], 2, 4)
[2, 0, 1, 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = ["take_cyclic"]

_T = TypeVar("_T")


def take_cyclic(source: Sequence[_T], start: int, count: int) -> list[_T]:
    """Return ``count`` items of ``cycle(source)`` from position ``start``."""
    if not source:
        return []
    return [source[(start + t) % len(source)] for t in range(count)]
