"""The torch objects a checkpoint holds, and how their state reaches the disk.

``check_state_objects`` validates what a caller passes to save or load (models,
optimizers, schedulers, scaler, other ``Stateful`` objects) into a ``StateObjects``
value. Their tensors are stored in one of three formats, chosen by ``choose_format``:

- ``"torch"`` (one process, or DDP, where every rank holds the whole model): rank 0
  writes each (unwrapped) model's and optimizer's ``state_dict()`` to its own file
  with ``torch.save``; every rank reads them back with
  ``torch.load(..., weights_only=True)`` onto the CPU.
- ``"deepspeed"`` (one DeepSpeed engine): the engine's own checkpoint in
  ``deepspeed/``, each rank writing its ZeRO partitions (``_deepspeed_state.py``).
- ``"dcp"`` (any model sharded by FSDP2, or holding ``DTensor`` parameters from
  tensor parallelism on a mesh): models and optimizers go through
  ``torch.distributed.checkpoint``; each rank writes its own shards, and DCP
  reshards on load, so a checkpoint written on 2 processes loads on 1 or 3, and
  one written on a ``2 x 2`` mesh loads on another mesh shape. What
  DCP would unpickle is vetted first (``_dcp_checks.py``): no pickled code runs.

Schedulers, the scaler and other objects are always whole files from rank 0, and
each rank writes its own RNG file and, when asked, its per-rank part. Every file is fsynced after writing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from collections.abc import Callable
from collections.abc import Collection
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any
from typing import Final
from typing import Literal
from typing import TypeAlias
from typing import TypeVar

import torch
from torch import nn

from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import summary
from funcaccel._checks import type_name
from funcaccel._ctx_checks import check_context
from funcaccel._dist_types import is_deepspeed_engine
from funcaccel._dist_types import is_dtensor
from funcaccel._dist_types import is_fsdp_module
from funcaccel._typing import Stateful
from funcaccel.checkpoint import _layout
from funcaccel.checkpoint._dcp_checks import check_dcp_metadata
from funcaccel.checkpoint._dcp_checks import check_dcp_value
from funcaccel.checkpoint._dcp_names import load_model_state
from funcaccel.checkpoint._dcp_names import load_optimizer_state
from funcaccel.checkpoint._dcp_names import model_state
from funcaccel.checkpoint._dcp_names import optimizer_state
from funcaccel.checkpoint._deepspeed_state import ENGINE_DIR
from funcaccel.checkpoint._deepspeed_state import check_engine_objects
from funcaccel.checkpoint._deepspeed_state import load_engine
from funcaccel.checkpoint._manifest import FileEntry
from funcaccel.checkpoint._members import DAMAGED
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.model import Pipeline
from funcaccel.model import unwrap_model
from funcaccel.rng import capture_rng_state

__all__ = [
    "StateFormat",
    "StateObjects",
    "Stateful",
    "check_state_objects",
    "choose_format",
    "load_sharded",
    "load_state",
    "load_state_file",
    "load_state_objects",
    "pair_optimizers",
    "rank_part_name",
    "save_sharded",
    "state_files",
    "write_files",
]

StateFormat: TypeAlias = Literal["torch", "dcp", "deepspeed"]
T = TypeVar("T")
_MSG_KEY: Final = (
    "{}: {} keys name files and must be letters, digits and '_'; got {!r}."
)
# caller, the optimizer's index, how many models
_MSG_UNPAIRED: Final = (
    "{0}: optimizers[{1}] updates parameters that are not all in one of the {2} "
    "model(s) passed; sharded (DCP) checkpoints save an optimizer with its model, so "
    "pass every model the optimizers update, and use one optimizer per model."
)


def _as_tuple(
    value: object, kind: type[T], what: str, name: str, caller: str
) -> tuple[T, ...]:
    if isinstance(value, kind):
        return (value,)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        items = tuple(value)
        if all(isinstance(item, kind) for item in items):
            return items
    fail_type(caller, name, value, f"{what} or a sequence of them")


@dataclasses.dataclass(frozen=True, slots=True)
class StateObjects:
    """The torch objects a caller passes to save or load, validated, as tuples."""

    models: tuple[nn.Module, ...]
    optimizers: tuple[torch.optim.Optimizer, ...]
    schedulers: tuple[Stateful, ...]
    scaler: torch.amp.GradScaler | None
    named: dict[str, Stateful]
    rank_named: dict[str, Stateful] = dataclasses.field(default_factory=dict)
    """Each rank's own objects (``rank_objects=``), saved in its per-rank part."""


