"""DeepSpeed engines in checkpoints and exports.

A training-state checkpoint of an engine (``"deepspeed"`` format) holds the
engine's own checkpoint in ``deepspeed/``, written by ``engine.save_checkpoint``
into funcaccel's temporary directory (so the atomic commit and ``latest`` rule
stay funcaccel's) and read back by ``engine.load_checkpoint``: each rank writes and
reads its own ZeRO partitions of the fp32 weights and optimizer state, so a
resumed run continues bit for bit. ``gathered_ctx`` gathers a ZeRO-3 engine's
partitioned parameters for ``save_model``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Final

from torch import nn

from funcaccel._dist_types import is_deepspeed_engine

__all__ = [
    "ENGINE_DIR",
    "check_engine_objects",
    "gathered_ctx",
    "load_engine",
    "save_engine",
]

ENGINE_DIR: Final = "deepspeed"
_TAG: Final = "state"  # one tag per funcaccel checkpoint directory


def check_engine_objects(
    models: Sequence[nn.Module], optimizers: Sequence[object], caller: str
) -> bool:
    """Return whether ``models`` is one DeepSpeed engine (then the format is ``"deepspeed"``).

    Raises:
        ValueError: an engine next to other models, or with ``optimizers``.
    """
    if not any(is_deepspeed_engine(m) for m in models):
        return False
    if len(models) != 1:
        msg = (
            f"{caller}: a DeepSpeed engine must be the only model of a checkpoint; "
            f"got {len(models)} models. Save other models in a separate checkpoint."
        )
        raise ValueError(msg)
    if optimizers:
        msg = (
            f"{caller}: a DeepSpeed engine saves and loads its own optimizer and "
            f"scheduler (the ones given to wrap_model); pass optimizers=() with it, "
            f"got {len(optimizers)}."
        )
        raise ValueError(msg)
    return True


def save_engine(engine: Any, directory: Path) -> None:
    """Write ``engine``'s checkpoint into ``directory`` (collective)."""
    engine.save_checkpoint(str(directory), tag=_TAG, save_latest=False)


def load_engine(engine: Any, directory: Path, caller: str) -> None:
    """Load ``engine`` in place from the checkpoint in ``directory`` (collective).

    Raises:
        ValueError: the directory holds no engine checkpoint.
    """
    loaded, _ = engine.load_checkpoint(str(directory), tag=_TAG)
    if loaded is None:
        msg = f"{caller}: {directory} holds no DeepSpeed engine checkpoint; pass the engine saved there."
        raise ValueError(msg)


@contextlib.contextmanager
def gathered_ctx(model: nn.Module) -> Iterator[None]:
    """Within it, a ZeRO-3 engine's module holds its full parameters on every rank."""
    engine: Any = model
    if not (is_deepspeed_engine(engine) and engine.zero_optimization_stage() == 3):
        yield
        return
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield
