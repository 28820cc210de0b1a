"""How a checkpoint lies on disk: numbered directories, atomic commits, tensor files.

**Directories.** Checkpoints are ``checkpoint-000001``, ``checkpoint-000002``, ... in
the run's directory, next to a pointer file ``latest`` naming the newest. A save
writes into ``.checkpoint-N.tmp``; ``commit`` writes the manifest last, renames the
directory into place, replaces ``latest`` atomically and only then deletes old
checkpoints, so a process killed at any moment leaves ``latest`` naming a complete
checkpoint.

**Tensors.** Two formats, chosen by ``choose_format`` from the models being saved:

- ``"torch"`` (one process, or DDP, where every rank holds the whole model): rank 0
  writes each (unwrapped) model's, optimizer's, scheduler's and the scaler's
  ``state_dict()`` to its own file with ``torch.save``; every rank reads them back
  with ``torch.load(..., weights_only=True)``.
- ``"dcp"`` (any model sharded by FSDP2): models and optimizers go through
  ``torch.distributed.checkpoint``; each rank writes its own shards, and DCP
  reshards on load, so a checkpoint written on 2 processes loads on 1 or 3.

Every file written here is flushed and ``fsync``-ed before the caller renames the
checkpoint into place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
from collections.abc import Iterator
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Final
from typing import Literal
from typing import TypeAlias

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict
from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from funcaccel._fsdp import is_fsdp_module
from funcaccel.context import DistributedContext
from funcaccel.model import unwrap_model

__all__ = [
    "LATEST_NAME",
    "MANIFEST_NAME",
    "StateFormat",
    "checkpoint_dirs",
    "choose_format",
    "commit",
    "file_sizes",
    "fsync_directory",
    "load_sharded",
    "pair_optimizers",
    "prepare",
    "read_torch_file",
    "save_sharded",
    "sha256_of",
    "temporary_dir",
    "write_torch_file",
]

StateFormat: TypeAlias = Literal["torch", "dcp"]
MANIFEST_NAME: Final = "manifest.json"
LATEST_NAME: Final = "latest"
_NAME_RE: Final = re.compile(r"checkpoint-(\d+)")
_CHUNK: Final = 1 << 20


def checkpoint_dirs(root: Path) -> list[Path]:
    """Return the numbered checkpoint directories in ``root``, complete or not, in order.

    Hidden temporary directories (``.checkpoint-N.tmp``) are not included.
    """
    if not root.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for path in root.iterdir():
        match = _NAME_RE.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def temporary_dir(root: Path, name: str) -> Path:
    """Return where checkpoint ``name`` is written before it is committed."""
    return root / f".{name}.tmp"


def prepare(root: Path) -> str:
    """Create ``root`` and an empty temporary directory for the next checkpoint.

    Run on rank 0 only. A temporary directory left by a save that was killed is
    deleted first (it was never complete).

    Returns:
        The new checkpoint's name, one past the highest number in ``root``.
    """
    root.mkdir(parents=True, exist_ok=True)
    existing = checkpoint_dirs(root)
    number = int(existing[-1].name.split("-")[1]) + 1 if existing else 1
    name = f"checkpoint-{number:06d}"
    temporary = temporary_dir(root, name)
    if temporary.exists():
        shutil.rmtree(temporary)
    temporary.mkdir()
    return name


def file_sizes(directory: Path) -> dict[str, int]:
    """Return ``{name: size}`` for the files directly in ``directory`` (fsyncs it)."""
    sizes = {
        p.name: p.stat().st_size for p in sorted(directory.iterdir()) if p.is_file()
    }
    fsync_directory(directory)
    return sizes


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def commit(
    root: Path, name: str, manifest: dict[str, object], *, keep_last: int | None
) -> None:
    """Make checkpoint ``name`` complete and current; run on rank 0 after all wrote.

    In order: write ``manifest.json`` into the temporary directory, rename it to
    ``root/name``, replace ``root/latest``, then delete other temporary directories
    and all but the newest ``keep_last`` checkpoints (``None``: keep all). Each step
    is fsynced before the next, so a crash leaves ``latest`` naming a complete one.
    """
    temporary = temporary_dir(root, name)
    _write_synced(temporary / MANIFEST_NAME, json.dumps(manifest, indent=1))
    fsync_directory(temporary)
    os.rename(temporary, root / name)
    fsync_directory(root)
    pending = root / f".{LATEST_NAME}.tmp"
    _write_synced(pending, name + "\n")
    os.replace(pending, root / LATEST_NAME)
    fsync_directory(root)
    for path in root.iterdir():
        if path.name.startswith(".checkpoint-") and path.name.endswith(".tmp"):
            shutil.rmtree(path)
    if keep_last is not None:
        complete = [p for p in checkpoint_dirs(root) if (p / MANIFEST_NAME).is_file()]
        for old in complete[:-keep_last]:
            # Renamed first, so that a crash never leaves it half-deleted under a
            # name that looks complete.
            doomed = root / f".{old.name}.deleting.tmp"
            os.rename(old, doomed)
            shutil.rmtree(doomed)


def choose_format(models: Sequence[nn.Module]) -> StateFormat:
    """Return ``"dcp"`` when any model is sharded by FSDP2, else ``"torch"``.

    >>> choose_format([nn.Linear(1, 1)])
    'torch'
    """
    return "dcp" if any(is_fsdp_module(unwrap_model(m)) for m in models) else "torch"


def sha256_of(path: Path) -> str:
    """Return the hex SHA-256 of the file at ``path``."""
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_directory(path: Path) -> None:
    """Flush ``path``'s directory entries (new or renamed names) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_torch_file(obj: object, path: Path) -> tuple[int, str]:
    """Write ``obj`` with ``torch.save`` to a new file and ``fsync`` it.

    Returns:
        The file's size in bytes and its hex SHA-256.
    """
    with path.open("xb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())
    return path.stat().st_size, sha256_of(path)


def read_torch_file(path: Path, *, caller: str) -> Any:
    """Read a file written by ``write_torch_file`` onto the CPU, weights only.

    Raises:
        ValueError: the file is missing, truncated or not a weights-only torch file;
            the message names the file.
    """
    if not path.is_file():
        msg = (
            f"{caller}: {path} is missing; the checkpoint is incomplete. Load an "
            "earlier one (see list_checkpoints)."
        )
        raise ValueError(msg)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (
        RuntimeError,
        EOFError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
    ) as error:
        msg = (
            f"{caller}: {path} cannot be read ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no detail'}); the file "
            "is truncated or damaged. Load an earlier checkpoint (see "
            "list_checkpoints)."
        )
        raise ValueError(msg) from error


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
            msg = (
                f"{caller}: optimizers[{index}] updates parameters that are not all in "
                f"one of the {len(models)} model(s) passed; sharded (DCP) checkpoints "
                "save an optimizer with its model, so pass every model the optimizers "
                "update, and use one optimizer per model."
            )
            raise ValueError(msg)
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
    models: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    pairs: Sequence[int],
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for index, model in enumerate(models):
        state[f"model_{index}"] = get_model_state_dict(model)
    for index, (optimizer, owner) in enumerate(zip(optimizers, pairs, strict=True)):
        state[f"optimizer_{index}"] = get_optimizer_state_dict(models[owner], optimizer)
    return state


def save_sharded(
    ctx: DistributedContext,
    directory: Path,
    models: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    caller: str,
) -> None:
    """Write the models' and optimizers' (sharded) state to ``directory`` with DCP.

    Collective: every rank calls it with its own shards.
    """
    pairs = pair_optimizers(models, optimizers, caller=caller)
    state = _dcp_state(models, optimizers, pairs)
    writer = FileSystemWriter(directory, sync_files=True, overwrite=False)
    with _single_process_warning_ignored():
        dcp_save(state, storage_writer=writer, no_dist=ctx.num_processes == 1)


def load_sharded(
    ctx: DistributedContext,
    directory: Path,
    models: Sequence[nn.Module],
    optimizers: Sequence[torch.optim.Optimizer],
    *,
    caller: str,
) -> None:
    """Load ``models`` and ``optimizers`` in place from a DCP checkpoint in ``directory``.

    Works for FSDP2, DDP and plain modules alike, on any world size: DCP reads the
    parts of each tensor this rank holds. Collective with several processes.

    Raises:
        ValueError: the checkpoint does not hold these models' tensors (different
            architecture, or a different number of models or optimizers).
    """
    pairs = pair_optimizers(models, optimizers, caller=caller)
    state = _dcp_state(models, optimizers, pairs)
    reader = FileSystemReader(directory)
    try:
        with _single_process_warning_ignored():
            dcp_load(state, storage_reader=reader, no_dist=ctx.num_processes == 1)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        msg = (
            f"{caller}: the sharded state in {directory} does not fit the models and "
            f"optimizers passed ({first}); pass the same architecture, models and "
            "optimizers as when it was saved."
        )
        raise ValueError(msg) from error
    for index, model in enumerate(models):
        set_model_state_dict(model, state[f"model_{index}"])
    for index, (optimizer, owner) in enumerate(zip(optimizers, pairs, strict=True)):
        set_optimizer_state_dict(models[owner], optimizer, state[f"optimizer_{index}"])
