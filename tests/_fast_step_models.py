"""Tiny block models for the fast-step tests (compile, activation checkpointing).

``TinyNet`` is an embedding-free stack of ``Block``s (layer norm, two linear
layers, dropout, a residual) and a head: small enough that dynamo traces a block
in a fraction of a second, shaped like a transformer's feed-forward half.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "TinyNet", "batches", "loss_of"]


class Block(nn.Module):
    """A residual feed-forward block: ``x + drop(down(tanh(up(norm(x)))))``."""

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.drop(self.down(torch.tanh(self.up(self.norm(x)))))
        return x + out


class TinyNet(nn.Module):
    """``blocks`` ``Block``s of width ``dim`` and a linear head to one output."""

    def __init__(self, dim: int = 8, blocks: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(dim, dropout) for _ in range(blocks)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x))
        return out


def batches(
    count: int, rows: int, dim: int = 8, dtype: torch.dtype = torch.float64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (input, target) pairs of ``rows`` rows, drawn from seed 1234."""
    gen = torch.Generator().manual_seed(1234)
    return [
        (
            torch.randn(rows, dim, generator=gen, dtype=dtype),
            torch.randn(rows, 1, generator=gen, dtype=dtype),
        )
        for _ in range(count)
    ]


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of ``model`` on ``batch``."""
    x, y = batch
    out: torch.Tensor = model(x)
    return ((out - y) ** 2).mean()
