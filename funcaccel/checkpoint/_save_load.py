"""Checkpoints of a whole training state, written atomically and resumable exactly.

``save_checkpoint(ctx, directory, ...)`` writes one numbered checkpoint
(``directory/checkpoint-000001``, ``-000002``, ...) holding the models, optimizers,
schedulers, grad scaler and other ``Stateful`` objects, the ``GradState`` and
``LoaderState`` values, every rank's RNG states and free-form JSON metadata.
``load_checkpoint(ctx, path, ...)`` puts the torch objects back in place and returns
the values as a ``LoadedState``; ``latest_checkpoint(directory)`` finds the newest
complete one. A resumed run ends bit for bit where an uninterrupted one would.

>>> import tempfile
>>> ctx = DistributedContext()
>>> with tempfile.TemporaryDirectory() as run:
...     path = save_checkpoint(ctx, run, models=nn.Linear(2, 1), extra={"step": 3})
...     loaded = load_checkpoint(ctx, path, models=nn.Linear(2, 1))
>>> path.name, loaded.extra, loaded.meta.world_size
('checkpoint-000001', {'step': 3}, 1)

Layout of one checkpoint (``"torch"`` format: one process or DDP)::

    manifest.json              written last; lists every file with size (and SHA-256)
    model_0.pt optimizer_0.pt  rank 0 writes the unwrapped models and the optimizers
    scheduler_0.pt scaler.pt object_<name>.pt
    rng_rank_0.pt rng_rank_1.pt ...   each rank writes its own RNG states
    rank_part_0.pt rank_part_1.pt ... each rank its rank_objects and rank_extra

With sharded models (FSDP2, or ``DTensor`` parameters on a mesh: ``"dcp"`` format)
models and optimizers live in ``dcp/`` instead, sharded by
``torch.distributed.checkpoint`` so that a checkpoint written on 2 processes loads
on 1 or 3, and one written on a 2x2 mesh on another mesh shape. A DeepSpeed engine
(``"deepspeed"`` format) is saved and loaded by the engine itself, into
``deepspeed/`` (each rank its ZeRO partitions; it loads on the same world size
only). ``directory`` must be shared by all ranks.

**Atomicity.** Every rank writes into ``directory/.checkpoint-N.tmp``; once all
succeeded, rank 0 writes ``manifest.json`` last, renames the directory into place
and only then moves ``latest`` and deletes checkpoints beyond ``keep_last``, so a
process killed at any moment leaves ``latest`` naming a complete checkpoint.

**Accumulation windows.** Gradients of an open accumulation window are not part of
a checkpoint (docs/accumulate.md#semantics-gradient-accumulation), so ``save_checkpoint`` refuses a ``GradState`` with
``micro_step != 0``: save right after an optimizer step (``grad.sync_gradients``)
with ``loader=batch.state``, and resume with ``iter_batches(loader, loaded.loader)``.

**Exactness** needs samples that are a function of their index: the loader reads
one batch ahead and its workers restart at the resume point, so randomness drawn
while loading (augmentation from a global RNG) is not replayed; seed it from the
sample index and epoch instead.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Final
from typing import Literal

import torch
from torch import nn

from funcaccel._checks import check_bool
from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._guard import guard_collective
from funcaccel.checkpoint import _formats
from funcaccel.checkpoint import _layout
from funcaccel.checkpoint._agree import _all_gather
from funcaccel.checkpoint._agree import _check_save_values
from funcaccel.checkpoint._agree import _raise_failures
from funcaccel.checkpoint._agree import _read_checked
from funcaccel.checkpoint._agree import check_listed
from funcaccel.checkpoint._async import DeferredCopy
from funcaccel.checkpoint._async import PendingCheckpoint
from funcaccel.checkpoint._async import optimizer_storages
from funcaccel.checkpoint._async import own_pending_save
from funcaccel.checkpoint._async import stage
from funcaccel.checkpoint._async import take_buffers
from funcaccel.checkpoint._deepspeed_state import ENGINE_DIR
from funcaccel.checkpoint._deepspeed_state import engine_files
from funcaccel.checkpoint._deepspeed_state import save_engine
from funcaccel.checkpoint._formats import Stateful
from funcaccel.checkpoint._layout import latest_checkpoint
from funcaccel.checkpoint._layout import list_checkpoints
from funcaccel.checkpoint._manifest import SCHEMA_VERSION
from funcaccel.checkpoint._manifest import CheckpointMeta
from funcaccel.checkpoint._manifest import FileEntry
from funcaccel.checkpoint._manifest import check_json_value
from funcaccel.checkpoint._manifest import read_manifest
from funcaccel.checkpoint._rank_part import RankMap
from funcaccel.checkpoint._rank_part import check_rank_extra
from funcaccel.checkpoint._rank_part import check_rank_map
from funcaccel.checkpoint._rank_part import check_rank_names
from funcaccel.checkpoint._rank_part import choose_source
from funcaccel.checkpoint._rank_part import load_rank_part
from funcaccel.checkpoint._rank_part import rank_files_read
from funcaccel.checkpoint._resume_grad import resume_grad
from funcaccel.context import DistributedContext
from funcaccel.grad_state import GradState
from funcaccel.loader import LoaderState
from funcaccel.rng import restore_rng_state

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointMeta",
    "FileEntry",
    "LoadedState",
    "PendingCheckpoint",
    "Stateful",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_checkpoint_meta",
    "save_checkpoint",
    "save_checkpoint_async",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LoadedState:
    """What ``load_checkpoint`` returns besides the torch objects it loaded in place.

    Args:
        path: the checkpoint directory that was loaded.
        meta: its manifest (counts, saved world size, files, values).
        rng_restored: this rank's generators restored from the checkpoint; empty
            with ``restore_rng=False`` or when no rank of that index saved any.
        grad: the ``GradState`` to resume with: the saved one (its window closed),
            with the ``accumulation_steps`` passed to ``load_checkpoint`` if any;
            ``None`` when none was saved.
        rank_part: the saving rank whose per-rank part this rank loaded, or
            ``None`` (no part saved, or ``rank_map`` gave this rank none).
        rank_extra: that part's ``rank_extra`` values (tensors on the CPU), or
            ``None``.
    """

    path: Path
    meta: CheckpointMeta
    rng_restored: tuple[str, ...]
    grad: GradState | None = None
    rank_part: int | None = None
    rank_extra: dict[str, Any] | None = None

    @property
    def loader(self) -> LoaderState | None:
        """The ``LoaderState`` to resume the loader from, or ``None``."""
        return self.meta.loader

    @property
    def extra(self) -> dict[str, Any]:
        """The saved user metadata (a new copy)."""
        copied: dict[str, Any] = check_json_value(self.meta.extra, "extra", "extra")
        return copied


def read_checkpoint_meta(
    path: str | os.PathLike[str], *, verify: bool = False
) -> CheckpointMeta:
    """Read and check a checkpoint's manifest; load nothing.

    Every file it lists must exist with its recorded size; with ``verify`` the
    SHA-256 of each hashed file must match too.

    Raises:
        ValueError: no manifest (not a checkpoint, or an interrupted save), an
            unreadable or other-schema manifest, or a missing, truncated or changed
            file; the message names the file.
    """
    return read_manifest(Path(path), verify=verify, caller="read_checkpoint_meta")


_FAILED: Final = "the checkpoint was not written (the previous one is still the latest)"
_USE_ASYNC: Final = (
    "Call save_checkpoint_async(ctx, directory, ...) for a background save; it "
    "returns a PendingCheckpoint."
)

_Resumed = tuple[GradState | None, int | None, dict[str, Any] | None]
"""What a load resolves per rank: the GradState, the part's saved rank, its extra."""
_Sharded = Callable[[], str | None]
"""The completion of the sharded (DCP) part: waits, returns an error or None."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Save:
    """One save past its checks, with its number: where it goes, what it records."""

    ctx: DistributedContext
    root: Path
    name: str
    objs: _formats.StateObjects
    fields: dict[str, Any]  # the manifest's values: CheckpointMeta but its files
    keep_last: int | None
    caller: str
    rank_part: dict[str, object] | None  # this rank's part's values, if saved

    @property
    def temporary(self) -> Path:
        return _layout.temporary_dir(self.root, self.name)


def save_checkpoint(
    ctx: DistributedContext,
    directory: str | os.PathLike[str],
    *,
    models: nn.Module | Sequence[nn.Module] = (),
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    schedulers: Stateful | Sequence[Stateful] = (),
    scaler: torch.amp.GradScaler | None = None,
    objects: Mapping[str, Stateful] | None = None,
    rank_objects: Mapping[str, Stateful] | None = None,
    rank_extra: Mapping[str, Any] | None = None,
    grad: GradState | None = None,
    loader: LoaderState | None = None,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    save_rng: bool = True,
    pending: PendingCheckpoint | None = None,
    asynchronous: Literal[False] = False,
) -> Path:
    """Write a new checkpoint of the training state into ``directory`` (collective).

    Every rank calls it with the same arguments (its own replica or shards); nothing
    passed is changed and no RNG is advanced. It returns on every rank once the
    checkpoint is complete and ``directory/latest`` names it; a run resumed from it
    ends bit for bit where an uninterrupted one would. With 2 DDP processes, rank 0
    writes ``model_0.pt`` and ``optimizer_0.pt``, each rank its ``rng_rank_<r>.pt``,
    then rank 0 ``manifest.json``. ``save_checkpoint_async`` writes in the
    background instead. Layout, formats, atomicity: docs/checkpoint.md.

    Args:
        ctx: the distributed context.
        directory: this run's checkpoints, shared by all ranks (created if missing).
        models: models, wrapped or not; saved unwrapped, FSDP2 ones sharded.
        optimizers: their optimizers (with FSDP2, each updates one of ``models``).
        schedulers: LR schedulers, or anything with ``state_dict``.
        scaler: the fp16 grad scaler, if any.
        objects: other ``Stateful`` objects by name; rank 0's state is saved.
        rank_objects: ``Stateful`` objects by name whose state every rank saves
            into its own part (``rank_part_<r>.pt``), loaded back by the same rank.
        rank_extra: this rank's values for its part: tensors and plain values
            (str, int, float, bool, None, list, tuple, dict with str keys).
        grad: the ``GradState``; its window must be closed (``micro_step == 0``).
        loader: the ``LoaderState`` to resume from (the last ``batch.state``).
        extra: JSON values (str, int, finite float, bool, None, list, dict).
        keep_last: keep only the newest ``keep_last`` checkpoints (>= 1).
        save_rng: save each rank's Python, torch, CUDA and NumPy RNG states.
        pending: an earlier ``save_checkpoint_async`` handle, completed first.
        asynchronous: only ``False``; a background save is ``save_checkpoint_async``.

    Returns:
        The new checkpoint's path, ``directory/checkpoint-NNNNNN``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an open accumulation window, non-JSON ``extra``, a bad
            ``keep_last`` or object name, or ``asynchronous=True``.
        RuntimeError: a rank failed to write (on every rank; the previous one stays
            current), no process group matching ``ctx``, a rank that did not call
            it within ``ctx.collective_timeout``, or a failed ``pending`` save.
    """
    caller = "save_checkpoint"
    if asynchronous is not False:
        fail_value(caller, "asynchronous", asynchronous, "False", _USE_ASYNC)
    objs = _formats.check_state_objects(
        ctx, caller, models, optimizers, schedulers, scaler, objects, rank_objects
    )
    fields = _check_fields(ctx, objs, caller, grad, loader, extra, keep_last, save_rng)
    part = _rank_part(caller, objs, rank_extra, fields)
    save, _ = _open(ctx, directory, objs, fields, keep_last, pending, caller, part)
    _write_together(save, asynchronous=False)  # written when it returns
    files, error = _collect(save)
    entries: dict[str, FileEntry] = {}
    if error is None:
        try:
            entries = _formats.write_files(save.temporary, files)
        except (OSError, RuntimeError) as failure:
            error = f"writing into {save.temporary} failed: {failure}"
    return _finish(save, entries, error)


def save_checkpoint_async(
    ctx: DistributedContext,
    directory: str | os.PathLike[str],
    *,
    models: nn.Module | Sequence[nn.Module] = (),
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    schedulers: Stateful | Sequence[Stateful] = (),
    scaler: torch.amp.GradScaler | None = None,
    objects: Mapping[str, Stateful] | None = None,
    rank_objects: Mapping[str, Stateful] | None = None,
    rank_extra: Mapping[str, Any] | None = None,
    grad: GradState | None = None,
    loader: LoaderState | None = None,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    save_rng: bool = True,
    pending: PendingCheckpoint | None = None,
) -> PendingCheckpoint:
    """Start a checkpoint written in the background and return its handle (collective).

    ``save_checkpoint``'s checkpoint, but the call returns on every rank as soon as
    the state is staged in CPU memory, and a thread writes the files while training
    goes on: the loop waits for a memory copy instead of the disk. What only the
    saved optimizers' steps change (their CPU parameters and state) is copied by
    that thread during the next forward and backward; each saved optimizer's
    ``step()`` waits for the copy, and ``handle.wait_staged()`` makes any other
    in-place change safe. ``handle.wait()`` on every rank (or the next save given
    ``pending=handle``) commits it: ``latest`` moves only then, so a process killed
    before leaves the previous checkpoint current. A loop threads the handle::

        handle = None
        for batch in iter_batches(loader):
            ...  # one micro-step; save where an accumulation window ends
            if grad.sync_gradients and grad.optimizer_steps % 1000 == 0:
                handle = save_checkpoint_async(ctx, "ckpt", models=model, pending=handle)
        if handle is not None:
            handle.wait()  # on every rank, before the process ends

    The whole story (what is copied when, FSDP2 and DCP's ``async_save``):
    docs/checkpoint.md#asynchronous-checkpoints.

    Args:
        ctx, directory, models, optimizers, schedulers, scaler, objects,
            rank_objects, rank_extra, grad, loader, extra, keep_last, save_rng:
            as for ``save_checkpoint``.
        pending: the previous handle, completed first; its CPU copy's memory is
            reused when the state has the same tensors' storages and sizes.

    Returns:
        A ``PendingCheckpoint`` whose ``wait()`` returns ``directory/checkpoint-NNNNNN``.

    Raises:
        TypeError, ValueError, RuntimeError: as ``save_checkpoint``; ``wait()``
            raises a failure of the background writing, on every rank.
    """
    caller = "save_checkpoint_async"
    objs = _formats.check_state_objects(
        ctx, caller, models, optimizers, schedulers, scaler, objects, rank_objects
    )
    fields = _check_fields(ctx, objs, caller, grad, loader, extra, keep_last, save_rng)
    part = _rank_part(caller, objs, rank_extra, fields)
    save, reusable = _open(
        ctx, directory, objs, fields, keep_last, pending, caller, part
    )
    sharded = _write_together(save, asynchronous=True)
    files, error = _collect(save)
    return _write_behind(save, files, error, reusable, sharded)


def _check_fields(
    ctx: DistributedContext,
    objs: _formats.StateObjects,
    caller: str,
    grad: object,
    loader: object,
    extra: object,
    keep_last: object,
    save_rng: object,
) -> dict[str, Any]:
    """Check the values a save records; return the manifest's fields but its files."""
    extra_dict = _check_save_values(caller, grad, loader, extra, keep_last)
    check_bool(caller, "save_rng", save_rng)
    state_format = _formats.choose_format(objs.models)
    if state_format == "dcp":
        _formats.pair_optimizers(objs.models, objs.optimizers, caller=caller)
    return {
        "world_size": ctx.num_processes,
        "state_format": state_format,
        "models": len(objs.models),
        "optimizers": len(objs.optimizers),
        "schedulers": len(objs.schedulers),
        "scaler": objs.scaler is not None,
        "objects": tuple(objs.named),
        "rng": save_rng,
        "grad": grad,
        "loader": loader,
        "extra": extra_dict,
    }


def _rank_part(
    caller: str,
    objs: _formats.StateObjects,
    rank_extra: object,
    fields: dict[str, Any],
) -> dict[str, object] | None:
    """Return this rank's part's values (``None``: no part); record it in ``fields``.

    A part is saved when ``rank_objects`` is not empty or ``rank_extra`` is given.
    """
    extra = check_rank_extra(caller, rank_extra)
    saved = bool(objs.rank_named) or extra is not None
    fields["rank_part"] = saved
    fields["rank_objects"] = tuple(objs.rank_named)
    return {"extra": extra} if saved else None


def _open(
    ctx: DistributedContext,
    directory: str | os.PathLike[str],
    objs: _formats.StateObjects,
    fields: dict[str, Any],
    keep_last: int | None,
    pending: object,
    caller: str,
    rank_part: dict[str, object] | None,
) -> tuple[_Save, tuple[torch.UntypedStorage, ...]]:
    """Complete ``pending``, then take the next number on rank 0 (collective).

    Returns the save and the staging memory ``pending`` leaves for reuse.
    """
    what = "the PendingCheckpoint an asynchronous save returned, or None"
    check_type(caller, "pending", pending, PendingCheckpoint, what=what, optional=True)
    root = Path(directory)
    reusable: tuple[torch.UntypedStorage, ...] = ()
    if isinstance(pending, PendingCheckpoint):
        pending.wait()  # collective: the earlier save is numbered before this one
        reusable = take_buffers(pending)  # its staging memory, now free
    guard_collective(ctx, caller)
    name, error = _number(root, caller) if ctx.is_main_process else ("", None)
    name, error = _all_gather(ctx, (name, error))[0]  # rank 0's decision
    _raise_failures([error], _FAILED, caller)
    save = _Save(
        ctx=ctx,
        root=root,
        name=name,
        objs=objs,
        fields=fields,
        keep_last=keep_last,
        caller=caller,
        rank_part=rank_part,
    )
    return save, reusable


def _number(root: Path, caller: str) -> tuple[str, str | None]:
    """Rank 0: create the next checkpoint's temporary directory; its name, or why not.

    A save of this process into ``root`` still pending would take the same number
    and delete the files being written, so it is refused.
    """
    unfinished = own_pending_save(root)
    if unfinished is not None:
        return "", (
            f"an asynchronous save into {root} ({unfinished}) is still pending; "
            f"pass its PendingCheckpoint as {caller}(..., pending=handle), "
            "or call handle.wait() first"
        )
    try:
        return _layout.prepare(root), None
    except OSError as failure:
        return "", f"cannot create a checkpoint in {root}: {failure}"


def _write_together(save: _Save, *, asynchronous: bool) -> _Sharded | None:
    """Write what the ranks write together, DCP shards or a DeepSpeed engine (collective).

    Returns the DCP part's completion (already complete unless ``asynchronous``).
    """
    state_format = save.fields["state_format"]
    if state_format == "dcp":
        where = save.temporary / "dcp"
        return _formats.save_sharded(
            save.ctx, where, save.objs, caller=save.caller, asynchronous=asynchronous
        )
    if state_format == "deepspeed":
        save_engine(save.objs.models[0], save.temporary / ENGINE_DIR)
    return None


def _collect(save: _Save) -> tuple[dict[str, object], str | None]:
    """Return this rank's whole files as ``{name: live state}``, or why it failed."""
    whole = save.fields["state_format"] == "torch"
    try:
        files = _formats.state_files(
            save.ctx,
            save.objs,
            rng=save.fields["rng"],
            whole=whole,
            rank_part=save.rank_part,
        )
    except (OSError, RuntimeError) as failure:
        return {}, f"writing into {save.temporary} failed: {failure}"
    return files, None


def _write_behind(
    save: _Save,
    files: dict[str, object],
    error: str | None,
    reusable: tuple[torch.UntypedStorage, ...],
    sharded: _Sharded | None,
) -> PendingCheckpoint:
    """Stage ``files`` in CPU memory and start the thread that writes them."""
    staged: dict[str, object] = {}
    buffers: tuple[torch.UntypedStorage, ...] = ()
    deferred: DeferredCopy | None = None
    if error is None:
        # A copy (training may change the originals now), into the previous
        # save's staging memory when the state has the same layout. What only
        # the optimizers' steps change is copied in the background.
        defer = optimizer_storages(save.objs.optimizers)
        try:
            staged, buffers, deferred = stage(files, reusable, defer=defer)
        except (OSError, RuntimeError) as failure:
            error = f"writing into {save.temporary} failed: {failure}"
    return PendingCheckpoint(
        save.ctx,
        save.root / save.name,
        lambda: _formats.write_files(save.temporary, staged),
        functools.partial(_finish, save),
        error=error,
        buffers=buffers,
        deferred=deferred,
        optimizers=save.objs.optimizers,
        sharded_done=sharded,
    )


def _finish(save: _Save, entries: dict[str, FileEntry], error: str | None) -> Path:
    """Commit a checkpoint whose files every rank has written (collective).

    The ranks agree that all wrote; rank 0 writes the manifest, renames the
    directory into place, moves ``latest`` and prunes. Also the barrier: no rank
    returns before the checkpoint is complete.
    """
    ctx, caller = save.ctx, save.caller
    gathered = _all_gather(ctx, (entries, error))
    _raise_failures([e for _, e in gathered], _FAILED, caller)
    outcome: tuple[str | None, str | None] = (None, None)
    if ctx.is_main_process:
        files = {k: v for rank_entries, _ in gathered for k, v in rank_entries.items()}
        outcome = _commit(save, files)
    outcomes = _all_gather(ctx, outcome)
    _raise_failures([e for e, _ in outcomes], _FAILED, caller)
    done = f"{save.root / save.name} is written and current, but deleting older ones failed"
    _raise_failures([p for _, p in outcomes], done, caller)
    return save.root / save.name


def _commit(save: _Save, files: dict[str, FileEntry]) -> tuple[str | None, str | None]:
    """Rank 0: write the manifest, rename, move ``latest``, then prune.

    Returns why committing failed, and why pruning failed (each ``None`` if not).
    """
    temporary = save.temporary
    if save.fields["state_format"] == "dcp":
        for key, size in _layout.file_sizes(temporary / "dcp").items():
            files[f"dcp/{key}"] = FileEntry(size=size)
    elif save.fields["state_format"] == "deepspeed":
        for key, size in engine_files(temporary).items():
            files[key] = FileEntry(size=size)
    meta = CheckpointMeta(**save.fields, files=files)
    try:
        _layout.commit(save.root, save.name, meta.to_dict())
    except OSError as failure:
        return f"committing {temporary} failed: {failure}", None
    try:
        _layout.prune(save.root, keep_last=save.keep_last)
    except OSError as failure:
        return None, str(failure)
    return None, None


def load_checkpoint(
    ctx: DistributedContext,
    path: str | os.PathLike[str],
    *,
    models: nn.Module | Sequence[nn.Module] = (),
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    schedulers: Stateful | Sequence[Stateful] = (),
    scaler: torch.amp.GradScaler | None = None,
    objects: Mapping[str, Stateful] | None = None,
    rank_objects: Mapping[str, Stateful] | None = None,
    rank_map: RankMap | None = None,
    accumulation_steps: int | None = None,
    restore_rng: bool = True,
    verify: bool = True,
) -> LoadedState:
    """Load a checkpoint into the objects passed, in place, and return its values.

    Pass the same kinds and numbers of objects, in the same order, as to
    ``save_checkpoint``; the models wrapped or not. A sharded (FSDP2) checkpoint
    loads on any world size, into FSDP2, DDP or plain models; a whole one into DDP
    or plain models. Each rank restores the RNG states its rank saved; with 2 saving
    and 3 loading processes, rank 2 keeps its own (``rng_restored`` is empty).
    Collective: every rank calls it (the ranks agree the checkpoint is readable).

    A checkpoint with a per-rank part (``rank_objects=``/``rank_extra=`` at the
    save) gives rank ``r`` the part rank ``r`` saved; on another world size it is
    refused unless ``rank_map`` says which part each rank takes.

    Args:
        ctx: the distributed context.
        path: a checkpoint directory, e.g. ``latest_checkpoint(directory)``.
        models, optimizers, schedulers, scaler, objects: loaded in place.
        rank_objects: loaded in place from this rank's part; the names saved.
        rank_map: which saved rank's part each rank loads: ``None`` (the same
            world size: its own), ``"drop"`` (none), or a sequence with one saved
            rank or ``None`` per loading rank (``[0, 1, None]`` on 3 ranks).
        accumulation_steps: the accumulation this run uses; when it differs from
            the saved ``GradState``'s (at a window boundary) ``loaded.grad``
            takes it. ``None`` keeps the saved one.
        restore_rng: restore this rank's RNG states.
        verify: check the SHA-256 of every hashed file before loading.

    Returns:
        A ``LoadedState`` with the ``GradState``, ``LoaderState``, ``extra`` and
        this rank's ``rank_extra``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an incomplete, damaged or other-schema checkpoint, objects
            that do not match it (the message names the file), a per-rank part
            on another world size without ``rank_map``, or another
            ``accumulation_steps`` inside an open window.
        RuntimeError: another rank failed to read it, no matching group, or (with
            ``ctx.collective_timeout``) a rank that did not call it in time.
    """
    caller = "load_checkpoint"
    objs = _formats.check_state_objects(
        ctx, caller, models, optimizers, schedulers, scaler, objects, rank_objects
    )
    mapping = check_rank_map(caller, rank_map)
    if accumulation_steps is not None:
        check_int(caller, "accumulation_steps", accumulation_steps, 1)
    check_bool(caller, "restore_rng", restore_rng)
    check_bool(caller, "verify", verify)
    root = Path(path)
    guard_collective(ctx, caller)

    def resume(meta: CheckpointMeta) -> _Resumed:
        grad = resume_grad(meta.grad, accumulation_steps, root=root, caller=caller)
        source = None
        if meta.rank_part:
            saved, world = meta.world_size, ctx.num_processes
            rank = ctx.process_index
            source = choose_source(saved, world, mapping, rank=rank, caller=caller)
        check_rank_names(meta, list(objs.rank_named), source, root, caller)
        check_listed(meta, rank_files_read(meta, source), root, caller)
        extra = None
        if source is not None:
            extra = load_rank_part(root, source, meta, objs.rank_named, caller)
        return grad, source, extra

    meta, (grad, source, rank_extra) = _read_checked(
        ctx, root, objs, verify=verify, caller=caller, then=resume
    )
    _formats.load_state_objects(
        ctx, root, objs, state_format=meta.state_format, files=meta.files, caller=caller
    )
    restored: tuple[str, ...] = ()
    rng_file = f"rng_rank_{ctx.process_index}.pt"
    if restore_rng and rng_file in meta.files:
        state = _layout.read_torch_file(root / rng_file, caller=caller)
        if not isinstance(state, dict):
            msg = f"{caller}: {root / rng_file} does not hold an RNG state dict; the file is damaged."
            raise ValueError(msg)
        restored = restore_rng_state(state, caller=caller)
    return LoadedState(
        path=root,
        meta=meta,
        rng_restored=restored,
        grad=grad,
        rank_part=source,
        rank_extra=rank_extra,
    )
