"""Where a loop stands in its accumulation window, and the pure rules that move it.

``GradState`` is the step state ``accumulate_step`` threads through the loop; the
functions here only read it or return a new one, and touch no model, optimizer or
process group: ``should_sync`` (does the next micro-step close the window?),
``should_skip_grad_sync`` (does it run in the no-sync context?),
``window_grad_factor`` (the ``k / m`` correction of a short last window) and
``advance_grad_state`` (the state after it). ``funcaccel.accumulate`` re-exports
them next to ``sync_ctx`` and ``accumulate_step``, which do the work.

>>> grad = GradState(accumulation_steps=2)
>>> should_sync(grad), should_sync(grad, end_of_dataloader=True)
(False, True)
>>> advance_grad_state(grad).micro_step
1
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from typing import Final

from funcaccel._checks import a_or_an
from funcaccel._checks import check_bool
from funcaccel._checks import summary
from funcaccel.context import DistributedContext

__all__ = [
    "GradState",
    "advance_grad_state",
    "should_skip_grad_sync",
    "should_sync",
    "window_grad_factor",
]


_new_object: Final = object.__new__
_set_field: Final = object.__setattr__


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GradState:
    """Where the loop stands in its accumulation window; the defaults start a run.

    Args:
        accumulation_steps: ``k``, micro-batches per optimizer step (>= 1).
        micro_step: micro-batches already in the open window, ``0 <= micro_step < k``.
        sync_gradients: whether the last micro-step synced (and stepped); true
            exactly when ``micro_step == 0``.
        end_of_dataloader: the ``end_of_dataloader`` flag of the last micro-step.
        step_was_skipped: the last micro-step's optimizer step was skipped by the
            fp16 scaler (only possible when it synced).
        optimizer_steps: optimizer updates actually applied (>= 0).
        sync_with_dataloader: close the window at the end of the data.
        sync_each_batch: all-reduce on every micro-step (saves memory, costs
            communication); the optimizer still steps every ``k`` micro-steps.

    Raises:
        TypeError: a field of the wrong type.
        ValueError: a field out of range, or fields that no run can reach together.

    >>> GradState(accumulation_steps=4, micro_step=4)
    Traceback (most recent call last):
    ...
    ValueError: GradState: micro_step (4) must be in [0, accumulation_steps=4); ...
    """

    accumulation_steps: int = 1
    micro_step: int = 0
    sync_gradients: bool = True
    end_of_dataloader: bool = False
    step_was_skipped: bool = False
    optimizer_steps: int = 0
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False

    def __post_init__(self) -> None:
        # A state is built on every micro-step: one expression on the hot path; the
        # checks that name the culprit run only when it fails.
        micro_step = self.micro_step
        if not (
            type(self.accumulation_steps) is int
            and type(micro_step) is int
            and type(self.optimizer_steps) is int
            and type(self.sync_gradients) is bool
            and type(self.end_of_dataloader) is bool
            and type(self.step_was_skipped) is bool
            and type(self.sync_with_dataloader) is bool
            and type(self.sync_each_batch) is bool
            and 0 <= micro_step < self.accumulation_steps
            and self.optimizer_steps >= 0
            and self.sync_gradients is (micro_step == 0)
            and (self.sync_gradients or not self.step_was_skipped)
            and (
                self.sync_gradients
                or not (self.end_of_dataloader and self.sync_with_dataloader)
            )
        ):
            _raise_invalid(self)

    def to_dict(self) -> dict[str, int | bool]:
        """Return the fields as a new plain, JSON-serialisable dict.

        >>> GradState(accumulation_steps=2).to_dict()["accumulation_steps"]
        2
        """
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> GradState:
        """Rebuild a state from ``to_dict()``'s output (validated as on construction).

        Raises:
            TypeError: ``data`` is not a mapping, or a value has the wrong type.
            ValueError: a key is missing or unknown, or a value is out of range.

        >>> s = GradState(accumulation_steps=3, micro_step=1, sync_gradients=False)
        >>> GradState.from_dict(s.to_dict()) == s
        True
        """
        if not isinstance(data, Mapping):
            msg = f"GradState.from_dict: data must be a mapping; got {type(data).__name__}."
            raise TypeError(msg)
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - set(data))
        unknown = sorted(str(key) for key in set(data) - names)
        if missing or unknown:
            msg = (
                f"GradState.from_dict: keys must be exactly those of "
                f"GradState.to_dict(); missing {missing}, unknown {unknown}."
            )
            raise ValueError(msg)
        fields: dict[str, Any] = dict(data)
        return cls(**fields)


def _raise_invalid(state: GradState) -> None:
    for field in dataclasses.fields(state):
        value, kind = getattr(state, field.name), field.type  # "int" or "bool"
        if type(value).__name__ != kind:
            msg = f"GradState: {field.name} must be {a_or_an(str(kind))}; got {summary(value)} ({type(value).__name__})."
            raise TypeError(msg)
    k, j, synced = state.accumulation_steps, state.micro_step, state.sync_gradients
    problems = [
        (k < 1, f"accumulation_steps must be >= 1; got {k}."),
        (
            not 0 <= j < k,
            f"micro_step ({j}) must be in [0, accumulation_steps={k}); a window "
            f"closes when it reaches {k}.",
        ),
        (
            state.optimizer_steps < 0,
            f"optimizer_steps must be >= 0; got {state.optimizer_steps}.",
        ),
        (
            synced != (j == 0),
            f"sync_gradients ({synced}) must be true exactly when micro_step == 0; "
            f"got micro_step={j}. Pass sync_gradients={j == 0}.",
        ),
        (
            state.step_was_skipped and not synced,
            "step_was_skipped=True needs sync_gradients=True (only a syncing "
            "micro-step steps); got sync_gradients=False.",
        ),
        (
            state.end_of_dataloader and state.sync_with_dataloader and not synced,
            "end_of_dataloader=True with sync_with_dataloader=True closes the "
            "window, so sync_gradients must be True; got False.",
        ),
    ]
    # __post_init__'s expression failed, so one of these holds.
    msg = next(problem for bad, problem in problems if bad)
    raise ValueError(f"GradState: {msg}")


def check_grad_state(grad: object, caller: str) -> None:
    """Raise ``TypeError`` naming ``caller`` unless ``grad`` is a ``GradState``."""
    if not isinstance(grad, GradState):
        msg = (
            f"{caller}: grad must be a GradState; got {summary(grad)} ({type(grad).__name__}). "
            "Start with GradState(accumulation_steps=k)."
        )
        raise TypeError(msg)


def should_sync(grad: GradState, *, end_of_dataloader: bool = False) -> bool:
    """Return whether the next micro-step closes the window (syncs and steps).

    It does when it is the ``k``-th of the window, or when ``end_of_dataloader``
    and ``grad.sync_with_dataloader``.

    >>> grad = GradState(accumulation_steps=4, micro_step=3, sync_gradients=False)
    >>> should_sync(grad)
    True
    >>> should_sync(GradState(accumulation_steps=4), end_of_dataloader=True)
    True
    >>> should_sync(GradState(accumulation_steps=4, sync_with_dataloader=False), end_of_dataloader=True)
    False
    """
    check_grad_state(grad, "should_sync")
    check_bool("should_sync", "end_of_dataloader", end_of_dataloader)
    if grad.micro_step + 1 == grad.accumulation_steps:
        return True
    return grad.sync_with_dataloader and end_of_dataloader


def should_skip_grad_sync(
    ctx: DistributedContext, grad: GradState, *, end_of_dataloader: bool = False
) -> bool:
    """Return whether the next micro-step runs inside the models' no-sync context.

    True when it does not close the window, there are several processes and
    ``grad.sync_each_batch`` is off. One process never skips anything.

    >>> from funcaccel.context import DistributedType
    >>> ctx = DistributedContext(
    ...     num_processes=2, process_index=1, distributed_type=DistributedType.MULTI_CPU
    ... )
    >>> should_skip_grad_sync(ctx, GradState(accumulation_steps=2))
    True
    >>> should_skip_grad_sync(DistributedContext(), GradState(accumulation_steps=2))
    False
    """
    if ctx.num_processes == 1 or grad.sync_each_batch:
        return False
    return not should_sync(grad, end_of_dataloader=end_of_dataloader)


def window_grad_factor(grad: GradState, *, end_of_dataloader: bool = False) -> float:
    """Return the factor the next micro-step's gradients need before the step.

    Backward runs on ``loss / k``; a syncing micro-step that closes a window of
    ``m < k`` micro-batches multiplies by ``k / m`` so that the step sees the mean
    over the ``m`` micro-batches. Otherwise the factor is 1.

    >>> window_grad_factor(GradState(accumulation_steps=2), end_of_dataloader=True)
    2.0
    >>> window_grad_factor(GradState(accumulation_steps=4, micro_step=2, sync_gradients=False), end_of_dataloader=True)
    1.3333333333333333
    """
    if not should_sync(grad, end_of_dataloader=end_of_dataloader):
        return 1.0
    return grad.accumulation_steps / (grad.micro_step + 1)


def advance_grad_state(
    grad: GradState, *, end_of_dataloader: bool = False, step_was_skipped: bool = False
) -> GradState:
    """Return the state after one micro-step; ``grad`` is left unchanged.

    Args:
        grad: the state before the micro-step.
        end_of_dataloader: whether this micro-batch was the last of the data.
        step_was_skipped: whether the scaler skipped this micro-step's optimizer
            step (only possible when it syncs).

    Raises:
        ValueError: ``step_was_skipped`` on a micro-step that does not sync.

    >>> grad = GradState(accumulation_steps=2, micro_step=1, sync_gradients=False)
    >>> after = advance_grad_state(grad)
    >>> after.micro_step, after.sync_gradients, after.optimizer_steps
    (0, True, 1)
    >>> advance_grad_state(after, end_of_dataloader=True, step_was_skipped=True).optimizer_steps
    1
    """
    check_bool("advance_grad_state", "step_was_skipped", step_was_skipped)
    synced = should_sync(grad, end_of_dataloader=end_of_dataloader)
    if step_was_skipped and not synced:
        msg = (
            "advance_grad_state: step_was_skipped=True but this micro-step does not "
            f"sync (micro_step={grad.micro_step}, accumulation_steps="
            f"{grad.accumulation_steps}); only a syncing micro-step can skip."
        )
        raise ValueError(msg)
    return next_grad_state(grad, synced, end_of_dataloader, step_was_skipped)


def next_grad_state(grad: GradState, synced: bool, end: bool, skipped: bool) -> GradState:
    """Return the state after one micro-step of a valid ``grad`` (no checks)."""
    # Runs on every micro-step. The fields follow from a valid ``grad`` (micro_step
    # is 0 exactly when synced, a skip only when synced), so the state is built as
    # the frozen dataclass's own __init__ builds it, minus the keyword parsing and
    # __post_init__'s checks; a property test pins it to the validating
    # constructor.
    state = _new_object(GradState)
    _set_field(state, "accumulation_steps", grad.accumulation_steps)
    _set_field(state, "micro_step", 0 if synced else grad.micro_step + 1)
    _set_field(state, "sync_gradients", synced)
    _set_field(state, "end_of_dataloader", end)
    _set_field(state, "step_was_skipped", skipped)
    _set_field(
        state, "optimizer_steps", grad.optimizer_steps + (synced and not skipped)
    )
    _set_field(state, "sync_with_dataloader", grad.sync_with_dataloader)
    _set_field(state, "sync_each_batch", grad.sync_each_batch)
    return state
