"""What an exported model holds and how its tensors are split into files.

An export is a model's full state dict in the layout Hugging Face's loaders read:
``model.safetensors`` when it fits in one file, else ``model-00001-of-00003.safetensors``
... plus ``model.safetensors.index.json`` (``pytorch_model.bin`` and
``pytorch_model-00001-of-00003.bin`` with ``safe_serialization=False``). The plan
is computed from names, shapes and dtypes alone, before any tensor is gathered, so
every rank of an FSDP2 model walks the same tensors in the same order.

Shards are filled as transformers (``huggingface_hub.split_torch_state_dict_into_shards``)
fills them: in state-dict order, a new file when the next tensor would take the
current one past ``max_shard_size``, and a tensor larger than that alone in a file.

>>> parse_shard_size("5GB", caller="f"), parse_shard_size("2KiB", caller="f")
(5000000000, 2048)
>>> shard_names(3, safe=True)[0]
'model-00001-of-00003.safetensors'
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import torch
from torch import nn

from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import is_int
from funcaccel._dist_types import is_dtensor

__all__ = [
    "EXPORT_FILE_RE",
    "ExportEntry",
    "index_name",
    "parse_shard_size",
    "plan_export",
    "plan_shards",
    "shard_names",
    "tied_names",
]

# Every file name an export of either format writes; a new export replaces them all.
EXPORT_FILE_RE: Final = re.compile(
    r"(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
    r"|pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index\.json)"
)
_SIZE_RE: Final = re.compile(r"(\d+)\s*([KMG])(I?)(B)", re.IGNORECASE)
_UNITS: Final = MappingProxyType({"K": 10**3, "M": 10**6, "G": 10**9})
_BINARY_UNITS: Final = MappingProxyType({"K": 2**10, "M": 2**20, "G": 2**30})
_SIZE_FORMS: Final = "an int (bytes) or a size like '5GB', '500MB', '10KB' or '2GiB'"


def parse_shard_size(value: object, *, caller: str) -> int:
    """Return ``max_shard_size`` in bytes: an int, or a string as transformers reads it.

    ``"5GB"`` is ``5 * 10**9`` bytes and ``"5GiB"`` ``5 * 2**30`` (likewise ``KB``,
    ``MB``, ``KiB``, ``MiB``); as in transformers' ``convert_file_size_to_int``, a
    lowercase final ``b`` of a decimal unit means bits (``"8Mb"`` is 10**6 bytes).

    Raises:
        TypeError: neither an int nor a str.
        ValueError: a string in no such form, or a size below 1 byte.

    >>> parse_shard_size(100, caller="f"), parse_shard_size("8Mb", caller="f")
    (100, 1000000)
    """
    if is_int(value):
        assert isinstance(value, int)
        size = value
    elif isinstance(value, str):
        match = _SIZE_RE.fullmatch(value.strip())
        if match is None:
            fail_value(caller, "max_shard_size", value, _SIZE_FORMS)
        digits, prefix, binary, last = match.groups()
        prefix = prefix.upper()
        if binary:
            size = int(digits) * _BINARY_UNITS[prefix]
        else:
            size = int(digits) * _UNITS[prefix] // (8 if last == "b" else 1)
    else:
        what = "an int (bytes) or a str like '5GB'"
        fail_type(caller, "max_shard_size", value, what)
    if size < 1:
        fail_value(
            caller, "max_shard_size", value, "at least 1 byte", "Use e.g. '5GB'."
        )
    return size


@dataclasses.dataclass(frozen=True, slots=True)
class ExportEntry:
    """One tensor of an export: its state-dict name, full shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    sharded: bool

    @property
    def nbytes(self) -> int:
        """Its size in the file: elements times the dtype's size."""
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * _dtype(self.dtype).itemsize


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."))
    assert isinstance(dtype, torch.dtype), name
    return dtype


