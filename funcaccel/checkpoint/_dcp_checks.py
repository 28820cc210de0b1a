"""Checks on a sharded (DCP) checkpoint before torch.distributed.checkpoint reads it.

DCP reads its ``.metadata`` with plain ``pickle.load`` and the non-tensor values
(an optimizer's hyper-parameters) with ``torch.load(weights_only=False)``, so a
crafted checkpoint could run code while loading. Both are vetted here first, on
the same bytes: the metadata by an unpickler that accepts only DCP's own metadata
records (any other global is refused, so nothing is called), each value by
``torch.load(weights_only=True)``. Then the shard files the metadata names must be
plain names that the (already checked) manifest lists.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Collection
from pathlib import Path
from types import MappingProxyType
from typing import Any
from typing import Final

import torch

from funcaccel._checks import summary
from funcaccel._checks import type_name
from funcaccel.checkpoint._members import DAMAGED
from funcaccel.checkpoint._members import check_member_name
from funcaccel.checkpoint._members import fail_checkpoint

__all__ = ["check_dcp_metadata", "check_dcp_value"]

_METADATA_NAME: Final = ".metadata"
# What DCP's FileSystemWriter pickles into .metadata: its records, torch.Size,
# dtypes and layouts, and the checkpoint path. Building any of these runs no code
# of the file's choosing.
_ALLOWED: Final = MappingProxyType(
    {
        "torch.distributed.checkpoint.metadata": frozenset(
            {
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            }
        ),
        "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
        "torch.serialization": frozenset({"_get_layout"}),
        "torch": frozenset({"Size"}),
        "pathlib": frozenset({"PosixPath", "PurePosixPath"}),
        "collections": frozenset({"OrderedDict"}),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, caller: str, where: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._caller, self._where = caller, where

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        msg = (
            f"{self._caller}: {self._where} asks to build {summary(f'{module}.{name}')}, "
            f"which is not part of DCP metadata, so it was not unpickled; {DAMAGED}."
        )
        raise ValueError(msg)


def check_dcp_metadata(
    directory: Path, listed: Collection[str], *, caller: str
) -> None:
    """Check ``directory/.metadata`` unpickles safely and names only listed files.

    ``listed`` holds the names the manifest lists, relative to ``directory``; each
    has already been checked to be a regular file inside the checkpoint.

    Raises:
        ValueError: the metadata is unreadable, asks for any other object, or
            names a shard file that is not a plain, listed name.
    """
    where = directory / _METADATA_NAME
    try:
        metadata = _MetadataUnpickler(where.read_bytes(), caller, where).load()
    except (pickle.UnpicklingError, EOFError, TypeError, AttributeError) as error:
        msg = f"{caller}: {where} cannot be read ({type_name(error)}: {summary(str(error), 200)}); {DAMAGED}."
        raise ValueError(msg) from error
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        fail_checkpoint(caller, f"{where} holds {summary(metadata)}, not DCP metadata")
    given = f"the DCP metadata {where}"
    for info in storage.values():
        name = check_member_name(
            caller, getattr(info, "relative_path", None), where=given
        )
        if name not in listed:
            msg = f"{caller}: {given} names {summary(name)}, which the manifest does not list; {DAMAGED}."
            raise ValueError(msg)


def check_dcp_value(value: io.BytesIO, *, caller: str) -> None:
    """Check that a DCP value (bytes from a shard file) loads weights-only.

    ``value`` is rewound afterwards, so DCP reads the same bytes again.

    Raises:
        ValueError: it needs anything but tensors and plain values.
    """
    try:
        torch.load(value, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        first = str(error).splitlines()[0] if str(error) else type_name(error)
        msg = f"{caller}: a value in the sharded state is not weights-only ({summary(first, 200)}), so it was not loaded; {DAMAGED}."
        raise ValueError(msg) from error
    finally:
        value.seek(0)
