"""Argument checks and the loop-back take shared by both kinds of shard.

``funcaccel.sharding`` (batch samplers) and ``funcaccel._iterable_shard`` (iterable
datasets) check their arguments with the same messages and pad a last round from
the start of the epoch with ``_take_cyclic``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

_T = TypeVar("_T")


def _check_int(where: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        msg = f"{where}: {name} must be an int, got {value!r} of type {type(value).__name__}; pass an int >= {minimum}."
        raise TypeError(msg)
    if value < minimum:
        msg = f"{where}: {name} ({value}) must be >= {minimum}; pass a larger value."
        raise ValueError(msg)
    return value


def _check_bool(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        msg = f"{where}: {name} must be a bool, got {value!r} of type {type(value).__name__}; pass True or False."
        raise TypeError(msg)
    return value


def _check_world(
    where: str, num_processes: object, index: object, split: object, bs: int | None
) -> None:
    """Check ``num_processes``, ``process_index`` and the split batch size."""
    p = _check_int(where, "num_processes", num_processes, 1)
    i = _check_int(where, "process_index", index, 0)
    if i >= p:
        msg = f"{where}: process_index ({i}) must be in [0, num_processes={p}); pass this process's rank, below {p}."
        raise ValueError(msg)
    if _check_bool(where, "split_batches", split) and (bs is None or bs % p):
        msg = (
            f"{where}: batch_size ({bs}) must be a multiple of num_processes ({p}) "
            f"when split_batches=True; use a batch size divisible by {p} or split_batches=False."
        )
        raise ValueError(msg)


def _take_cyclic(source: Sequence[_T], start: int, count: int) -> list[_T]:
    """Return ``count`` items of ``cycle(source)`` from position ``start``."""
    if not source:
        return []
    return [source[(start + t) % len(source)] for t in range(count)]
