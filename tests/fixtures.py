"""Shared test fixtures: hand-built rank contexts and small recording datasets.

``rank_ctx`` describes any rank of any world without a process group, so pure code
(sharding, scheduling, gating) can be checked for every rank in one process. The
datasets yield their own indices as tensors: ``Indexed`` (map-style, records every
fetch), ``Stream`` (iterable, no ``len()``) and ``SizedStream`` (iterable, sized).
``outcome`` and ``wait_for`` serve the ranks of the collective-guard tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data import IterableDataset
from typing_extensions import Unpack

from funcaccel import testing
from funcaccel.context import DistributedContext
from funcaccel.testing import ContextFields

__all__ = [
    "Indexed",
    "SizedStream",
    "Stream",
    "TpMLP",
    "adamw",
    "mlp_blocks",
    "rank_ctx",
]


def rank_ctx(
    num_processes: int = 1, process_index: int = 0, **fields: Unpack[ContextFields]
) -> DistributedContext:
    """``funcaccel.testing.rank_ctx``, with rank 0 of 1 as the default.

    >>> rank_ctx().num_processes, rank_ctx(4, 3).distributed_type.name
    (1, 'MULTI_CPU')
    """
    return testing.rank_ctx(num_processes, process_index, **fields)


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


class TpMLP(nn.Module):
    """Two linear layers of width 8 for tensor-parallel tests: ``up`` is split by
    columns (``ColwiseParallel``), ``down`` by rows (``RowwiseParallel``)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.tanh(self.up(x)))
        return out


Outcome = tuple[str | None, float]


def outcome(call: Callable[[], object]) -> Outcome:
    """Run ``call``; return its RuntimeError's message (or None) and the seconds taken."""
    start = time.monotonic()
    try:
        call()
    except RuntimeError as error:
        return str(error), time.monotonic() - start
    return None, time.monotonic() - start


def wait_for(flag: Path, seconds: float) -> None:
    """Wait until ``flag`` exists, at most ``seconds`` (the caller checks what follows)."""
    deadline = time.monotonic() + seconds
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def mlp_blocks(blocks: int, width: int) -> nn.Sequential:
    """``blocks`` blocks of ``width -> 2 * width -> width`` (Linear, ReLU, Linear)."""
    return nn.Sequential(
        *(
            nn.Sequential(
                nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width)
            )
            for _ in range(blocks)
        )
    )


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW at lr 1e-3: the optimizer of the memory-estimate tests."""
    return torch.optim.AdamW(params, lr=1e-3)