def _check_named(caller: str, name: str, objects: object) -> dict[str, Stateful]:
    """Return a new dict of ``objects`` (a mapping or None) after checking it."""
    mapping = check_type(
        caller,
        name,
        objects,
        Mapping,
        what="a mapping of name to Stateful or None",
        optional=True,
    )
    named = dict(mapping or {})
    for key, value in named.items():
        if not isinstance(key, str) or not key.replace("_", "").isalnum():
            raise ValueError(_MSG_KEY.format(caller, name, key))
        if not isinstance(value, Stateful):
            what = "an object with state_dict()/load_state_dict()"
            fail_type(caller, f"{name}[{key!r}]", value, what)
    return named


def check_state_objects(
    ctx: object,
    caller: str,
    models: object,
    optimizers: object,
    schedulers: object,
    scaler: object,
    objects: object,
    rank_objects: object = None,
) -> StateObjects:
    """Validate what ``caller`` was given (and its process group) into a record.

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: an ``objects`` key that cannot name a file.
        RuntimeError: ``ctx`` has several processes and no matching default group.
    """
    ctx = check_context(caller, ctx)
    scaler = check_type(
        caller,
        "scaler",
        scaler,
        torch.amp.GradScaler,
        what="a torch.amp.GradScaler or None",
        optional=True,
    )
    named = _check_named(caller, "objects", objects)
    rank_named = _check_named(caller, "rank_objects", rank_objects)
    require_process_group(ctx, caller)
    record = StateObjects(
        _as_tuple(models, nn.Module, "an nn.Module", "models", caller),
        _as_tuple(
            optimizers,
            torch.optim.Optimizer,
            "a torch.optim.Optimizer",
            "optimizers",
            caller,
        ),
        _as_tuple(
            schedulers,
            Stateful,  # type: ignore[type-abstract]
            "an object with state_dict()/load_state_dict()",
            "schedulers",
            caller,
        ),
        scaler,
        named,
        rank_named,
    )
    check_engine_objects(record.models, record.optimizers, caller)
    return record


def choose_format(models: Sequence[nn.Module]) -> StateFormat:
    """Return ``"deepspeed"`` for a DeepSpeed engine, ``"dcp"`` when any model is
    sharded (FSDP2 or ``DTensor`` parameters), else ``"torch"``.

    A tensor-parallel model on a mesh (``wrap_model(..., tp_plan=...)``) holds
    ``DTensor`` parameters without being an FSDP2 module; it is sharded too.

    >>> choose_format([nn.Linear(1, 1)])
    'torch'
    """
    if any(is_deepspeed_engine(m) for m in models):
        return "deepspeed"
    if any(isinstance(unwrap_model(m), Pipeline) for m in models):
        return "dcp"  # each rank holds only its stages
    sharded = any(
        is_fsdp_module(inner) or any(is_dtensor(p) for p in inner.parameters())
        for inner in map(unwrap_model, models)
    )
    return "dcp" if sharded else "torch"


