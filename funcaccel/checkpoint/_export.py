"""Export a trained model's weights for inference and the Hugging Face ecosystem.

``save_model(ctx, model, directory)`` writes the full (unwrapped, unsharded) state
dict of a plain, DDP or FSDP2 model as safetensors files laid out as transformers'
``from_pretrained`` reads them; ``load_model(ctx, model, directory)`` loads such an
export (or one written by transformers) back into a plain, DDP or FSDP2 model. An
export holds weights only: resume training from ``save_checkpoint`` instead.

>>> import tempfile
>>> from safetensors.torch import load_file
>>> with tempfile.TemporaryDirectory() as run:
...     out = save_model(DistributedContext(), nn.Linear(2, 1), f"{run}/model")
...     sorted(p.name for p in out.iterdir()), sorted(load_file(out / "model.safetensors"))
(['model.safetensors'], ['bias', 'weight'])
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Final

import torch
from torch import nn

from funcaccel._checks import check_bool
from funcaccel._checks import check_type
from funcaccel._dist_types import is_deepspeed_engine
from funcaccel._dist_types import is_dtensor
from funcaccel._guard import guard_collective
from funcaccel.checkpoint import _export_files
from funcaccel.checkpoint._agree import _all_gather
from funcaccel.checkpoint._agree import _raise_any
from funcaccel.checkpoint._agree import _raise_failures
from funcaccel.checkpoint._deepspeed_state import gathered_ctx
from funcaccel.checkpoint._export_dir import commit_export
from funcaccel.checkpoint._export_dir import export_source
from funcaccel.checkpoint._export_dir import prepare_export
from funcaccel.checkpoint._export_pipeline import whole_model
from funcaccel.checkpoint._export_plan import ExportEntry
from funcaccel.checkpoint._export_plan import index_name
from funcaccel.checkpoint._export_plan import parse_shard_size
from funcaccel.checkpoint._export_plan import plan_export
from funcaccel.checkpoint._export_plan import plan_shards
from funcaccel.checkpoint._export_plan import shard_names
from funcaccel.checkpoint._export_plan import tied_names
from funcaccel.context import DistributedContext
from funcaccel.context import require_process_group
from funcaccel.model import Pipeline
from funcaccel.model import unwrap_model

__all__ = ["load_model", "save_model"]

_LISTED: Final = 10
_EXPORT_FAILED: Final = (
    "the export was not written (the previous one, if any, is unchanged)"
)
_DIFFERENT_MODELS: Final = (
    "the ranks' models have different state dicts (names, shapes or dtypes); every "
    "rank must pass its replica or shards of the same model."
)


def _check_call(ctx: object, model: object, directory: object, caller: str) -> Path:
    hint = "Build one with build_context()."
    ctx = check_type(caller, "ctx", ctx, DistributedContext, hint=hint)
    what = "a torch.nn.Module (wrapped or not)"
    check_type(caller, "model", model, nn.Module, what=what)
    what = "a str or os.PathLike"
    directory = check_type(
        caller, "directory", directory, (str, os.PathLike), what=what
    )
    require_process_group(ctx, caller)
    return Path(directory)


def _for_file(tensor: torch.Tensor) -> torch.Tensor:
    """Return ``tensor`` on the CPU, owning its whole storage (copied only if needed)."""
    tensor = tensor.detach().cpu()
    owns = (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )
    return tensor if owns else tensor.clone(memory_format=torch.contiguous_format)


def save_model(
    ctx: DistributedContext,
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    safe_serialization: bool = True,
    durable: bool = False,
) -> Path:
    """Export ``model``'s full weights into ``directory`` (collective; rank 0 writes).

    Every rank calls it; ``model`` is not changed. The unwrapped, unsharded state
    dict is written as transformers' ``save_pretrained`` writes it, for inference
    and ``from_pretrained``: ``model.safetensors`` when it fits in
    ``max_shard_size``, else ``model-00001-of-0000N.safetensors`` ... and
    ``model.safetensors.index.json``. FSDP2 parameters are gathered one tensor at
    a time and rank 0 holds at most one file's tensors at once: with 2 FSDP2 ranks
    and ``max_shard_size="1GB"`` on a 2.5 GB model, both ranks gather each tensor
    and rank 0 writes ``model-00001-of-00003.safetensors`` once its first 1 GB is
    gathered, then the next two files and the index. The new weights replace the
    previous ones atomically; other files in ``directory`` (``config.json``) are
    kept. Tied weights, DeepSpeed engines, ``.bin`` files and durability:
    docs/checkpoint.md#exporting-weights-save_model-and-load_model.

    Args:
        ctx: the distributed context.
        model: the model, plain, DDP-wrapped, sharded by FSDP2, a DeepSpeed engine,
            or a ``Pipeline`` (its stages gathered, the model's own names).
        directory: where the export goes, seen by rank 0 (created if missing).
        max_shard_size: the largest file, in bytes or as a string: ``"5GB"`` is
            5 * 10**9 bytes, ``"5GiB"`` 5 * 2**30 (also KB, MB, KiB, MiB).
        safe_serialization: safetensors (``True``) or ``torch.save`` files.
        durable: fsync the files and directories (power-loss safe) before returning.

    Returns:
        ``Path(directory)``, on every rank once the export is complete.

    Raises:
        TypeError: an argument of the wrong type, or a state-dict value that is
            not a tensor.
        ValueError: a bad ``max_shard_size``, or ranks holding different models.
        RuntimeError: writing failed (raised on every rank; the previous export
            is unchanged), no process group matching ``ctx``, or a rank that did
            not call it within ``ctx.collective_timeout``.
    """
    caller = "save_model"
    root = _check_call(ctx, model, directory, caller)
    inner = unwrap_model(model)
    if isinstance(inner, Pipeline):
        # The stages gathered into one module of the model's own names.
        return save_model(
            ctx,
            whole_model(inner),
            directory,
            max_shard_size=max_shard_size,
            safe_serialization=safe_serialization,
            durable=durable,
        )
    if is_deepspeed_engine(model):
        with gathered_ctx(model):  # ZeRO-3: every rank holds the full weights
            return save_model(
                ctx,
                unwrap_model(model),
                directory,
                max_shard_size=max_shard_size,
                safe_serialization=safe_serialization,
                durable=durable,
            )
    limit = parse_shard_size(max_shard_size, caller=caller)
    safe = check_bool(caller, "safe_serialization", safe_serialization)
    check_bool(caller, "durable", durable)
    module = unwrap_model(model)
    state = module.state_dict()
    entries, _ = plan_export(module, state, caller=caller)
    shards = plan_shards(entries, limit)
    files = dict(zip(shard_names(len(shards), safe=safe), shards, strict=True))
    guard_collective(ctx, caller)
    if any(plan != entries for plan in _all_gather(ctx, entries)):
        raise ValueError(f"{caller}: {_DIFFERENT_MODELS}")
    temporary = _prepare(ctx, root, caller)
    error = _write_files(ctx, state, files, temporary, safe=safe, durable=durable)
    if temporary is not None:
        error = _complete(root, temporary, files, error, safe=safe, durable=durable)
    _raise_failures(_all_gather(ctx, error), _EXPORT_FAILED, caller)
    return root


def _prepare(ctx: DistributedContext, root: Path, caller: str) -> Path | None:
    """Create the export's temporary directory on rank 0 (collective): it, or None.

    Raises ``RuntimeError`` on every rank when rank 0 cannot.
    """
    temporary: Path | None = None
    error: str | None = None
    if ctx.is_main_process:
        try:
            temporary = prepare_export(root)
        except OSError as failure:
            error = f"cannot prepare {root}: {failure}"
    _raise_failures(_all_gather(ctx, error), _EXPORT_FAILED, caller)
    return temporary


def _write_files(
    ctx: DistributedContext,
    state: dict[str, torch.Tensor],
    files: dict[str, list[ExportEntry]],
    temporary: Path | None,
    *,
    safe: bool,
    durable: bool,
) -> str | None:
    """Gather each file's tensors and write it on rank 0; return why it failed, if so.

    Without sharded tensors only rank 0 has work; with them every rank gathers
    each tensor in plan order, and the ranks agree after each file to stop together.
    """
    sharded = any(entry.sharded for shard in files.values() for entry in shard)
    error: str | None = None
    for name, shard in files.items():
        if not (sharded or ctx.is_main_process):
            break
        tensors: dict[str, torch.Tensor] = {}
        for entry in shard:
            value = state[entry.name]
            full = value.full_tensor() if is_dtensor(value) else value
            if ctx.is_main_process:
                tensors[entry.name] = _for_file(full)
        if temporary is not None and error is None:
            try:
                _export_files.write_shard(
                    tensors, temporary / name, safe=safe, durable=durable
                )
            except (OSError, RuntimeError, ValueError) as failure:
                error = f"writing {temporary / name} failed: {failure}"
        del tensors
        if sharded and any(e is not None for e in _all_gather(ctx, error)):
            break
    return error


def _complete(
    root: Path,
    temporary: Path,
    files: dict[str, list[ExportEntry]],
    error: str | None,
    *,
    safe: bool,
    durable: bool,
) -> str | None:
    """Rank 0: write the index (several files) and swap the export into ``root``.

    After a failure, before or here, the temporary directory is deleted instead.
    """
    try:
        if error is None and len(files) > 1:
            weight_map = {e.name: name for name, s in files.items() for e in s}
            total = sum(e.nbytes for s in files.values() for e in s)
            _export_files.write_index(
                temporary / index_name(safe=safe), weight_map, total, durable=durable
            )
        if error is None:
            commit_export(root, temporary, durable=durable)
    except OSError as failure:
        error = f"committing {temporary} into {root} failed: {failure}"
    if error is not None:
        shutil.rmtree(temporary, ignore_errors=True)
    return error


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_LISTED])
    return shown + (f" and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def _mismatches(
    module: nn.Module,
    saved: dict[str, _export_files.SavedTensor],
    root: Path,
    caller: str,
) -> str | None:
    """Describe how the export in ``root`` does not fit ``module``, or ``None``."""
    state = module.state_dict()
    tied = tied_names(module, state)
    groups: dict[str, set[str]] = {}
    for name in state:
        kept = tied.get(name, name)
        groups.setdefault(kept, set()).add(name)
    missing = [
        name
        for name in state
        if name not in saved and not groups[tied.get(name, name)] & saved.keys()
    ]
    unexpected = [key for key in saved if key not in state]
    shapes = [
        f"{key}: saved {list(entry.shape)}, model {list(state[key].shape)}"
        for key, entry in saved.items()
        if key in state
        and isinstance(state[key], torch.Tensor)
        and tuple(state[key].shape) != entry.shape
    ]
    problems = []
    if missing:
        problems.append(
            f"missing keys (in the model, not in the export): {_listed(missing)}"
        )
    if unexpected:
        problems.append(
            f"unexpected keys (in the export, not in the model): {_listed(unexpected)}"
        )
    if shapes:
        problems.append(f"different shapes: {_listed(shapes)}")
    if not problems:
        return None
    return (
        f"{caller}: the export in {root} does not fit the model; "
        + "; ".join(problems)
        + ". Pass the architecture (and configuration) that was exported."
    )


def _placed(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Return the file's full ``value`` laid out like the model's ``target``."""
    value = value.to(dtype=target.dtype)
    if not is_dtensor(target):
        return value
    from torch.distributed.tensor import distribute_tensor

    # Every rank read the whole tensor, so each cuts its own part: no communication.
    return distribute_tensor(
        value.to(target.device),
        target.device_mesh,
        target.placements,
        src_data_rank=None,
    )


def load_model(
    ctx: DistributedContext, model: nn.Module, directory: str | os.PathLike[str]
) -> tuple[str, ...]:
    """Load an export into ``model``'s parameters and buffers, in place (collective).

    Reads what ``save_model`` (or transformers' ``save_pretrained``) wrote: the
    safetensors index and files, or ``pytorch_model.bin`` ones. Every rank reads
    the files itself, one file at a time, and copies in its part: the whole
    tensors into a plain or DDP model, its shards into an FSDP2 one. A tied
    weight exported once fills every name it has in ``model``. Nothing is loaded
    unless the export fits: the same names (tied names aside) and shapes. With 2
    FSDP2 ranks, each reads ``model-00001-of-00002.safetensors`` and keeps its half
    of every tensor, then the second file.

    Args:
        ctx: the distributed context.
        model: the model to fill, plain, DDP-wrapped or sharded by FSDP2.
        directory: the export, seen by every rank.

    Returns:
        The names loaded, in file order (a tied weight's duplicate names are not
        listed).

    Raises:
        TypeError: an argument of the wrong type.
        ValueError: no export in ``directory``, a damaged or crafted one (a file
            name leading out of it), or one that does not fit ``model``: the
            message names every missing and unexpected key and both shapes of
            each mismatch. Raised on every rank when any rank finds it.
        RuntimeError: no process group matching ``ctx``, or a rank that did not
            call it within ``ctx.collective_timeout``.
    """
    caller = "load_model"
    root = _check_call(ctx, model, directory, caller)
    module = unwrap_model(model)
    source = export_source(root)
    guard_collective(ctx, caller)
    problem: ValueError | None = None
    try:
        safe, saved = _export_files.read_layout(source, caller=caller)
        mismatch = _mismatches(module, saved, root, caller)
        if mismatch is not None:
            problem = ValueError(mismatch)
    except ValueError as failure:
        problem = failure
    _raise_any(ctx, problem, f"{root} cannot be loaded", caller, ValueError)
    state = module.state_dict()
    loaded: list[str] = []
    for file in dict.fromkeys(entry.file for entry in saved.values()):
        tensors = _export_files.read_shard(source / file, safe=safe, caller=caller)
        part = {k: _placed(v, state[k]) for k, v in tensors.items()}
        del tensors
        with torch.no_grad():
            module.load_state_dict(part, strict=False)
        loaded.extend(part)
    return tuple(loaded)
