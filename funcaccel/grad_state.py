"""Where a loop stands in its accumulation window, and the pure rules that move it.

``GradState`` is the step state ``accumulate_step`` threads through the loop; the
functions here only read it or return a new one, and touch no model, optimizer or
process group: ``should_sync`` (does the next micro-step close the window?),
``should_skip_grad_sync`` (does it run in the no-sync context?),
``window_grad_factor`` (the ``k / m`` correction of a short last window),
``advance_grad_state`` (the state after it) and ``check_num_items`` (the item count
of a token-weighted micro-batch as an ``int``). ``funcaccel.accumulate`` re-exports
them next to ``sync_ctx`` and ``accumulate_step``, which do the work. The two rules
themselves are stated once, without argument checks, in ``is_window_end`` and
``is_sync_skipped``, which the stepping code asks on every micro-step.

>>> grad = GradState(accumulation_steps=2)
>>> should_sync(grad), should_sync(grad, end_of_dataloader=True)
(False, True)
>>> advance_grad_state(grad).micro_step
1
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any
from typing import Final

import torch

from funcaccel._checks import a_or_an
from funcaccel._checks import check_bool
from funcaccel._checks import check_type
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel.context import DistributedContext

__all__ = [
    "GradState",
    "advance_grad_state",
    "check_num_items",
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
        step_was_skipped: the last micro-step closed its window but applied no
            update: the fp16 scaler found inf/NaN gradients, or a token-weighted
            window held no items on any rank (only possible when it synced).
        optimizer_steps: optimizer updates actually applied (>= 0).
        sync_with_dataloader: close the window at the end of the data.
        sync_each_batch: all-reduce on every micro-step (saves memory, costs
            communication); the optimizer still steps every ``k`` micro-steps.
        window_items: the items this rank has put into the open window so far
            when it is token-weighted (``accumulate_step(..., num_items=n)``);
            ``None`` when no window is open or it averages mean losses. Only an
            open window (``micro_step > 0``) has a count.
        grad_norm: the total gradient norm the last micro-step's step measured
            before clipping (``accumulate_step(..., max_grad_norm=...)``), the
            0-dim tensor ``torch.nn.utils.clip_grad_norm_`` returns (the global
            norm under DDP, FSDP2, a mesh or DeepSpeed, the same on every rank);
            ``None`` when that micro-step did not close its window or did not
            clip. An observation of one step, not loop state: left out of
            ``to_dict()``, equality and hashing.

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
    window_items: int | None = None
    grad_norm: torch.Tensor | None = dataclasses.field(default=None, compare=False)

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
            and (
                self.window_items is None
                or (
                    type(self.window_items) is int
                    and self.window_items >= 0
                    and micro_step > 0
                )
            )
            and (
                self.grad_norm is None
                or (
                    isinstance(self.grad_norm, torch.Tensor)
                    and self.grad_norm.dim() == 0
                    and micro_step == 0
                )
            )
        ):
            _raise_invalid(self)

    def to_dict(self) -> dict[str, int | bool | None]:
        """Return the fields as a new plain, JSON-serialisable dict.

        ``grad_norm`` (a tensor observed at one step) is left out: a resumed loop
        does not need it, and the saved format stays the one older releases wrote.

        >>> GradState(accumulation_steps=2).to_dict()["accumulation_steps"]
        2
        """
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "grad_norm"
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> GradState:
        """Rebuild a state from ``to_dict()``'s output (validated as on construction).

        A dict without ``window_items`` (written before that field existed, always
        at a window boundary) reads as ``window_items=None``.

        Raises:
            TypeError: ``data`` is not a mapping, or a value has the wrong type.
            ValueError: a key is missing or unknown, or a value is out of range.

        >>> s = GradState(accumulation_steps=3, micro_step=1, sync_gradients=False)
        >>> GradState.from_dict(s.to_dict()) == s
        True
        """
        check_type("GradState.from_dict", "data", data, Mapping, what="a mapping")
        names = {f.name for f in dataclasses.fields(cls)} - {"grad_norm"}
        missing = sorted(names - set(data) - {"window_items"})
        unknown = sorted(str(key) for key in set(data) - names)
        if missing or unknown:
            msg = (
                f"GradState.from_dict: keys must be exactly those of "
                f"GradState.to_dict(); missing {missing}, unknown {unknown}."
            )
            raise ValueError(msg)
        fields: dict[str, Any] = {"window_items": None, **data}
        return cls(**fields)


def _raise_invalid(state: GradState) -> None:
    for field in dataclasses.fields(state):
        value, kind = getattr(state, field.name), str(field.type)
        if kind == "int | None" and value is None:
            continue
        if field.name == "grad_norm":
            if value is not None and not isinstance(value, torch.Tensor):
                fail_type("GradState", "grad_norm", value, "a 0-dim tensor or None")
            continue
        if type(value).__name__ != kind.removesuffix(" | None"):
            wanted = a_or_an(kind.replace(" | ", " or "))
            fail_type("GradState", field.name, value, wanted)
    k, j, synced = state.accumulation_steps, state.micro_step, state.sync_gradients
    norm = state.grad_norm
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
        (
            state.window_items is not None and state.window_items < 0,
            f"window_items must be >= 0 or None; got {state.window_items}.",
        ),
        (
            state.window_items is not None and j == 0,
            f"window_items ({state.window_items}) counts the items of an open "
            "window, so micro_step must be > 0; got micro_step=0. Pass "
            "window_items=None.",
        ),
        (
            norm is not None and norm.dim() != 0,
            "grad_norm must be a 0-dim tensor (the total norm) or None; got a "
            f"tensor of shape {tuple(norm.shape) if norm is not None else ()}.",
        ),
        (
            norm is not None and j != 0,
            "grad_norm is measured by the micro-step that closes a window, so "
            f"micro_step must be 0; got micro_step={j}. Pass grad_norm=None.",
        ),
    ]
    # __post_init__'s expression failed, so one of these holds.
    msg = next(problem for bad, problem in problems if bad)
    raise ValueError(f"GradState: {msg}")


def check_grad_state(caller: str, grad: object) -> None:
    """Raise ``TypeError`` naming ``caller`` unless ``grad`` is a ``GradState``."""
    hint = "Start with GradState(accumulation_steps=k)."
    check_type(caller, "grad", grad, GradState, hint=hint)


def check_num_items(caller: str, num_items: object) -> int:
    """Return a micro-batch's item count (``num_items=``) as a Python ``int``.

    Takes an ``int`` (or another integral number that is not a bool) or a 0-dim
    integer tensor, ``>= 0``. A tensor is read with ``.item()``, which on a GPU
    waits for the device: count on the host (in the collate function, say) when
    you can.

    Raises:
        TypeError: a bool, a float, or a tensor that is not of an integer dtype.
        ValueError: a negative count, or a tensor with one or more dimensions.

    >>> check_num_items("f", torch.tensor(7)), check_num_items("f", 0)
    (7, 0)
    >>> check_num_items("f", -1)
    Traceback (most recent call last):
    ...
    ValueError: f: num_items must be >= 0 (how many items the micro-batch's summed loss covers on this rank); got -1.
    """
    what = "an int or a 0-dim integer tensor"
    if isinstance(num_items, torch.Tensor):
        if num_items.dim() != 0:
            hint = "Sum it to one count first, e.g. (labels != -100).sum()."
            fail_value(caller, "num_items", num_items, what, hint)
        inexact = num_items.is_floating_point() or num_items.is_complex()
        if inexact or num_items.dtype == torch.bool:
            hint = "Count items with an integer dtype, e.g. (labels != -100).sum()."
            fail_type(caller, "num_items", num_items, what, hint)
        count = int(num_items.item())
    elif isinstance(num_items, numbers.Integral) and not isinstance(num_items, bool):
        count = int(num_items)
    else:
        what += " (the number of items the micro-batch's summed loss covers)"
        fail_type(caller, "num_items", num_items, what)
    if count < 0:
        what = ">= 0 (how many items the micro-batch's summed loss covers on this rank)"
        fail_value(caller, "num_items", count, what)
    return count


def check_window_kind(caller: str, grad: GradState, token_weighted: bool) -> None:
    """Raise ``ValueError`` when a micro-step's kind differs from its open window's.

    A window is token-weighted (``num_items=`` on every micro-step) or averages
    mean losses (no ``num_items``) throughout; the first micro-step decides.
    """
    if grad.micro_step == 0 or token_weighted is (grad.window_items is not None):
        return
    if token_weighted:
        msg = (
            f"{caller}: num_items was given, but the open accumulation window "
            f"(micro_step={grad.micro_step}) was started with mean losses, without "
            "num_items; a window is token-weighted or mean-loss throughout: pass "
            "num_items= from the first micro-step of a window on."
        )
    else:
        msg = (
            f"{caller}: num_items=None, but the open accumulation window is "
            f"token-weighted (window_items={grad.window_items} after "
            f"{grad.micro_step} micro-steps); pass num_items= on every micro-step of "
            "the window (0 for a micro-batch without items)."
        )
    raise ValueError(msg)


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
    check_grad_state("should_sync", grad)
    check_bool("should_sync", "end_of_dataloader", end_of_dataloader)
    return is_window_end(grad, end_of_dataloader)


def is_window_end(grad: GradState, end_of_dataloader: bool) -> bool:
    """Return whether the next micro-step closes the window, for checked arguments.

    The one statement of the rule: ``should_sync`` checks its arguments and asks
    this; ``accumulate_step``, ``sync_ctx`` and the DeepSpeed step ask it directly
    once their arguments are checked (it runs on every micro-step).

    >>> is_window_end(GradState(accumulation_steps=2), True)
    True
    """
    return grad.micro_step + 1 == grad.accumulation_steps or (
        grad.sync_with_dataloader and end_of_dataloader
    )


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
    synced = should_sync(grad, end_of_dataloader=end_of_dataloader)
    return is_sync_skipped(ctx, grad, synced)


def is_sync_skipped(ctx: DistributedContext, grad: GradState, synced: bool) -> bool:
    """Return whether a micro-step runs in the no-sync context, for checked arguments.

    ``synced`` is ``is_window_end``'s answer for the micro-step. The one statement
    of the rule that ``should_skip_grad_sync`` checks its arguments for.

    >>> is_sync_skipped(DistributedContext(), GradState(accumulation_steps=2), False)
    False
    """
    return not synced and ctx.num_processes > 1 and not grad.sync_each_batch


def closing_factor(grad: GradState) -> float:
    """Return ``k / m`` for a micro-step that closes a window, for a checked state.

    Backward runs on ``loss / k``; the window holds ``m = grad.micro_step + 1``
    micro-batches, so ``k / m`` turns the sum into the mean over ``m`` (1 for a
    full window, more for a short last one). The one statement of the factor:
    ``window_grad_factor`` and the stepping code ask it.

    >>> closing_factor(GradState(accumulation_steps=4, micro_step=1, sync_gradients=False))
    2.0
    """
    return grad.accumulation_steps / (grad.micro_step + 1)


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
    return closing_factor(grad)


def advance_grad_state(
    grad: GradState,
    *,
    end_of_dataloader: bool = False,
    step_was_skipped: bool = False,
    num_items: int | torch.Tensor | None = None,
) -> GradState:
    """Return the state after one micro-step; ``grad`` is left unchanged.

    Args:
        grad: the state before the micro-step.
        end_of_dataloader: whether this micro-batch was the last of the data.
        step_was_skipped: whether this micro-step's optimizer step applied no
            update (only possible when it syncs).
        num_items: the micro-batch's item count in a token-weighted window; the
            new state's ``window_items`` adds it up while the window stays open.

    Raises:
        TypeError: a ``num_items`` that is not an integer count.
        ValueError: ``step_was_skipped`` on a micro-step that does not sync; a
            negative ``num_items``; ``num_items`` given in a mean-loss window or
            missing in a token-weighted one.

    >>> grad = GradState(accumulation_steps=2, micro_step=1, sync_gradients=False)
    >>> after = advance_grad_state(grad)
    >>> after.micro_step, after.sync_gradients, after.optimizer_steps
    (0, True, 1)
    >>> advance_grad_state(after, end_of_dataloader=True, step_was_skipped=True).optimizer_steps
    1
    >>> advance_grad_state(GradState(accumulation_steps=2), num_items=5).window_items
    5
    """
    check_bool("advance_grad_state", "step_was_skipped", step_was_skipped)
    check_window_kind("advance_grad_state", grad, num_items is not None)
    synced = should_sync(grad, end_of_dataloader=end_of_dataloader)
    if step_was_skipped and not synced:
        what = (
            "False when the micro-step does not sync (micro_step="
            f"{grad.micro_step}, accumulation_steps={grad.accumulation_steps})"
        )
        hint = "Only a syncing micro-step can skip."
        fail_value("advance_grad_state", "step_was_skipped", True, what, hint)
    items = None
    if num_items is not None:
        items = check_num_items("advance_grad_state", num_items)
        items = None if synced else (grad.window_items or 0) + items
    return next_grad_state(grad, synced, end_of_dataloader, step_was_skipped, items)


def next_grad_state(
    grad: GradState,
    synced: bool,
    end: bool,
    skipped: bool,
    window_items: int | None = None,
    grad_norm: torch.Tensor | None = None,
) -> GradState:
    """Return the state after one micro-step of a valid ``grad`` (no checks).

    ``window_items`` is the new state's count: ``None`` when ``synced``;
    ``grad_norm`` the norm the step measured, only when ``synced``.
    """
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
    _set_field(state, "window_items", window_items)
    _set_field(state, "grad_norm", grad_norm)
    return state
