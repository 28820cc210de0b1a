"""A checkpoint's manifest: what it holds, which files, and whether they are intact.

``manifest.json`` is the last file a save writes, so a checkpoint directory is
complete exactly when it has one (and every file it lists has its recorded size).
Its content is a ``CheckpointMeta`` value serialised to plain JSON: counts of the
saved objects, the saving world size, the ``GradState`` and ``LoaderState``, user
metadata, and per file its size and SHA-256.

>>> meta = CheckpointMeta(world_size=2, models=1, extra={"step": 10})
>>> CheckpointMeta.from_dict(json.loads(json.dumps(meta.to_dict()))) == meta
True
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Iterable
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from typing import Final
from typing import Literal
from typing import TypeVar
from typing import cast

from funcaccel._checks import check_bool
from funcaccel._checks import check_choice
from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import summary
from funcaccel.checkpoint import _layout
from funcaccel.checkpoint._members import EARLIER
from funcaccel.checkpoint._members import check_member_name
from funcaccel.checkpoint._members import fail_checkpoint
from funcaccel.checkpoint._members import member_path
from funcaccel.checkpoint._members import regular_file
from funcaccel.grad_state import GradState
from funcaccel.loader import LoaderState

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointMeta",
    "FileEntry",
    "check_json_value",
    "read_manifest",
]

SCHEMA_VERSION: Final = 1
"""The manifest schema this funcaccel writes and reads."""
_FORMAT_TAG: Final = "funcaccel-checkpoint"
_HEX: Final = frozenset("0123456789abcdef")
_STATE_FORMATS: Final = ("torch", "dcp", "deepspeed")
# Far above any real manifest (about 100 bytes per file): a bigger one is not read.
_MANIFEST_LIMIT: Final = 64 << 20
_FROM_DICT: Final = "CheckpointMeta.from_dict"
_NOT_A_MANIFEST: Final = (
    f"{_FROM_DICT}: not a funcaccel checkpoint manifest (no 'format': {_FORMAT_TAG!r})."
)
_OTHER_SCHEMA: Final = (
    f"{_FROM_DICT}: schema_version is {{!r}}, but this funcaccel reads version "
    f"{SCHEMA_VERSION}; load it with the funcaccel that wrote it."
)
_NO_MANIFEST: Final = (
    "{} is missing, so {} is not a complete checkpoint (an interrupted save leaves "
    "none)"
)
_FIND_LATEST: Final = "use latest_checkpoint(directory) to find the newest complete one"
_DIGEST: Final = "64 lowercase hex digits or None"
_ENTRY: Final = "{'size': ..., 'sha256': ...}"
T = TypeVar("T")


def check_json_value(value: object, where: str, caller: str) -> Any:
    """Return a deep copy of ``value`` after checking that JSON round-trips it exactly.

    Allowed: str, int, finite float, bool, None, lists and str-keyed dicts of them.
    Numpy scalars (``np.int64(3)``, ``np.float32(0.5)``, ``np.bool_(True)``) are
    copied as the Python number they hold.

    >>> check_json_value({"step": 3, "tags": ["a"]}, "extra", "f")
    {'step': 3, 'tags': ['a']}
    >>> import numpy as np
    >>> check_json_value([np.int64(3), np.float32(0.5), np.bool_(True)], "extra", "f")
    [3, 0.5, True]
    >>> check_json_value({"t": (1, 2)}, "extra", "f")
    Traceback (most recent call last):
    ...
    TypeError: f: extra['t'] must be JSON (str, int, finite float, bool, None, list, ...
    """
    if value is None or isinstance(value, (str, bool)) or type(value) is int:
        return value
    number = _python_number(value)
    if number is not None and (not isinstance(number, float) or math.isfinite(number)):
        return number
    if isinstance(value, list):
        return [
            check_json_value(v, f"{where}[{i}]", caller) for i, v in enumerate(value)
        ]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {
            k: check_json_value(v, f"{where}[{k!r}]", caller) for k, v in value.items()
        }
    what = "JSON (str, int, finite float, bool, None, list, dict with str keys)"
    fail_type(caller, where, value, what, _json_hint(value))


def _python_number(value: object) -> int | float | bool | None:
    """Return ``value`` as a Python int, float or bool, if it is a scalar of one."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):  # an IntEnum, say
        return int(value)
    if isinstance(value, float):  # np.float64 is a float subclass
        return float(value)
    numpy = sys.modules.get("numpy")  # no numpy scalar exists before numpy loads
    if numpy is not None and isinstance(value, numpy.generic):
        if isinstance(value, numpy.bool_):
            return bool(value)
        if isinstance(value, numpy.integer):
            return int(value)
        if isinstance(value, numpy.floating):
            return float(value)
    return None


def _json_hint(value: object) -> str:
    if isinstance(value, float) or _python_number(value) is not None:
        return "Store a finite number (NaN and infinities are not JSON)."
    if isinstance(value, tuple):
        return "Convert the tuple to a list."
    if isinstance(value, (set, frozenset)):
        return "Convert the set to a sorted list."
    if isinstance(value, Mapping):
        return "Use str keys (JSON object keys are strings)."
    if hasattr(value, "tolist"):  # tensors and numpy arrays
        return "Convert it with .item() (one value) or .tolist()."
    return "Convert it to one of these, e.g. with str(), int() or float()."


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FileEntry:
    """One file of a checkpoint as its manifest records it.

    Args:
        size: its size in bytes (>= 0).
        sha256: its hex SHA-256, or ``None`` for DCP shard files (not hashed).
    """

    size: int
    sha256: str | None = None

    def __post_init__(self) -> None:
        if type(self.size) is not int or self.size < 0:
            fail_value("FileEntry", "size", self.size, "an int >= 0")
        if self.sha256 is not None and not _is_sha256(self.sha256):
            fail_value("FileEntry", "sha256", self.sha256, _DIGEST)


def _is_sha256(digest: object) -> bool:
    return isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX


def _field(
    data: Mapping[str, object], key: str, kind: type[T] | tuple[type, ...]
) -> Any:
    return check_type(_FROM_DICT, key, data[key], kind)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointMeta:
    """What a checkpoint's ``manifest.json`` holds: counts, values and the file list.

    Args:
        world_size: processes that wrote it (>= 1).
        state_format: ``"torch"`` (whole state dicts), ``"dcp"`` (sharded) or
            ``"deepspeed"`` (a DeepSpeed engine's own checkpoint).
        models, optimizers, schedulers: how many of each were saved (>= 0).
        scaler: whether a grad scaler was saved.
        objects: names of the other ``Stateful`` objects saved.
        rng: whether every rank's RNG states were saved.
        rank_part: whether every rank saved its own part
            (``rank_part_<r>.pt``: ``rank_objects`` and ``rank_extra``).
        rank_objects: names of the per-rank ``Stateful`` objects in each part.
        grad: the saved ``GradState``, or ``None``.
        loader: the saved ``LoaderState``, or ``None``.
        extra: user metadata (JSON values; copied).
        files: every file by path relative to the checkpoint (a plain relative
            path: no ``..``, not absolute), with its ``FileEntry``.
        schema_version: the manifest schema (``SCHEMA_VERSION``).

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a field out of range.
    """

    world_size: int
    state_format: Literal["torch", "dcp", "deepspeed"] = "torch"
    models: int = 0
    optimizers: int = 0
    schedulers: int = 0
    scaler: bool = False
    objects: tuple[str, ...] = ()
    rng: bool = False
    rank_part: bool = False
    rank_objects: tuple[str, ...] = ()
    grad: GradState | None = None
    loader: LoaderState | None = None
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    files: Mapping[str, FileEntry] = dataclasses.field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        owner = "CheckpointMeta"
        for name in (
            "world_size",
            "models",
            "optimizers",
            "schedulers",
            "schema_version",
        ):
            check_int(owner, name, getattr(self, name), int(name == "world_size"))
        check_choice(owner, "state_format", self.state_format, _STATE_FORMATS)
        check_bool(owner, "scaler", self.scaler)
        check_bool(owner, "rng", self.rng)
        check_bool(owner, "rank_part", self.rank_part)
        for name in ("objects", "rank_objects"):
            if not _all_of(getattr(self, name), tuple, str):
                fail_type(owner, name, getattr(self, name), "a tuple of str")
        if self.rank_objects and not self.rank_part:
            what = "() when rank_part is False (no rank saved a part)"
            fail_value(owner, "rank_objects", self.rank_objects, what)
        check_type(owner, "grad", self.grad, GradState, optional=True)
        check_type(owner, "loader", self.loader, LoaderState, optional=True)
        object.__setattr__(self, "extra", check_json_value(self.extra, "extra", owner))
        check_type(owner, "extra", self.extra, dict)
        files = self.files
        if not _all_of(files, Mapping, str) or not _all_of(
            files.values(), object, FileEntry
        ):
            fail_type(owner, "files", files, "a mapping of str to FileEntry")
        for name in self.files:
            check_member_name(owner, name, where="files")
        object.__setattr__(self, "files", dict(self.files))

    def to_dict(self) -> dict[str, Any]:
        """Return the manifest as a new JSON-serialisable dict.

        The per-rank keys (``rank_part``, ``rank_objects``) are written only when
        the ranks saved parts, so a manifest without them reads as before, and a
        funcaccel too old to load the parts refuses the keys instead of ignoring
        them.
        """
        per_rank: dict[str, Any] = {}
        if self.rank_part:
            per_rank = {"rank_part": True, "rank_objects": list(self.rank_objects)}
        return {
            "format": _FORMAT_TAG,
            "schema_version": self.schema_version,
            "world_size": self.world_size,
            "state_format": self.state_format,
            "models": self.models,
            "optimizers": self.optimizers,
            "schedulers": self.schedulers,
            "scaler": self.scaler,
            "objects": list(self.objects),
            "rng": self.rng,
            **per_rank,
            "grad": None if self.grad is None else self.grad.to_dict(),
            "loader": None if self.loader is None else self.loader.to_dict(),
            "extra": check_json_value(self.extra, "extra", "CheckpointMeta.to_dict"),
            "files": {
                k: {"size": v.size, "sha256": v.sha256} for k, v in self.files.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> CheckpointMeta:
        """Rebuild a manifest from ``to_dict()``'s output (after a JSON round trip).

        Raises:
            TypeError: a value of the wrong type.
            ValueError: not a funcaccel manifest, another schema version, or missing
                or unknown keys.
        """
        if not isinstance(data, Mapping) or data.get("format") != _FORMAT_TAG:
            raise ValueError(_NOT_A_MANIFEST)
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(_OTHER_SCHEMA.format(data.get("schema_version")))
        optional = set(cls(world_size=1, rank_part=True).to_dict())
        expected = set(cls(world_size=1).to_dict())
        missing = sorted(expected - set(data))
        unknown = sorted(set(data) - optional)
        if missing or unknown:
            msg = f"{_FROM_DICT}: missing keys {missing}, unknown keys {unknown}."
            raise ValueError(msg)
        grad, loader = data["grad"], data["loader"]
        files = _field(data, "files", dict)
        return cls(
            world_size=_field(data, "world_size", int),
            state_format=_field(data, "state_format", str),
            models=_field(data, "models", int),
            optimizers=_field(data, "optimizers", int),
            schedulers=_field(data, "schedulers", int),
            scaler=_field(data, "scaler", bool),
            objects=tuple(_field(data, "objects", list)),
            rng=_field(data, "rng", bool),
            rank_part=_field(data, "rank_part", bool) if "rank_part" in data else False,
            rank_objects=tuple(_field(data, "rank_objects", list))
            if "rank_objects" in data
            else (),
            grad=None
            if grad is None
            else GradState.from_dict(_field(data, "grad", dict)),
            loader=None
            if loader is None
            else LoaderState.from_dict(_field(data, "loader", dict)),
            extra=_field(data, "extra", dict),
            files={str(k): _file_entry(k, v) for k, v in files.items()},
        )


def _file_entry(name: object, value: object) -> FileEntry:
    if not isinstance(value, dict) or set(value) != {"size", "sha256"}:
        fail_value(_FROM_DICT, f"files[{name!r}]", value, _ENTRY)
    return FileEntry(size=value["size"], sha256=value["sha256"])


def _all_of(items: object, container: type, kind: type) -> bool:
    """Whether ``items`` is a ``container`` whose items (keys, for a mapping) are ``kind``."""
    if not isinstance(items, container):
        return False
    return all(isinstance(i, kind) for i in cast("Iterable[object]", items))


def _file_problem(file: Path, entry: FileEntry, *, verify: bool) -> str | None:
    problem = regular_file(file)
    if problem is not None:
        return problem
    size = file.stat().st_size
    if size != entry.size:
        return f"has {size} bytes but the manifest records {entry.size} (truncated?)"
    if verify and entry.sha256 is not None and _layout.sha256_of(file) != entry.sha256:
        return "does not match the SHA-256 the manifest records"
    return None


def read_manifest(root: Path, *, verify: bool, caller: str) -> CheckpointMeta:
    """Read ``root``'s manifest and check the files it lists (see ``read_checkpoint_meta``)."""
    where = f"the manifest of {root}"
    manifest = member_path(root, _layout.MANIFEST_NAME, caller=caller, where=where)
    problem = regular_file(manifest)
    if problem == "is missing":
        fail_checkpoint(caller, _NO_MANIFEST.format(manifest, root), _FIND_LATEST)
    if problem is None and manifest.stat().st_size > _MANIFEST_LIMIT:
        size = manifest.stat().st_size
        problem = f"has {size} bytes, more than any manifest funcaccel writes"
    if problem is not None:
        fail_checkpoint(caller, f"{manifest} {problem}")
    try:
        meta = CheckpointMeta.from_dict(
            json.loads(manifest.read_text(encoding="utf-8"))
        )
    except (ValueError, TypeError, RecursionError) as error:  # deep JSON recurses
        msg = (
            f"{caller}: {manifest} is not a valid manifest: {summary(str(error), 300)}"
        )
        raise ValueError(msg) from error
    for name, entry in meta.files.items():
        path = member_path(root, name, caller=caller, where=where)
        problem = _file_problem(path, entry, verify=verify)
        if problem is not None:
            fail_checkpoint(caller, f"{path} {problem}", EARLIER)
    return meta
