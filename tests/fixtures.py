"""Shared test fixtures: hand-built rank contexts and small recording datasets.

``rank_ctx`` describes any rank of any world without a process group, so pure code
(sharding, scheduling, gating) can be checked for every rank in one process. The
datasets yield their own indices as tensors: ``Indexed`` (map-style, records every
fetch), ``Stream`` (iterable, no ``len()``) and ``SizedStream`` (iterable, sized).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypedDict

import torch
from torch.utils.data import Dataset
from torch.utils.data import IterableDataset
from typing_extensions import Unpack

from funcaccel._typing import MixedPrecision
from funcaccel.context import DistributedContext
from funcaccel.context import DistributedType

__all__ = ["ContextFields", "Indexed", "SizedStream", "Stream", "rank_ctx"]


class ContextFields(TypedDict, total=False):
    """The ``DistributedContext`` fields ``rank_ctx`` passes through unchanged."""

    local_process_index: int
    device: torch.device
    distributed_type: DistributedType
    mixed_precision: MixedPrecision
    backend: str | None


def rank_ctx(
    num_processes: int = 1, process_index: int = 0, **fields: Unpack[ContextFields]
) -> DistributedContext:
    """A hand-built context for rank ``process_index`` of ``num_processes``.

    No process group is created: code that needs one refuses the context.
    ``distributed_type`` is ``MULTI_CPU`` when ``num_processes > 1`` and ``NO``
    otherwise, ``local_process_index`` is ``process_index`` (one machine), and any
    other field (``device``, ``mixed_precision``, ``backend``, or these two
    overridden) is passed to ``DistributedContext`` as given.

    >>> rank_ctx() == DistributedContext()
    True
    >>> ctx = rank_ctx(4, 3)
    >>> ctx.distributed_type.name, ctx.local_process_index, ctx.is_last_process
    ('MULTI_CPU', 3, True)
    >>> rank_ctx(2, 1, local_process_index=0).is_local_main_process
    True
    """
    fields.setdefault("local_process_index", process_index)
    fields.setdefault(
        "distributed_type",
        DistributedType.MULTI_CPU if num_processes > 1 else DistributedType.NO,
    )
    return DistributedContext(
        num_processes=num_processes, process_index=process_index, **fields
    )


class Indexed(Dataset[torch.Tensor]):
    """Items are their own indices; every successful ``__getitem__`` is recorded.

    ``fail_at`` names an index whose fetch raises ``KeyError`` (and is not recorded).
    """

    def __init__(self, n: int, *, fail_at: int | None = None) -> None:
        self.n = n
        self.fail_at = fail_at
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.fail_at:
            raise KeyError(f"no sample {index}")
        self.fetched.append(index)
        return torch.tensor(index)


class Stream(IterableDataset[torch.Tensor]):
    """The stream ``0 .. n-1`` as tensors, without ``len()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (torch.tensor(i) for i in range(self.n))


class SizedStream(Stream):
    """The stream ``0 .. n-1`` as tensors, with ``len()``."""

    def __len__(self) -> int:
        return self.n
