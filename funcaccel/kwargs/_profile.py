"""``ProfileKwargs``, the options of ``torch.profiler.profile``, with its helpers.

``funcaccel.kwargs`` re-exports ``ProfileKwargs``; the rest is its plumbing:
``profiler_activity`` maps an activity name to the running torch's
``ProfilerActivity``, and the schedule options are checked against ``SCHEDULE_KEYS``
on construction.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import Final

import torch
import torch.profiler

from funcaccel._checks import check_choice
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._checks import is_int
from funcaccel.kwargs._base import KwargsHandler
from funcaccel.kwargs._base import check_flags

__all__ = [
    "PROFILER_ACTIVITIES",
    "SCHEDULE_KEYS",
    "ProfileKwargs",
    "profiler_activity",
    "supported_activities",
]

PROFILER_ACTIVITIES: Final[tuple[str, ...]] = ("cpu", "cuda", "xpu", "hpu", "mtia")
SCHEDULE_KEYS: Final[tuple[str, ...]] = (
    "wait",
    "warmup",
    "active",
    "repeat",
    "skip_first",
    "skip_first_wait",
)
_NEEDED: Final = "a mapping with 'wait', 'warmup' and 'active'"
_FLAGS: Final = (
    "record_shapes",
    "profile_memory",
    "with_stack",
    "with_flops",
    "with_modules",
)


def supported_activities() -> set[torch.profiler.ProfilerActivity]:
    """Return the profiler activities the running torch can record on this machine."""
    # torch ships this function without annotations; bind it to a typed name.
    supported: Callable[[], set[torch.profiler.ProfilerActivity]] = (
        torch.profiler.supported_activities
    )
    return supported()


def profiler_activity(name: str) -> torch.profiler.ProfilerActivity:
    """Map an activity name to the running torch's ``ProfilerActivity``.

    Raises:
        ValueError: the running torch cannot profile that activity.
    """
    member = getattr(torch.profiler.ProfilerActivity, name.upper(), None)
    supported = supported_activities()
    if member not in supported:  # None, or a member this machine lacks
        have = ", ".join(sorted(repr(a.name.lower()) for a in supported))
        msg = f"ProfileKwargs: activity {name!r} cannot be profiled by this torch build on this machine; supported here: {have}."
        raise ValueError(msg)
    assert isinstance(member, torch.profiler.ProfilerActivity)
    return member


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ProfileKwargs(KwargsHandler):
    """Options for ``torch.profiler.profile`` and its schedule.

    ``activities`` is a sequence of ``"cpu"``, ``"cuda"``, ``"xpu"``, ``"hpu"``,
    ``"mtia"`` (stored as a tuple); ``schedule_option`` holds the keyword arguments
    of ``torch.profiler.schedule`` (stored as a copy); ``output_trace_dir`` is where
    ``build_profiler`` writes one Chrome trace per rank.

    >>> ProfileKwargs(activities=["cpu"], record_shapes=True).to_kwargs()
    {'activities': ('cpu',), 'record_shapes': True}
    """

    activities: Sequence[str] | None = None
    schedule_option: Mapping[str, int] | None = None
    on_trace_ready: Callable[[torch.profiler.profile], Any] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        owner = "ProfileKwargs"
        if self.activities is not None:
            if isinstance(self.activities, str) or not isinstance(
                self.activities, Sequence
            ):
                what = "a sequence of names such as ['cpu']"
                fail_type(owner, "activities", self.activities, what)
            for activity in self.activities:
                check_choice(owner, "every activity", activity, PROFILER_ACTIVITIES)
            object.__setattr__(self, "activities", tuple(self.activities))
        if self.schedule_option is not None:
            object.__setattr__(
                self, "schedule_option", _checked_schedule(owner, self.schedule_option)
            )
        if self.on_trace_ready is not None and not callable(self.on_trace_ready):
            fail_type(owner, "on_trace_ready", self.on_trace_ready, "callable")
        check_flags(owner, self, _FLAGS)
        what = "a path (str or os.PathLike)"
        check_type(
            owner,
            "output_trace_dir",
            self.output_trace_dir,
            (str, os.PathLike),
            what=what,
            optional=True,
        )

    def build(self) -> torch.profiler.profile:
        """Return an unstarted ``torch.profiler.profile`` configured by this record.

        Raises:
            ValueError: an activity the running torch cannot profile.
        """
        activities = (
            None
            if self.activities is None
            else [profiler_activity(a) for a in self.activities]
        )
        schedule = (
            None
            if self.schedule_option is None
            else torch.profiler.schedule(**self.schedule_option)
        )
        return torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self.on_trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            with_flops=self.with_flops,
            with_modules=self.with_modules,
        )


def _checked_schedule(owner: str, option: Mapping[str, int]) -> dict[str, int]:
    check_type(owner, "schedule_option", option, Mapping, what="a mapping")
    for key in option:
        check_choice(owner, "every key of schedule_option", key, SCHEDULE_KEYS)
    missing = [k for k in ("wait", "warmup", "active") if k not in option]
    if missing:
        fail_value(owner, "schedule_option", option, _NEEDED, f"Add {missing}.")
    for key, value in option.items():
        if not is_int(value) or value < 0:
            fail_value(owner, f"schedule_option[{key!r}]", value, "an int >= 0")
    if option["active"] < 1:
        fail_value(owner, "schedule_option['active']", option["active"], ">= 1")
    return dict(option)