def _view_key(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """Identify the exact memory ``tensor`` views, or ``None`` if it has none."""
    if is_dtensor(tensor) or tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    return (
        tensor.device,
        tensor.data_ptr(),
        tensor.dtype,
        tuple(tensor.shape),
        tensor.stride(),
    )


def tied_names(module: nn.Module, state: Mapping[str, object]) -> dict[str, str]:
    """Return ``{duplicate: kept}`` for names of ``state`` that hold the same tensor.

    Two names are tied when they are the same parameter or buffer object of
    ``module`` (FSDP2 shards a tied parameter once), or the same view of the same
    memory. The first name in state-dict order is kept, as transformers keeps
    ``model.embed_tokens.weight`` and drops ``lm_head.weight``. Ranks agree: no
    rank-local pointer decides a tie between sharded tensors.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    >>> net[1].weight = net[0].weight
    >>> tied_names(net, net.state_dict())
    {'1.weight': '0.weight'}
    """
    owners: dict[str, int] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owners[name] = id(param)
    for name, buffer in module.named_buffers(remove_duplicate=False):
        owners[name] = id(buffer)
    first: dict[object, str] = {}
    tied: dict[str, str] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        keys: list[object] = []
        if name in owners:
            keys.append(("object", owners[name]))
        view = _view_key(value)
        if view is not None:
            keys.append(("view", view))
        kept = next((first[k] for k in keys if k in first), None)
        if kept is not None:
            tied[name] = kept
        for key in keys:
            first.setdefault(key, kept or name)
    return tied


def plan_export(
    module: nn.Module,
    state: Mapping[str, object] | None = None,
    *,
    caller: str,
) -> tuple[list[ExportEntry], dict[str, str]]:
    """Return the tensors an export of ``module`` writes, and the tied names it drops.

    ``module`` is unwrapped (DDP's ``module.`` prefix is never written); ``state``
    is its ``state_dict()`` when the caller has it already. Sharded (DTensor)
    entries report their full shape.

    Raises:
        TypeError: a state-dict value that is not a tensor (safetensors holds
            tensors only).
    """
    if state is None:
        state = module.state_dict()
    tied = tied_names(module, state)
    entries: list[ExportEntry] = []
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            hint = "An export holds tensors only; save such state with save_checkpoint."
            fail_type(caller, f"the state dict entry {name!r}", value, "a tensor", hint)
        if name in tied:
            continue
        entries.append(
            ExportEntry(name, tuple(value.shape), str(value.dtype), is_dtensor(value))
        )
    return entries, tied


def plan_shards(
    entries: list[ExportEntry], max_shard_size: int
) -> list[list[ExportEntry]]:
    """Split ``entries`` into files of at most ``max_shard_size`` bytes each.

    A tensor larger than the limit gets a file of its own, placed (as in
    huggingface_hub) before the file being filled.

    >>> e = [ExportEntry(n, (s,), "torch.uint8", False) for n, s in zip("abcd", [3, 3, 9, 1])]
    >>> [[x.name for x in shard] for shard in plan_shards(e, 6)]
    [['c'], ['a', 'b'], ['d']]
    """
    shards: list[list[ExportEntry]] = []
    current: list[ExportEntry] = []
    filled = 0
    for entry in entries:
        size = entry.nbytes
        if size > max_shard_size:
            shards.append([entry])
            continue
        if filled + size > max_shard_size:
            shards.append(current)
            current, filled = [], 0
        current.append(entry)
        filled += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int, *, safe: bool) -> list[str]:
    """Return the file names of an export in ``count`` files.

    >>> shard_names(1, safe=True), shard_names(2, safe=False)[1]
    (['model.safetensors'], 'pytorch_model-00002-of-00002.bin')
    """
    stem, suffix = ("model", ".safetensors") if safe else ("pytorch_model", ".bin")
    if count == 1:
        return [stem + suffix]
    return [f"{stem}-{i:05d}-of-{count:05d}{suffix}" for i in range(1, count + 1)]


def index_name(*, safe: bool) -> str:
    """Return the index file's name: ``model.safetensors.index.json`` or the .bin one."""
    return "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
