"""What a ``ShardedLoader`` draws from torch's global generator, and when.

The rules: docs/loader.md#draws-from-torchs-global-generator.

The loader's own order never depends on torch's global generator (it comes from
``seed + epoch``), but a torch ``DataLoader`` draws from that generator, and so
does Accelerate's prepared loader, which is one. A script ported from Accelerate
builds models, dropout masks and augmentations from the global stream after the
loader has drawn, so the loader draws the same count at the same moments, and
the stream stays where Accelerate's leaves it. Each draw is the very call torch
makes, ``torch.empty((), dtype=torch.int64).random_()``; its value is thrown away.

On one process, for a shuffling ``RandomSampler`` without a generator, each
epoch start draws two numbers, as ``DataLoader.__iter__`` does: the iterator's
worker base seed, then the sampler's seed. On several processes Accelerate gives
that sampler a generator seeded from one draw when the loader is prepared, so
``shard_loader`` draws one number and every epoch start draws one:

>>> draws = plan_draws(
...     kind="random", processes=2, dispatch=False, persistent_workers=False
... )
>>> draws.when_built, draws.first_epoch, draws.later_epochs
(1, 1, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["EpochDraws", "draw_global", "plan_draws"]

SamplerKind = Literal["random", "sequential", "given", "iterable"]


def draw_global(count: int) -> None:
    """Draw ``count`` numbers from torch's global generator, as a ``DataLoader`` does.

    The expression is torch's own (the default device's generator is the one
    used), so the stream moves exactly as far as torch's draws move it.
    """
    for _ in range(count):
        torch.empty((), dtype=torch.int64).random_()


@dataclass(slots=True, kw_only=True)
class EpochDraws:
    """How many numbers a loader draws from torch's global generator.

    ``when_built`` are drawn by ``shard_loader``; ``first_epoch`` at the start of
    the first epoch this loader iterates and ``later_epochs`` at every later
    start (they differ only with persistent workers, whose iterator, and so its
    base seed, is made once). ``started`` is the one mutable field: whether an
    epoch was started, by a ``for`` loop, ``iter_batches`` or a resume.
    """

    when_built: int
    first_epoch: int
    later_epochs: int
    started: bool = False

    def start_epoch(self, *, resumed: bool) -> None:
        """Draw what an epoch start draws; a resumed epoch draws nothing.

        A resume continues an epoch whose start drew before the checkpoint was
        saved; the generator state saved with it already holds those draws.
        """
        count = self.later_epochs if self.started else self.first_epoch
        self.started = True
        if not resumed:
            draw_global(count)


def plan_draws(
    *,
    kind: SamplerKind,
    processes: int,
    dispatch: bool,
    persistent_workers: bool,
) -> EpochDraws:
    """Return the draws Accelerate's prepared loader makes on this rank.

    ``kind`` is the loader's index source (``BaseIndices.kind``, or
    ``"iterable"``); ``processes`` the data-parallel ranks. Only a shuffling
    ``RandomSampler`` that the loader replaces (``"random"``) adds a draw: per
    epoch on one process and when dispatching (Accelerate leaves the sampler
    alone there; rank 0 alone iterates it, but every rank draws its count so
    that ranks whose generators were synchronised stay in step), once when
    built otherwise. A sampler of your own (``"given"``) draws what it draws.

    >>> plan_draws(kind="random", processes=1, dispatch=False, persistent_workers=False)
    EpochDraws(when_built=0, first_epoch=2, later_epochs=2, started=False)
    >>> plan_draws(kind="sequential", processes=2, dispatch=False, persistent_workers=True)
    EpochDraws(when_built=0, first_epoch=1, later_epochs=0, started=False)
    """
    per_epoch = kind == "random" and (processes == 1 or dispatch)
    sampler = 1 if per_epoch else 0
    base = 1  # DataLoader.__iter__'s worker base seed
    return EpochDraws(
        when_built=1 if kind == "random" and not per_epoch else 0,
        first_epoch=base + sampler,
        later_epochs=(0 if persistent_workers else base) + sampler,
    )
