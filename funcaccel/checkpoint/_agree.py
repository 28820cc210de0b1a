"""The checks ``save_checkpoint`` and ``load_checkpoint`` run, agreed across ranks.

Save side: the values written into the manifest (``grad``, ``loader``, ``extra``,
``keep_last``). Load side: the manifest against the objects passed. ``_all_gather``
and ``_raise_failures`` let every rank raise when any rank failed.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Final
from typing import TypeVar

import torch.distributed as dist

from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._dist_types import is_fsdp_module
from funcaccel.checkpoint import _formats
from funcaccel.checkpoint._deepspeed_state import check_engine_format
from funcaccel.checkpoint._manifest import CheckpointMeta
from funcaccel.checkpoint._manifest import check_json_value
from funcaccel.checkpoint._manifest import read_manifest
from funcaccel.checkpoint._members import fail_checkpoint
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.loader import LoaderState
from funcaccel.model import Pipeline
from funcaccel.model import unwrap_model

T = TypeVar("T")
_MSG_OPEN_WINDOW: Final = (
    "{caller}: grad has an open accumulation window (micro_step={grad.micro_step} of "
    "accumulation_steps={grad.accumulation_steps}); its gradients are not part of a "
    "checkpoint, so a resume would lose them. Save right after an optimizer step, "
    "when grad.sync_gradients is True."
)
# caller, root, label, saved count, passed count
_MSG_COUNTS: Final = (
    "{0}: {1} holds {2}={3}, but {2}={4} was passed; pass the same {2} as when it "
    "was saved, in that order."
)
_UNLISTED: Final = (
    "the manifest of {} does not list {}, which the load reads, so it was never checked"
)
_MSG_WHOLE: Final = (
    "{caller}: {root} holds whole (unsharded) state dicts, but models[{index}] is "
    "sharded by FSDP2; load it into the unsharded model, or resume from a checkpoint "
    "saved with FSDP2."
)
_MSG_STAGES: Final = (
    "{caller}: {root} holds whole (unsharded) state dicts, but models[{index}] is "
    "a Pipeline holding some stages; load it into the whole model (one process, "
    "DDP or FSDP2), save it again with FSDP2 (sharded), and resume the pipeline "
    "from that."
)


def _all_gather(ctx: DistributedContext, value: T) -> list[T]:
    if ctx.num_processes == 1:
        return [value]
    gathered: list[Any] = [None] * ctx.num_processes
    dist.all_gather_object(gathered, value)
    return gathered


def _raise_failures(
    errors: Sequence[str | None],
    what: str,
    caller: str,
    kind: type[Exception] = RuntimeError,
) -> None:
    """Raise one ``kind`` naming every rank that failed (none waits for the others)."""
    failures = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failures:
        raise kind(f"{caller}: {what}; " + "; ".join(failures))


def _raise_any(
    ctx: DistributedContext,
    problem: ValueError | None,
    what: str,
    caller: str,
    kind: type[Exception] = RuntimeError,
) -> None:
    """Raise ``problem`` on its rank, and on the others a ``kind`` naming it (collective).

    So every rank raises when any rank found a problem, before a collective that
    would wait for it.
    """
    errors = _all_gather(ctx, None if problem is None else str(problem))
    if problem is not None:
        raise problem
    _raise_failures(errors, what, caller, kind)


def _check_save_values(
    caller: str, grad: object, loader: object, extra: object, keep_last: object
) -> dict[str, Any]:
    check_type(caller, "grad", grad, GradState, optional=True)
    check_type(caller, "loader", loader, LoaderState, optional=True)
    if isinstance(grad, GradState) and grad.micro_step != 0:
        raise ValueError(_MSG_OPEN_WINDOW.format(caller=caller, grad=grad))
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        fail_value(caller, "keep_last", keep_last, "an int >= 1 or None")
    what = "a dict of JSON values or None"
    extra = check_type(caller, "extra", extra, Mapping, what=what, optional=True)
    copied: dict[str, Any] = check_json_value(dict(extra or {}), "extra", caller)
    return copied


def _check_counts(
    meta: CheckpointMeta,
    objs: _formats.StateObjects,
    root: Path,
    caller: str,
    world: int,
) -> None:
    for label, saved, passed in (
        ("models", meta.models, len(objs.models)),
        ("optimizers", meta.optimizers, len(objs.optimizers)),
        ("schedulers", meta.schedulers, len(objs.schedulers)),
        ("scaler", int(meta.scaler), int(objs.scaler is not None)),
        ("objects", sorted(meta.objects), sorted(objs.named)),
    ):
        if saved != passed:
            raise ValueError(_MSG_COUNTS.format(caller, root, label, saved, passed))
    check_listed(meta, _files_read(meta, objs), root, caller)
    check_engine_format(
        meta.state_format, meta.world_size, objs.models, world, root, caller
    )
    if meta.state_format == "torch":
        for index, model in enumerate(objs.models):
            if is_fsdp_module(unwrap_model(model)):
                raise ValueError(
                    _MSG_WHOLE.format(caller=caller, root=root, index=index)
                )
            if isinstance(unwrap_model(model), Pipeline):
                raise ValueError(
                    _MSG_STAGES.format(caller=caller, root=root, index=index)
                )


def check_listed(
    meta: CheckpointMeta, names: Sequence[str], root: Path, caller: str
) -> None:
    """Raise the damaged-checkpoint error unless the manifest lists every name."""
    for name in names:
        if name not in meta.files:
            fail_checkpoint(caller, _UNLISTED.format(root, name))


def _files_read(meta: CheckpointMeta, objs: _formats.StateObjects) -> list[str]:
    """Return the files ``load_state_objects`` opens: each must be in the manifest."""
    names = [f"scheduler_{i}.pt" for i in range(len(objs.schedulers))]
    names += ["scaler.pt"] if objs.scaler is not None else []
    names += [f"object_{key}.pt" for key in objs.named]
    if meta.state_format == "dcp":
        return [*names, "dcp/.metadata"]
    if meta.state_format == "deepspeed":
        return names  # the engine reads its own files, all listed and checked
    names += [f"model_{i}.pt" for i in range(len(objs.models))]
    return names + [f"optimizer_{i}.pt" for i in range(len(objs.optimizers))]


def _read_checked(
    ctx: DistributedContext,
    root: Path,
    objs: _formats.StateObjects,
    *,
    verify: bool,
    caller: str,
    then: Callable[[CheckpointMeta], T],
) -> tuple[CheckpointMeta, T]:
    """Read and check the manifest, then run ``then`` on it; agreed across ranks.

    ``then`` does this rank's checks and reads that only it needs (its per-rank
    part), raising ``ValueError``: a failure on any rank raises on every rank,
    before the collective DCP load can start.
    """
    error: ValueError | None = None
    outcome: tuple[CheckpointMeta, T] | None = None
    try:
        meta = read_manifest(root, verify=verify, caller=caller)
        _check_counts(meta, objs, root, caller, ctx.num_processes)
        outcome = (meta, then(meta))
    except ValueError as failure:
        error = failure
    _raise_any(ctx, error, f"{root} cannot be loaded", caller)
    assert outcome is not None
    return outcome
