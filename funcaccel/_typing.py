"""Shared type aliases and Protocols for duck-typed torch objects."""

from __future__ import annotations

from typing import Any
from typing import Literal
from typing import Protocol
from typing import TypeAlias
from typing import runtime_checkable

MixedPrecision: TypeAlias = Literal["no", "fp16", "bf16"]
"""The mixed-precision modes funcaccel supports."""

MIXED_PRECISION_MODES: tuple[MixedPrecision, ...] = ("no", "fp16", "bf16")

RngType: TypeAlias = Literal["torch", "cuda", "generator"]
"""A random generator that ``shard_loader`` and ``sync_rng_states`` sync from rank 0."""

RNG_TYPES: tuple[RngType, ...] = ("torch", "cuda", "generator")


@runtime_checkable
class Stateful(Protocol):
    """Anything checkpointed through ``state_dict()`` / ``load_state_dict(state)``.

    Torch's optimizers, schedulers and ``GradScaler`` take a ``dict`` (not any
    mapping), so the argument is typed loosely.
    """

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


class SupportsStep(Protocol):
    """Anything stepped like a torch LR scheduler."""

    def step(self) -> None: ...
