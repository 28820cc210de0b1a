"""``PipelineOptions``: how ``wrap_model`` cuts a model into pipeline stages; the pure cut.

A model given to ``wrap_model(..., pipeline=...)`` is read as a chain of
*units*: its top-level children in registration order, where a child that is an
``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential`` counts as its items
(``"layers.0"``, ``"layers.1"``, ...). Its forward must apply the units in that
order, each to the previous one's output (as ``nn.Sequential`` does): a stage
runs its units so, not the model's own ``forward``. The stages are consecutive
runs of units; a split point names the unit that begins a stage.

With ``embed, layers.0 .. layers.3, head`` and ``split_points=("layers.2",)``,
stage 0 runs ``embed, layers.0, layers.1`` and stage 1 ``layers.2, layers.3,
head``.

>>> cut_units(["embed", "l.0", "l.1", "l.2", "l.3", "head"], ("l.2",), 2)
(('embed', 'l.0', 'l.1'), ('l.2', 'l.3', 'head'))
>>> stage_indices("interleaved_1f1b", pp=2, pp_rank=1, stages_per_rank=2)
(1, 3)
>>> stage_indices("zbv_zero_bubble", pp=2, pp_rank=1, stages_per_rank=2)
(1, 2)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from torch import nn

from funcaccel._checks import check_choice
from funcaccel._checks import check_int
from funcaccel._checks import check_type
from funcaccel._checks import fail_value
from funcaccel._checks import summary

__all__ = [
    "MULTI_STAGE_SCHEDULES",
    "SCHEDULES",
    "PipelineOptions",
    "cut_units",
    "model_units",
    "stage_indices",
]

SCHEDULES: Final = (
    "gpipe",
    "1f1b",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zero_bubble",
    "zbv_zero_bubble",
)
"""The schedule names ``PipelineOptions`` accepts (torch's schedule classes)."""
MULTI_STAGE_SCHEDULES: Final = frozenset(SCHEDULES[2:])
"""Schedules that run several stages per rank (``stages_per_rank >= 2``)."""
_CONTAINERS: Final = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PipelineOptions:
    """How ``wrap_model`` cuts a model into stages and which schedule runs them; never changed.

    Args:
        microbatches: micro-batches per pipeline step (>= 1); the batch given to
            ``pipeline_step`` is split into this many equal parts along dim 0.
        schedule: one of ``SCHEDULES``: ``"gpipe"``, ``"1f1b"`` (one stage per
            rank), ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"interleaved_zero_bubble"`` (stages ``r, r + pp, ...`` on pipeline
            rank ``r``) or ``"zbv_zero_bubble"`` (two stages in a V: ``r`` and
            ``2 * pp - 1 - r``).
        split_points: the units that begin stages 1, 2, ... (``"layers.4"``), in
            order: ``pp * stages_per_rank - 1`` of them. Empty: the units are
            divided as evenly as possible, earlier stages taking one more.
        stages_per_rank: stages on each pipeline rank: 1 for ``"gpipe"`` and
            ``"1f1b"``, >= 2 for the others, exactly 2 for ``"zbv_zero_bubble"``.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: an unknown schedule, a count below 1, a repeated or empty
            split point, or ``stages_per_rank`` the schedule cannot run.

    >>> PipelineOptions(microbatches=4, schedule="gpipe").stages_per_rank
    1
    """

    microbatches: int
    schedule: str = "1f1b"
    split_points: tuple[str, ...] = ()
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        owner = "PipelineOptions"
        check_int(owner, "microbatches", self.microbatches, 1)
        check_choice(owner, "schedule", self.schedule, SCHEDULES)
        what = "a tuple of unit names such as ('layers.4',)"
        points = check_type(owner, "split_points", self.split_points, tuple, what=what)
        for point in points:
            check_type(owner, "every split point", point, str, what="a unit name (str)")
            if not point:
                fail_value(owner, "every split point", point, "a non-empty unit name")
        if len(set(points)) != len(points):
            fail_value(owner, "split_points", points, "distinct unit names")
        k = check_int(owner, "stages_per_rank", self.stages_per_rank, 1)
        multi = self.schedule in MULTI_STAGE_SCHEDULES
        fix = f"Pick a schedule for {k} stage(s) per rank or change stages_per_rank."
        if not multi and k != 1:
            need = f"1 with schedule={self.schedule!r} (one stage per rank)"
            fail_value(owner, "stages_per_rank", k, need, fix)
        if self.schedule == "zbv_zero_bubble" and k != 2:
            fail_value(owner, "stages_per_rank", k, "2 with 'zbv_zero_bubble'", fix)
        if multi and k < 2:
            need = f">= 2 with schedule={self.schedule!r} (several stages per rank)"
            fail_value(owner, "stages_per_rank", k, need, fix)


def model_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Return ``model``'s units in order: top-level children, containers expanded.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU(), nn.Tanh()]))
    >>> [name for name, _ in model_units(net)]
    ['0', '1.0', '1.1']
    """
    units = []
    for name, child in model.named_children():
        if isinstance(child, _CONTAINERS):
            units += [(f"{name}.{key}", item) for key, item in child.named_children()]
        else:
            units.append((name, child))
    return units


def cut_units(
    names: Sequence[str], split_points: tuple[str, ...], num_stages: int
) -> tuple[tuple[str, ...], ...]:
    """Return the unit names of each of ``num_stages`` stages (errors name ``wrap_model``).

    Raises:
        ValueError: a split point that is no unit, points out of order or giving
            an empty stage, a count that does not make ``num_stages`` stages, or
            fewer units than stages.
    """
    caller = "wrap_model"
    units = list(names)
    if not split_points:
        if len(units) < num_stages:
            what = f">= {num_stages} units for {num_stages} stages"
            fail_value(caller, "the model's units", units, what, _UNITS_HINT)
        base, extra = divmod(len(units), num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
        starts = [sum(sizes[:i]) for i in range(num_stages)]
    else:
        if len(split_points) != num_stages - 1:
            what = f"{num_stages - 1} unit names for {num_stages} stages (pp * stages_per_rank)"
            fix = "Give one split point per stage after the first, or none to split evenly."
            fail_value(caller, "pipeline.split_points", split_points, what, fix)
        starts = [0]
        for point in split_points:
            if point not in units:
                what = f"a unit of the model; its units are {summary(units)}"
                fail_value(caller, "every split point", point, what, _UNITS_HINT)
            starts.append(units.index(point))
        for a, b in zip(starts, starts[1:], strict=False):
            if b <= a:
                what = "in the model's unit order, each stage non-empty"
                hint = f"The units are {summary(units)}."
                fail_value(caller, "pipeline.split_points", split_points, what, hint)
    ends = [*starts[1:], len(units)]
    return tuple(tuple(units[a:b]) for a, b in zip(starts, ends, strict=True))


_UNITS_HINT: Final = (
    "Units are the model's top-level children, with ModuleList / ModuleDict / "
    "Sequential children counted item by item ('layers.4')."
)


def stage_indices(
    schedule: str, *, pp: int, pp_rank: int, stages_per_rank: int
) -> tuple[int, ...]:
    """Return the stage indices that pipeline rank ``pp_rank`` runs, in order.

    Looped placement (``r, r + pp, ...``) for every schedule but
    ``"zbv_zero_bubble"``, whose V places ``r`` and ``2 * pp - 1 - r``.

    >>> stage_indices("1f1b", pp=4, pp_rank=2, stages_per_rank=1)
    (2,)
    """
    if schedule == "zbv_zero_bubble":
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + i * pp for i in range(stages_per_rank))
