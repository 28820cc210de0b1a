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
from typing import overload

import torch
from torch import nn

from funcaccel._checks import check_bool
from funcaccel._checks import check_type
from funcaccel._guard import guard_collective
from funcaccel.checkpoint import _formats
from funcaccel.checkpoint import _layout
from funcaccel.checkpoint._agree import _all_gather
from funcaccel.checkpoint._agree import _check_save_values
from funcaccel.checkpoint._agree import _raise_failures
from funcaccel.checkpoint._agree import _read_checked
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
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LoadedState:
    """What ``load_checkpoint`` returns besides the torch objects it loaded in place.

    Args:
        path: the checkpoint directory that was loaded.
        meta: its manifest (counts, saved world size, files, values).
        rng_restored: this rank's generators restored from the checkpoint; empty
            with ``restore_rng=False`` or when no rank of that index saved any.
    """

    path: Path
    meta: CheckpointMeta
    rng_restored: tuple[str, ...]

    @property
    def grad(self) -> GradState | None:
        """The saved ``GradState`` (its window closed), or ``None``."""
        return self.meta.grad

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


@overload
def save_checkpoint(
    ctx: DistributedContext,
    directory: str | os.PathLike[str],
    *,
    models: nn.Module | Sequence[nn.Module] = ...,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = ...,
    schedulers: Stateful | Sequence[Stateful] = ...,
    scaler: torch.amp.GradScaler | None = ...,
    objects: Mapping[str, Stateful] | None = ...,
    grad: GradState | None = ...,
    loader: LoaderState | None = ...,
    extra: Mapping[str, Any] | None = ...,
    keep_last: int | None = ...,
    save_rng: bool = ...,
    asynchronous: Literal[False] = ...,
    pending: PendingCheckpoint | None = ...,
) -> Path: ...


@overload
def save_checkpoint(
    ctx: DistributedContext,
    directory: str | os.PathLike[str],
    *,
    models: nn.Module | Sequence[nn.Module] = ...,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = ...,
    schedulers: Stateful | Sequence[Stateful] = ...,
    scaler: torch.amp.GradScaler | None = ...,
    objects: Mapping[str, Stateful] | None = ...,
    grad: GradState | None = ...,
    loader: LoaderState | None = ...,
    extra: Mapping[str, Any] | None = ...,
    keep_last: int | None = ...,
    save_rng: bool = ...,
    asynchronous: Literal[True],
    pending: PendingCheckpoint | None = ...,
) -> PendingCheckpoint: ...


