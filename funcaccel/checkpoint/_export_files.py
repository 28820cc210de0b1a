"""How an export's files are written, and read back as untrusted input.

``write_shard`` writes one file (safetensors with ``{"format": "pt"}`` metadata, as
transformers writes it, or a weights-only ``torch.save`` dict), fsynced when the
export is to be durable.
``read_layout`` finds an export's files in a directory (the index if there is one,
else the single file), checks every name the index gives as a checkpoint's names
are checked (a plain relative path to a regular file inside the directory), and
returns each tensor's file and shape from the file headers, reading no tensor
data. ``read_shard`` loads one file's tensors onto the CPU; nothing in a file runs
(safetensors holds no code; ``.bin`` files load with ``weights_only=True``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import zipfile
from pathlib import Path
from typing import Final
from typing import cast

import safetensors
import safetensors.torch
import torch

from funcaccel._checks import summary
from funcaccel.checkpoint._export_plan import index_name
from funcaccel.checkpoint._export_plan import shard_names
from funcaccel.checkpoint._members import member_path
from funcaccel.checkpoint._members import regular_file

__all__ = ["SavedTensor", "read_layout", "read_shard", "write_index", "write_shard"]

_INDEX_LIMIT: Final = 64 << 20
_BAD_FILE: Final = "the export is damaged or crafted; export the model again"


def write_shard(
    tensors: dict[str, torch.Tensor], path: Path, *, safe: bool, durable: bool
) -> None:
    """Write ``tensors`` (contiguous CPU tensors) to the new file ``path``.

    With ``durable`` the file is fsynced before this returns.
    """
    if safe:
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
        if durable:
            with path.open("rb") as file:
                os.fsync(file.fileno())
        return
    with path.open("xb") as file:
        torch.save(tensors, file)
        file.flush()
        if durable:
            os.fsync(file.fileno())


def write_index(
    path: Path, weight_map: dict[str, str], total_size: int, *, durable: bool
) -> None:
    """Write the index transformers reads: ``metadata.total_size`` and ``weight_map``."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    with path.open("x", encoding="utf-8") as file:
        file.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        file.flush()
        if durable:
            os.fsync(file.fileno())


@dataclasses.dataclass(frozen=True, slots=True)
class SavedTensor:
    """Where an exported tensor lies and its shape, from the file's header."""

    file: str
    shape: tuple[int, ...]


def _damaged(caller: str, what: str) -> ValueError:
    return ValueError(f"{caller}: {what}; {_BAD_FILE}.")


def _is_str_dict(value: object, kind: type) -> bool:
    """Whether ``value`` is a dict of str keys to ``kind`` values."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, kind) for k, v in value.items()
    )


def _read_index(root: Path, name: str, caller: str) -> dict[str, str]:
    path = member_path(root, name, caller=caller)
    problem = regular_file(path)
    if problem is None and path.stat().st_size > _INDEX_LIMIT:
        problem = f"has {path.stat().st_size} bytes"
    if problem is not None:
        raise _damaged(caller, f"{path} {problem}")
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _damaged(caller, f"{path} is not JSON ({error})") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not _is_str_dict(weight_map, str):
        raise _damaged(
            caller, f"{path} has no weight_map of tensor names to file names"
        )
    return cast("dict[str, str]", weight_map)


def _headers(path: Path, *, safe: bool, caller: str) -> dict[str, tuple[int, ...]]:
    problem = regular_file(path)
    if problem is not None:
        raise _damaged(caller, f"{path} {problem}")
    if not safe:
        return {
            k: tuple(v.shape)
            for k, v in read_shard(path, safe=False, caller=caller).items()
        }
    try:
        with safetensors.safe_open(path, framework="pt") as file:
            return {k: tuple(file.get_slice(k).get_shape()) for k in file.keys()}
    except (safetensors.SafetensorError, OSError) as error:
        raise _damaged(
            caller, f"{path} is not a safetensors file ({summary(str(error), 200)})"
        ) from error


def read_layout(root: Path, *, caller: str) -> tuple[bool, dict[str, SavedTensor]]:
    """Return whether ``root`` holds safetensors, and every exported tensor's place.

    Safetensors files are preferred when both formats are present, as in
    transformers.

    Raises:
        ValueError: no export in ``root``, or an index or file that is damaged,
            names a path outside ``root`` or disagrees with the files.
    """
    weight_map: dict[str, str] = {}
    for safe in (True, False):
        index = index_name(safe=safe)
        if os.path.lexists(root / index):
            weight_map = _read_index(root, index, caller)
            files = sorted(set(weight_map.values()))
            break
        single = shard_names(1, safe=safe)[0]
        if os.path.lexists(root / single):
            files = [single]
            break
    else:
        msg = (
            f"{caller}: {root} holds no exported model (no model.safetensors, "
            "model.safetensors.index.json, pytorch_model.bin or "
            "pytorch_model.bin.index.json); pass the directory save_model wrote."
        )
        raise ValueError(msg)
    saved: dict[str, SavedTensor] = {}
    for file in files:
        # Every name the index gives stays inside root, links followed.
        path = member_path(root, file, caller=caller, where=f"the export {root}")
        for key, shape in _headers(path, safe=safe, caller=caller).items():
            if key in saved:
                raise _damaged(
                    caller, f"{key!r} is in both {saved[key].file} and {file}"
                )
            saved[key] = SavedTensor(file, shape)
    for key, file in weight_map.items():
        if key not in saved or saved[key].file != file:
            raise _damaged(
                caller,
                f"the index maps {summary(key)} to {file}, which does not hold it",
            )
    return safe, saved


def read_shard(path: Path, *, safe: bool, caller: str) -> dict[str, torch.Tensor]:
    """Load every tensor of one export file onto the CPU.

    Raises:
        ValueError: the file is not a safetensors file, or not a weights-only
            torch file holding a dict of tensors.
    """
    if safe:
        try:
            loaded: dict[str, torch.Tensor] = safetensors.torch.load_file(path)
        except (safetensors.SafetensorError, OSError) as error:
            raise _damaged(
                caller, f"{path} cannot be read ({summary(str(error), 200)})"
            ) from error
        return loaded
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (
        RuntimeError,
        EOFError,
        zipfile.BadZipFile,
        pickle.UnpicklingError,
        OSError,
    ) as error:
        raise _damaged(
            caller,
            f"{path} cannot be read as a weights-only torch file ({summary(str(error), 200)})",
        ) from error
    if not _is_str_dict(state, torch.Tensor):
        raise _damaged(caller, f"{path} does not hold a dict of tensors")
    return cast("dict[str, torch.Tensor]", state)
