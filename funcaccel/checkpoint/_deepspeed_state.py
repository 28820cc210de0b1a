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
from funcaccel.checkpoint import _layout
from funcaccel.checkpoint._members import fail_checkpoint

__all__ = [
    "ENGINE_DIR",
    "check_engine_format",
    "check_engine_objects",
    "engine_files",
    "gathered_ctx",
    "load_engine",
    "save_engine",
]

ENGINE_DIR: Final = "deepspeed"
_TAG: Final = "state"  # one tag per funcaccel checkpoint directory
_SAVED_THERE: Final = "pass the engine saved there"
_MSG_ALONE: Final = (
    "{caller}: a DeepSpeed engine must be the only model of a checkpoint; got "
    "{count} models. Save other models in a separate checkpoint."
)
_MSG_OWN_OPT: Final = (
    "{caller}: a DeepSpeed engine saves and loads its own optimizer and scheduler "
    "(the ones given to wrap_model); pass optimizers=() with it, got {count}."
)
_MSG_NEEDS_ENGINE: Final = (
    "{caller}: {root} holds a DeepSpeed engine's checkpoint; pass the engine "
    "(wrap_model(..., deepspeed=...)) as the only model to load it, or export the "
    "weights with save_model from a run that has the engine."
)
_MSG_NOT_ENGINE: Final = (
    "{caller}: models is a DeepSpeed engine, but {root} holds a {state_format!r} "
    "checkpoint, not an engine's; load it into the plain model before wrap_model, "
    "or resume from a checkpoint saved with the engine."
)
_MSG_WORLD: Final = (
    "{caller}: {root} holds ZeRO partitions of {saved} processes, but this run has "
    "{world}; a DeepSpeed engine's checkpoint loads only on the world size that "
    "saved it."
)


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
        raise ValueError(_MSG_ALONE.format(caller=caller, count=len(models)))
    if optimizers:
        raise ValueError(_MSG_OWN_OPT.format(caller=caller, count=len(optimizers)))
    return True


def check_engine_format(
    state_format: str,
    saved_world: int,
    models: Sequence[nn.Module],
    world: int,
    root: Path,
    caller: str,
) -> None:
    """Refuse loading an engine checkpoint into a non-engine, or the reverse.

    A ZeRO checkpoint holds each rank's own partitions, so it loads only on the
    world size that saved it.

    Raises:
        ValueError: the format and the models passed do not match, or the world
            size differs from the saving one.
    """
    engine = len(models) == 1 and is_deepspeed_engine(models[0])
    where = {"caller": caller, "root": root, "state_format": state_format}
    if state_format == "deepspeed" and not engine:
        raise ValueError(_MSG_NEEDS_ENGINE.format(**where))
    if state_format != "deepspeed" and engine:
        raise ValueError(_MSG_NOT_ENGINE.format(**where))
    if engine and saved_world != world:
        raise ValueError(_MSG_WORLD.format(**where, saved=saved_world, world=world))


def save_engine(engine: Any, directory: Path) -> None:
    """Write ``engine``'s checkpoint into ``directory`` (collective)."""
    engine.save_checkpoint(str(directory), tag=_TAG, save_latest=False)


def engine_files(temporary: Path) -> dict[str, int]:
    """Return ``{name: size}`` of the engine's files under ``temporary`` (fsynced).

    The names are relative to ``temporary`` (``deepspeed/state/...``), for the
    manifest.
    """
    sizes: dict[str, int] = {}
    top = temporary / ENGINE_DIR
    for directory in sorted({top, *(p for p in top.rglob("*") if p.is_dir())}):
        prefix = directory.relative_to(temporary).as_posix()
        for name, size in _layout.file_sizes(directory).items():
            sizes[f"{prefix}/{name}"] = size
    return sizes


def load_engine(engine: Any, directory: Path, caller: str) -> None:
    """Load ``engine`` in place from the checkpoint in ``directory`` (collective).

    The module's weights, ZeRO's fp32 partitions and optimizer state, and the
    scheduler given to ``wrap_model`` come back; so do the engine's step counters.

    Raises:
        ValueError: the directory holds no engine checkpoint.
    """
    loaded, _ = engine.load_checkpoint(str(directory), tag=_TAG)
    if loaded is None:
        fail_checkpoint(
            caller, f"{directory} holds no DeepSpeed engine checkpoint", _SAVED_THERE
        )


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
