"""Each rank's own part of a checkpoint: written by every rank, read by the same rank.

``save_checkpoint(..., rank_objects=..., rank_extra=...)`` has every rank write
``rank_part_<r>.pt`` with its ``rank_objects``' states and its ``rank_extra``
values (tensors and plain values: a prefetched batch, a data offset), listed in
the manifest with size and SHA-256 like every other file. ``load_checkpoint``
gives rank ``r`` the part rank ``r`` saved. Which rank's state a part is only
makes sense on the world size that saved it, so on another one the load is
refused unless ``rank_map`` says which saved part each rank takes:

- ``None`` (the default): the same world size, rank ``r`` takes part ``r``;
- ``"drop"``: no rank takes a part (each keeps its own state);
- a sequence with one entry per loading rank, a saved rank or ``None``:
  ``[0, 1, None]`` on 3 ranks gives ranks 0 and 1 their own parts and rank 2
  none.

>>> choose_source(2, 3, [0, 1, None], rank=2, caller="f")
>>> choose_source(2, 2, None, rank=1, caller="f")
1
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import Final
from typing import Literal
from typing import TypeAlias

import torch

from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import is_int
from funcaccel._checks import summary
from funcaccel.checkpoint import _formats
from funcaccel.checkpoint import _layout
from funcaccel.checkpoint._manifest import CheckpointMeta
from funcaccel.checkpoint._members import EARLIER
from funcaccel.checkpoint._members import fail_checkpoint

__all__ = [
    "RankMap",
    "check_rank_extra",
    "check_rank_map",
    "check_rank_names",
    "choose_source",
    "load_rank_part",
    "rank_files_read",
]

RankMap: TypeAlias = Literal["drop"] | Sequence[int | None]
_RANK_MAP: Final = (
    "None, 'drop', or a sequence with one saved rank (or None) per loading rank"
)
_PLAIN: Final = (
    "tensors and plain values (str, int, float, bool, None, list, tuple, dict with "
    "str keys)"
)
# caller, saved world size, loading world size
_MSG_OTHER_WORLD: Final = (
    "{0}: the checkpoint holds a per-rank part (rank_objects, rank_extra) from each "
    "rank of world size {1}, but this load runs on world size {2}, where a part's "
    "rank is another process; pass rank_map='drop' to load no part (each rank "
    "keeps its own state), or rank_map=[...] with one saved rank (or None) per "
    "loading rank, e.g. rank_map={3!r}."
)
# caller, root, saved names, passed names
_MSG_NAMES: Final = (
    "{0}: {1} holds rank_objects={2}, but rank_objects={3} was passed; pass the "
    "same rank_objects as when it was saved."
)


def check_rank_extra(caller: str, value: object) -> dict[str, Any] | None:
    """Return a new dict of ``value`` (``rank_extra=``) after checking its values.

    Containers are copied (lists, tuples, dicts); tensors are not, a save writes
    or stages them before it returns.

    >>> check_rank_extra("f", {"batch": [torch.ones(1)], "seen": 3})
    {'batch': [tensor([1.])], 'seen': 3}
    >>> check_rank_extra("f", {"x": {1, 2}})
    Traceback (most recent call last):
    ...
    TypeError: f: rank_extra['x'] must be tensors and plain values (str, int, ...
    """
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        fail_type(caller, "rank_extra", value, "a dict with str keys or None")
    copied = _plain(caller, "rank_extra", dict(value))
    assert isinstance(copied, dict)
    return copied


def _plain(caller: str, where: str, value: object) -> object:
    if value is None or type(value) in (str, int, float, bool, torch.Tensor):
        return value
    if type(value) in (list, tuple):
        assert isinstance(value, (list, tuple))
        items = [_plain(caller, f"{where}[{i}]", v) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    if type(value) is dict and all(isinstance(k, str) for k in value):
        assert isinstance(value, dict)
        return {k: _plain(caller, f"{where}[{k!r}]", v) for k, v in value.items()}
    hint = (
        "Pass a plain tensor (t.detach(), or .to_local() for a DTensor) or a "
        "Python value (.item(), .tolist()); a Stateful object goes in rank_objects."
    )
    fail_type(caller, where, value, _PLAIN, hint)


def check_rank_map(
    caller: str, rank_map: object
) -> Literal["drop"] | tuple[int | None, ...] | None:
    """Return ``rank_map`` checked for type: ``None``, ``"drop"`` or a tuple.

    >>> check_rank_map("f", [0, None])
    (0, None)
    """
    if rank_map is None:
        return None
    if rank_map == "drop":
        return "drop"
    if isinstance(rank_map, Sequence) and not isinstance(rank_map, (str, bytes)):
        entries = tuple(rank_map)
        if all(entry is None or is_int(entry) for entry in entries):
            return entries
    if isinstance(rank_map, str):
        fail_value(caller, "rank_map", rank_map, _RANK_MAP)
    fail_type(caller, "rank_map", rank_map, _RANK_MAP)


def choose_source(
    saved: int,
    world: int,
    rank_map: Literal["drop"] | tuple[int | None, ...] | Sequence[int | None] | None,
    *,
    rank: int,
    caller: str,
) -> int | None:
    """Return the saved rank whose part ``rank`` loads (``None``: none).

    ``saved`` and ``world`` are the saving and loading world sizes.

    Raises:
        ValueError: another world size and no ``rank_map``, or a ``rank_map`` of
            the wrong length or naming a rank that did not save.

    >>> choose_source(2, 1, None, rank=0, caller="f")
    Traceback (most recent call last):
    ...
    ValueError: f: the checkpoint holds a per-rank part (rank_objects, rank_extra) from ...
    """
    if rank_map is None:
        if saved != world:
            example = [r if r < saved else None for r in range(world)]
            raise ValueError(_MSG_OTHER_WORLD.format(caller, saved, world, example))
        return rank
    if rank_map == "drop":
        return None
    if len(rank_map) != world:
        what = f"a sequence of {world} entries, one per loading rank"
        fail_value(caller, "rank_map", list(rank_map), what)
    for entry in rank_map:
        if entry is not None and not 0 <= entry < saved:
            what = f"saved ranks in [0, {saved}) or None"
            hint = f"The checkpoint was saved on world size {saved}."
            fail_value(caller, "rank_map", list(rank_map), what, hint)
    return rank_map[rank]


def rank_files_read(meta: CheckpointMeta, source: int | None) -> list[str]:
    """Return the per-rank file a load with ``source`` reads (each must be listed)."""
    if not meta.rank_part or source is None:
        return []
    return [_formats.rank_part_name(source)]


def check_rank_names(
    meta: CheckpointMeta,
    passed: Sequence[str],
    source: int | None,
    root: Path,
    caller: str,
) -> None:
    """Check the ``rank_objects`` names passed against the saved ones.

    A rank that loads no part may pass none.

    Raises:
        ValueError: the names differ.
    """
    if source is None and not passed:
        return
    if sorted(passed) != sorted(meta.rank_objects):
        saved, given = sorted(meta.rank_objects), sorted(passed)
        raise ValueError(_MSG_NAMES.format(caller, root, saved, given))


def load_rank_part(
    root: Path,
    source: int,
    meta: CheckpointMeta,
    objects: Mapping[str, _formats.Stateful],
    caller: str,
) -> dict[str, Any] | None:
    """Load ``objects`` in place from saved rank ``source``'s part; return its extra.

    Raises:
        ValueError: the file is unreadable, does not hold a part as a save writes
            it, or a state does not fit its object.
    """
    file = root / _formats.rank_part_name(source)
    state = _layout.read_torch_file(file, caller=caller)
    problem = _part_problem(state, meta)
    if problem is not None:
        fail_checkpoint(caller, f"{file} {problem}", EARLIER)
    assert isinstance(state, dict)
    for key, target in objects.items():
        what = f"rank_objects[{key!r}]"
        _formats.load_state(target, state["objects"][key], file, what, caller)
    extra: dict[str, Any] | None = state["extra"]
    return extra


def _part_problem(state: object, meta: CheckpointMeta) -> str | None:
    """Say how ``state`` differs from a per-rank part as a save writes it, or None."""
    if not isinstance(state, dict) or set(state) != {"objects", "extra"}:
        return f"holds {summary(state)}, not a per-rank part"
    objects, extra = state["objects"], state["extra"]
    if not isinstance(objects, dict) or set(objects) != set(meta.rank_objects):
        keys = summary(list(objects) if isinstance(objects, dict) else objects)
        listed = sorted(meta.rank_objects)
        return f"holds rank_objects {keys}, but the manifest lists {listed}"
    if extra is not None and (
        not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra)
    ):
        return f"holds rank_extra {summary(extra)}, not a dict with str keys"
    return None