def pair_optimizers(
    models: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    caller: str,
) -> tuple[int, ...]:
    """Return, per optimizer, the index of the model that owns all its parameters.

    DCP names optimizer state by parameter names, so each optimizer is saved
    together with its model.

    Raises:
        ValueError: an optimizer whose parameters are not all in one model.

    >>> net = nn.Linear(2, 1)
    >>> pair_optimizers([nn.Linear(1, 1), net], [torch.optim.SGD(net.parameters())], caller="f")
    (1,)
    """
    owners = [{id(p) for p in unwrap_model(m).parameters()} for m in models]
    pairs: list[int] = []
    for index, optimizer in enumerate(optimizers):
        params = {id(p) for g in optimizer.param_groups for p in g["params"]}
        found = [i for i, owned in enumerate(owners) if params <= owned]
        if not found:
            raise ValueError(_MSG_UNPAIRED.format(caller, index, len(models)))
        pairs.append(found[0])
    return tuple(pairs)


@contextlib.contextmanager
def _single_process_warning_ignored() -> Iterator[None]:
    # DCP warns on every single-process call that it "assumes the intent is to load
    # in a single process"; with one process that is exactly the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled", category=UserWarning
        )
        yield


def _dcp_state(
    objs: StateObjects, caller: str
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """Return the state DCP saves or loads in place, and each optimizer's model."""
    # torch.distributed.checkpoint takes seconds to import: only sharded models
    # need it, so it is imported (in _dcp_names) when called.
    models, optimizers = objs.models, objs.optimizers
    pairs = pair_optimizers(models, optimizers, caller=caller)
    state: dict[str, Any] = {}
    for index, model in enumerate(models):
        state[f"model_{index}"] = model_state(model)
    for index, (optimizer, owner) in enumerate(zip(optimizers, pairs, strict=True)):
        state[f"optimizer_{index}"] = optimizer_state(models[owner], optimizer)
    return state, pairs


def save_sharded(
    ctx: DistributedContext,
    directory: Path,
    objs: StateObjects,
    *,
    caller: str,
    asynchronous: bool = False,
) -> Callable[[], str | None]:
    """Write ``objs``' models' and optimizers' (sharded) state to ``directory`` with DCP.

    Collective: every rank calls it with its own shards. Returns the completion,
    which waits for the files and returns an error message, or ``None`` when
    they are written. Synchronously (and always with one process) the files are
    written before this returns. With ``asynchronous`` and several processes it
    uses DCP's ``async_save``: DCP copies this rank's shards into CPU memory
    before this returns; its planning, writing and metadata then run in DCP's
    background thread, whose collectives go through a gloo group made for this
    save alone (never interleaved with the training loop's on the default
    group), freed by the completion.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    state, _ = _dcp_state(objs, caller)
    writer = FileSystemWriter(directory, sync_files=True, overwrite=False)
    if not asynchronous or ctx.num_processes == 1:
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        with _single_process_warning_ignored():
            dcp_save(state, storage_writer=writer, no_dist=ctx.num_processes == 1)
        return lambda: None
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_saver import async_save

    group = dist.new_group(backend="gloo")
    try:
        response = async_save(state, storage_writer=writer, process_group=group)
    except BaseException:
        dist.destroy_process_group(group)
        raise
    # A Future, or (with a staging executor, not used here) a pair of them.
    future = response if isinstance(response, Future) else response.upload_completion

    def complete() -> str | None:
        try:
            future.result()
        except Exception as failure:
            return f"writing the sharded state into {directory} failed in the background: {type_name(failure)}: {summary(str(failure), 300)}"
        finally:
            dist.destroy_process_group(group)
        return None

    return complete


def load_sharded(
    ctx: DistributedContext,
    directory: Path,
    objs: StateObjects,
    *,
    listed: Collection[str],
    caller: str,
) -> None:
    """Load ``objs``' models and optimizers in place from a DCP checkpoint in ``directory``.

    Works for FSDP2, DDP and plain modules alike, on any world size: DCP reads the
    parts of each tensor this rank holds. Collective with several processes.
    ``listed`` holds the checked file names of ``directory`` the manifest lists;
    DCP may read no other, and nothing it unpickles may run code.

    Raises:
        ValueError: the checkpoint does not hold these models' tensors (different
            architecture, or a different number of models or optimizers), or its
            metadata or values are crafted or damaged.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    class WeightsOnlyPlanner(DefaultLoadPlanner):
        """DCP's planner, loading a value only once it has loaded weights-only."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            check_dcp_value(value, caller=caller)
            super().load_bytes(read_item, value)

    state, pairs = _dcp_state(objs, caller)
    check_dcp_metadata(directory, listed, caller=caller)
    reader = FileSystemReader(directory)
    try:
        with _single_process_warning_ignored():
            dcp_load(
                state,
                storage_reader=reader,
                planner=WeightsOnlyPlanner(),
                no_dist=ctx.num_processes == 1,
            )
    except (CheckpointException, RuntimeError, ValueError, KeyError) as error:
        if DAMAGED in str(error):  # from the checks above, maybe wrapped by DCP
            raise ValueError(summary(str(error), 600)) from error
        first = str(error).splitlines()[0] if str(error) else type_name(error)
        msg = (
            f"{caller}: the sharded state in {directory} does not fit the models and "
            f"optimizers passed ({first}); pass the same architecture, models and "
            "optimizers as when it was saved."
        )
        raise ValueError(msg) from error
    models = objs.models
    for index, model in enumerate(models):
        load_model_state(model, state[f"model_{index}"])
    for index, (optimizer, owner) in enumerate(
        zip(objs.optimizers, pairs, strict=True)
    ):
        load_optimizer_state(models[owner], optimizer, state[f"optimizer_{index}"])


def state_files(
    ctx: DistributedContext,
    objs: StateObjects,
    *,
    rng: bool,
    whole: bool,
    rank_part: dict[str, object] | None = None,
) -> dict[str, object]:
    """Return this rank's files of a checkpoint as ``{name: state}``, not yet written.

    Every rank has its RNG file (with ``rng``) and, given ``rank_part`` (its
    per-rank values), its ``rank_part_<r>.pt`` holding them with its
    ``rank_objects``' states; rank 0 the schedulers, scaler and named objects, and
    with ``whole`` the unwrapped models and the optimizers (replicated under DDP,
    so one copy suffices). The states are the objects' own ``state_dict()``s:
    their tensors are the live ones, not copies.
    """
    files: dict[str, object] = {}
    if rng:
        files[f"rng_rank_{ctx.process_index}.pt"] = capture_rng_state()
    if rank_part is not None:
        objects = {key: value.state_dict() for key, value in objs.rank_named.items()}
        files[rank_part_name(ctx.process_index)] = {**rank_part, "objects": objects}
    if not ctx.is_main_process:
        return files
    if whole:
        for index, model in enumerate(objs.models):
            files[f"model_{index}.pt"] = unwrap_model(model).state_dict()
        for index, optimizer in enumerate(objs.optimizers):
            files[f"optimizer_{index}.pt"] = optimizer.state_dict()
    for index, scheduler in enumerate(objs.schedulers):
        files[f"scheduler_{index}.pt"] = scheduler.state_dict()
    if objs.scaler is not None:
        files["scaler.pt"] = objs.scaler.state_dict()
    for key, value in objs.named.items():
        files[f"object_{key}.pt"] = value.state_dict()
    return files


def rank_part_name(rank: int) -> str:
    """Return the file name of rank ``rank``'s per-rank part.

    >>> rank_part_name(1)
    'rank_part_1.pt'
    """
    return f"rank_part_{rank}.pt"


def write_files(temporary: Path, files: Mapping[str, object]) -> dict[str, FileEntry]:
    """Write each state of ``files`` to ``temporary / name`` (fsynced).

    Returns:
        The manifest entries of the files written, by name.
    """
    entries: dict[str, FileEntry] = {}
    for name, obj in files.items():
        size, digest = _layout.write_torch_file(obj, temporary / name)
        entries[name] = FileEntry(size=size, sha256=digest)
    return entries


def load_state_file(target: Stateful, file: Path, what: str, caller: str) -> None:
    """Load ``target`` in place from ``file``; ``what`` names it in errors.

    Raises:
        ValueError: the file is unreadable or its state does not fit ``target``.
    """
    state = _layout.read_torch_file(file, caller=caller)
    load_state(target, state, file, what, caller)


def load_state(
    target: Stateful, state: object, file: Path, what: str, caller: str
) -> None:
    """Load ``target`` in place from ``state``, read from ``file``; errors name both.

    Raises:
        ValueError: the state does not fit ``target``.
    """
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError, TypeError) as error:
        reason = None
        if isinstance(target, nn.Module) and isinstance(state, Mapping):
            reason = _module_mismatch(target, state)
        if reason is None:
            text = str(error).strip()
            reason = f"{type_name(error)}: {text.splitlines()[0] if text else ''}"
        msg = (
            f"{caller}: {file} does not fit {what} ({reason}); "
            f"pass the same {what.split('[')[0]} as when the checkpoint was saved."
        )
        raise ValueError(msg) from error


_MISMATCH_SHOWN = 4
"""How many keys of each kind a mismatch message names before counting the rest."""


def _module_mismatch(module: nn.Module, state: Mapping[Any, object]) -> str | None:
    """Describe how ``state`` differs from ``module.state_dict()``, or ``None``.

    Names each key whose shape differs (checkpoint vs model), then the keys only
    the model has and those only the checkpoint has; a few of each, then a count.

    >>> _module_mismatch(nn.Linear(2, 3), nn.Linear(2, 1).state_dict())
    'shape mismatch: weight (checkpoint (1, 2), model (3, 2)), bias (checkpoint (1,), model (3,))'
    >>> _module_mismatch(nn.Linear(2, 3), {"weight": torch.zeros(3, 2)})
    'missing from the checkpoint: bias'
    """
    own = module.state_dict()
    shapes = [
        f"{key} (checkpoint {tuple(value.shape)}, model {tuple(own[key].shape)})"
        for key, value in state.items()
        if key in own
        and isinstance(value, torch.Tensor)
        and value.shape != own[key].shape
    ]
    missing = [str(key) for key in own if key not in state]
    unexpected = [str(key) for key in state if key not in own]
    parts = [
        f"{label}: {_first_few(items)}"
        for label, items in (
            ("shape mismatch", shapes),
            ("missing from the checkpoint", missing),
            ("not in the model", unexpected),
        )
        if items
    ]
    return "; ".join(parts) if parts else None


def _first_few(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MISMATCH_SHOWN])
    rest = len(items) - _MISMATCH_SHOWN
    return f"{shown} and {rest} more" if rest > 0 else shown


def load_state_objects(
    ctx: DistributedContext,
    root: Path,
    objs: StateObjects,
    *,
    state_format: StateFormat,
    files: Collection[str],
    caller: str,
) -> None:
    """Load every object of ``objs`` in place from the checkpoint in ``root``.

    Collective for the ``"dcp"`` format. Models are loaded unwrapped. ``files``
    holds the (checked) names the manifest lists.

    Raises:
        ValueError: a file is unreadable or does not fit its object.
    """
    if state_format == "deepspeed":
        load_engine(objs.models[0], root / ENGINE_DIR, caller)
    elif state_format == "dcp":
        listed = {name[4:] for name in files if name.startswith("dcp/")}
        load_sharded(ctx, root / "dcp", objs, listed=listed, caller=caller)
    else:
        for index, model in enumerate(objs.models):
            path, what = root / f"model_{index}.pt", f"models[{index}]"
            load_state_file(unwrap_model(model), path, what, caller)
        for index, optimizer in enumerate(objs.optimizers):
            path, what = root / f"optimizer_{index}.pt", f"optimizers[{index}]"
            load_state_file(optimizer, path, what, caller)
    for index, scheduler in enumerate(objs.schedulers):
        path, what = root / f"scheduler_{index}.pt", f"schedulers[{index}]"
        load_state_file(scheduler, path, what, caller)
    if objs.scaler is not None:
        load_state_file(objs.scaler, root / "scaler.pt", "scaler", caller)
    for key, value in objs.named.items():
        load_state_file(value, root / f"object_{key}.pt", f"objects[{key!r}]", caller)
