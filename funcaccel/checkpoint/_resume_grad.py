"""The ``GradState`` a resumed run continues with, for the accumulation it uses now.

A checkpoint saves the ``GradState`` with its ``accumulation_steps``. A run resumed
with another accumulation (another world size with the global batch kept: nanoGPT
divides its accumulation by the world size) tells ``load_checkpoint`` so with
``accumulation_steps=``, and the rule is:

- the same value, or none given: the saved state, unchanged;
- another value at a window boundary (``micro_step == 0``, which is where
  ``save_checkpoint`` saves): the saved state with the new ``accumulation_steps``;
  its counters (``optimizer_steps``) go on, and the first window after the resume
  starts at the resume point and holds ``accumulation_steps`` micro-batches;
- another value inside an open window: refused, since the micro-batches already
  taken cannot be re-counted against another window length.

>>> saved = GradState(accumulation_steps=4, optimizer_steps=6)
>>> resume_grad(saved, 8, root=Path("ckpt"), caller="f").accumulation_steps
8
>>> resume_grad(saved, None, root=Path("ckpt"), caller="f") == saved
True
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Final

from funcaccel.grad_state import GradState

__all__ = ["resume_grad"]

# caller, root, the saved state, the value passed
_MSG_OPEN: Final = (
    "{0}: {1} holds a GradState inside an accumulation window (micro_step="
    "{2.micro_step} of accumulation_steps={2.accumulation_steps}), so "
    "accumulation_steps={3} cannot take over: the window's micro-batches were "
    "counted against {2.accumulation_steps}. Pass accumulation_steps="
    "{2.accumulation_steps}, or resume from a checkpoint saved at a window boundary "
    "(save_checkpoint saves only there)."
)


def resume_grad(
    saved: GradState | None, accumulation_steps: int | None, *, root: Path, caller: str
) -> GradState | None:
    """Return the ``GradState`` to resume with (see the module's rule); ``None`` if none.

    ``accumulation_steps`` is the run's own (checked by the caller), or ``None``
    to keep the saved one.

    Raises:
        ValueError: another ``accumulation_steps`` inside an open window.
    """
    if saved is None or accumulation_steps in (None, saved.accumulation_steps):
        return saved
    if saved.micro_step != 0:
        raise ValueError(_MSG_OPEN.format(caller, root, saved, accumulation_steps))
    return dataclasses.replace(saved, accumulation_steps=accumulation_steps)