def save_checkpoint(
    ctx: DistributedContext,
    directory: str | os.PathLike[str],
    *,
    models: nn.Module | Sequence[nn.Module] = (),
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    schedulers: Stateful | Sequence[Stateful] = (),
    scaler: torch.amp.GradScaler | None = None,
    objects: Mapping[str, Stateful] | None = None,
    grad: GradState | None = None,
    loader: LoaderState | None = None,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    save_rng: bool = True,
    asynchronous: bool = False,
    pending: PendingCheckpoint | None = None,
) -> Path | PendingCheckpoint:
    """Write a new checkpoint of the training state into ``directory`` (collective).

    Every rank calls it with the same arguments (its own replica or shards); nothing
    passed is changed and no RNG is advanced. It returns on every rank once the
    checkpoint is complete and ``directory/latest`` names it.

    With 2 DDP processes and one model and optimizer, ``checkpoint-000001`` gets
    ``model_0.pt`` and ``optimizer_0.pt`` from rank 0, ``rng_rank_0.pt`` and
    ``rng_rank_1.pt`` from each rank, then ``manifest.json``.

    With ``asynchronous=True`` it returns a ``PendingCheckpoint`` as soon as the
    state is staged, and a background thread writes the files while training
    goes on. What only the saved optimizers' steps change (their CPU parameters
    and state) is copied into CPU memory by that thread while the next forward
    and backward passes run; each saved optimizer's ``step()`` waits for the copy,
    and a tensor of that kind changed in place otherwise before its copy fails
    the save (``handle.wait_staged()`` first makes such a change safe).
    Everything else is copied before the return; ``pending.wait()``, called on every rank (or the
    next ``save_checkpoint`` into ``directory``), completes the checkpoint and
    raises any failure of the background writing. ``latest`` moves only then, so
    a process killed before leaves the previous checkpoint current. With FSDP2
    or mesh models on several processes the sharded ``dcp/`` part goes through
    DCP's ``async_save`` (shards copied to CPU before the return; planning and
    writing in DCP's thread, over a gloo group made for this save).

    Args:
        ctx: the distributed context.
        directory: where this run's checkpoints go, shared by all ranks (created if
            missing).
        models: models, wrapped or not; saved unwrapped, FSDP2 ones sharded.
        optimizers: their optimizers (with FSDP2, each updates one of ``models``).
        schedulers: LR schedulers, or anything with ``state_dict``.
        scaler: the fp16 grad scaler, if any.
        objects: other ``Stateful`` objects by name; rank 0's state is saved.
        grad: the ``GradState``; its window must be closed (``micro_step == 0``).
        loader: the ``LoaderState`` to resume from (the last ``batch.state``).
        extra: JSON values (str, int, finite float, bool, None, list, dict).
        keep_last: keep only the newest ``keep_last`` checkpoints (>= 1).
        save_rng: save each rank's Python, torch, CUDA and NumPy RNG states.
        asynchronous: write in the background and return a ``PendingCheckpoint``.
        pending: the handle of the previous asynchronous save, completed first;
            an asynchronous save stages into its CPU copy's memory (no new
            allocation) when the state has the same tensors' storages and sizes.

    Returns:
        The new checkpoint's path, ``directory/checkpoint-NNNNNN``; with
        ``asynchronous=True`` a ``PendingCheckpoint`` whose ``wait()`` returns it.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an open accumulation window, non-JSON ``extra``, a bad
            ``keep_last`` or object name.
        RuntimeError: a rank failed to write (raised on every rank; the previous
            checkpoint stays current), no process group matching ``ctx``, or
            (with ``ctx.collective_timeout``) a rank that did not call it in time;
            also the failure of an earlier asynchronous save it completes.
    """
    caller = "save_checkpoint"
    objs = _formats.check_state_objects(
        ctx, caller, models, optimizers, schedulers, scaler, objects
    )
    extra_dict = _check_save_values(caller, grad, loader, extra, keep_last)
    check_bool(caller, "save_rng", save_rng)
    check_bool(caller, "asynchronous", asynchronous)
    state_format = _formats.choose_format(objs.models)
    if state_format == "dcp":
        _formats.pair_optimizers(objs.models, objs.optimizers, caller=caller)
    what = "the PendingCheckpoint an asynchronous save returned, or None"
    check_type(caller, "pending", pending, PendingCheckpoint, what=what, optional=True)
    root = Path(directory)
    reusable: tuple[torch.UntypedStorage, ...] = ()
    if pending is not None:
        pending.wait()  # collective: the earlier save is numbered before this one
        reusable = take_buffers(pending)  # its staging memory, now free
    guard_collective(ctx, caller)
    name, error = "", None
    if ctx.is_main_process:
        unfinished = own_pending_save(root)
        if unfinished is not None:
            error = (
                f"an asynchronous save into {root} ({unfinished}) is still pending; "
                "pass its PendingCheckpoint as save_checkpoint(..., pending=handle), "
                "or call handle.wait() first"
            )
        else:
            try:
                name = _layout.prepare(root)
            except OSError as failure:
                error = f"cannot create a checkpoint in {root}: {failure}"
    name, error = _all_gather(ctx, (name, error))[0]  # rank 0's decision
    _raise_failures([error], _FAILED, caller)
    temporary = _layout.temporary_dir(root, name)
    sharded_done: Callable[[], str | None] | None = None
    if state_format == "dcp":
        sharded_done = _formats.save_sharded(
            ctx,
            temporary / "dcp",
            objs.models,
            objs.optimizers,
            caller=caller,
            asynchronous=asynchronous,
        )
    elif state_format == "deepspeed":
        save_engine(objs.models[0], temporary / ENGINE_DIR)
    files: dict[str, object] = {}
    try:
        files = _formats.state_files(
            ctx, objs, rng=save_rng, whole=state_format == "torch"
        )
    except (OSError, RuntimeError) as failure:
        error = f"writing into {temporary} failed: {failure}"
    fields = {
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
    finish = functools.partial(
        _finish, ctx, root, name, fields, keep_last=keep_last, caller=caller
    )
    entries: dict[str, FileEntry] = {}
    staged: dict[str, object] = {}
    buffers: tuple[torch.UntypedStorage, ...] = ()
    deferred: DeferredCopy | None = None
    try:
        if error is None and asynchronous:
            # A copy (training may change the originals now), into the previous
            # save's staging memory when the state has the same layout. What
            # only the optimizers' steps change is copied in the background.
            staged, buffers, deferred = stage(
                files, reusable, defer=optimizer_storages(objs.optimizers)
            )
        elif error is None:
            entries = _formats.write_files(temporary, files)
    except (OSError, RuntimeError) as failure:
        error = f"writing into {temporary} failed: {failure}"
    if not asynchronous:
        return finish(entries, error)
    return PendingCheckpoint(
        ctx,
        root,
        root / name,
        temporary,
        lambda: _formats.write_files(temporary, staged),
        finish,
        error=error,
        buffers=buffers,
        deferred=deferred,
        optimizers=objs.optimizers,
        sharded_done=sharded_done,
    )


_FAILED: Final = "the checkpoint was not written (the previous one is still the latest)"


def _finish(
    ctx: DistributedContext,
    root: Path,
    name: str,
    fields: dict[str, Any],
    entries: dict[str, FileEntry],
    error: str | None,
    *,
    keep_last: int | None,
    caller: str,
) -> Path:
    """Commit a checkpoint whose files every rank has written (collective).

    The ranks agree that all wrote; rank 0 writes the manifest, renames the
    directory into place, moves ``latest`` and prunes. Also the barrier: no rank
    returns before the checkpoint is complete.
    """
    gathered = _all_gather(ctx, (entries, error))
    _raise_failures([e for _, e in gathered], _FAILED, caller)
    temporary = _layout.temporary_dir(root, name)
    commit_error: str | None = None
    pruning: str | None = None
    if ctx.is_main_process:
        files = {k: v for rank_entries, _ in gathered for k, v in rank_entries.items()}
        if fields["state_format"] == "dcp":
            for key, size in _layout.file_sizes(temporary / "dcp").items():
                files[f"dcp/{key}"] = FileEntry(size=size)
        elif fields["state_format"] == "deepspeed":
            for key, size in engine_files(temporary).items():
                files[key] = FileEntry(size=size)
        meta = CheckpointMeta(**fields, files=files)
        try:
            _layout.commit(root, name, meta.to_dict())
        except OSError as failure:
            commit_error = f"committing {temporary} failed: {failure}"
        else:
            try:
                _layout.prune(root, keep_last=keep_last)
            except OSError as failure:
                pruning = str(failure)
    outcome = _all_gather(ctx, (commit_error, pruning))
    _raise_failures([e for e, _ in outcome], _FAILED, caller)
    done = f"{root / name} is written and current, but deleting older ones failed"
    _raise_failures([p for _, p in outcome], done, caller)
    return root / name


def load_checkpoint(
    ctx: DistributedContext,
    path: str | os.PathLike[str],
    *,
    models: nn.Module | Sequence[nn.Module] = (),
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    schedulers: Stateful | Sequence[Stateful] = (),
    scaler: torch.amp.GradScaler | None = None,
    objects: Mapping[str, Stateful] | None = None,
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

    Args:
        ctx: the distributed context.
        path: a checkpoint directory, e.g. ``latest_checkpoint(directory)``.
        models, optimizers, schedulers, scaler, objects: loaded in place.
        restore_rng: restore this rank's RNG states.
        verify: check the SHA-256 of every hashed file before loading.

    Returns:
        A ``LoadedState`` with the ``GradState``, ``LoaderState`` and ``extra``.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an incomplete, damaged or other-schema checkpoint, or objects
            that do not match it; the message names the file.
        RuntimeError: another rank failed to read it, no matching group, or (with
            ``ctx.collective_timeout``) a rank that did not call it in time.
    """
    caller = "load_checkpoint"
    objs = _formats.check_state_objects(
        ctx, caller, models, optimizers, schedulers, scaler, objects
    )
    check_bool(caller, "restore_rng", restore_rng)
    check_bool(caller, "verify", verify)
    root = Path(path)
    guard_collective(ctx, caller)
    meta = _read_checked(ctx, root, objs, verify=verify, caller=caller)
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
    return LoadedState(path=root, meta=meta, rng_restored=restored)
