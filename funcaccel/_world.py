"""The world-size checks every sharding entry point makes, with one set of messages.

``shard_batch_sampler``, ``shard_iterable_dataset`` and ``shard_loader`` check
``num_processes``, ``process_index`` and a split batch size here, so the three
say the same thing about the same mistake.

>>> check_world("f", 2, 1, True, 4)
>>> check_world("f", 2, 1, True, 3)
Traceback (most recent call last):
ValueError: f: batch_size (3) must be a multiple of num_processes (2) when split_batches=True; use a batch size divisible by 2 or split_batches=False.
"""

from __future__ import annotations

from funcaccel._checks import check_bool
from funcaccel._checks import check_index
from funcaccel._checks import check_int

__all__ = ["check_world"]


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
