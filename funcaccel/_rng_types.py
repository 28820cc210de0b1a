"""The check of an ``rng_types`` argument, shared by ``shard_loader`` and the RNG sync.

Private to funcaccel: the loader checks its ``rng_types`` when it is built, the
RNG sync each time it runs, with the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from funcaccel._checks import check_choice
from funcaccel._checks import fail_type
from funcaccel._checks import fail_value
from funcaccel._typing import RNG_TYPES
from funcaccel._typing import RngType
from funcaccel.context import DistributedContext

__all__ = ["check_rng_types"]

_FIX: Final = "Remove it (seed other generators yourself, e.g. in worker_init_fn)."
_FIX_CUDA: Final = "Remove 'cuda' on a CPU run."


def check_rng_types(
    caller: str, rng_types: object, ctx: DistributedContext
) -> tuple[RngType, ...]:
    """Return ``rng_types`` as a tuple of names after checking each one.

    Raises:
        TypeError: ``rng_types`` is not a sequence of names (a string is not).
        ValueError: a name other than ``"torch"``, ``"cuda"`` or ``"generator"``,
            or ``"cuda"`` on a context whose device is not a GPU.

    >>> check_rng_types("f", ["torch"], DistributedContext())
    ('torch',)
    """
    if isinstance(rng_types, (str, bytes)) or not isinstance(rng_types, Sequence):
        what = "a list of names such as ['torch']"
        fail_type(caller, "rng_types", rng_types, what)
    names: list[RngType] = []
    what = f"free of 'cuda' when ctx.device is {ctx.device}"
    for item in rng_types:
        name = check_choice(
            caller, "each name in rng_types", item, RNG_TYPES, hint=_FIX
        )
        if name == "cuda" and ctx.device.type != "cuda":
            fail_value(caller, "rng_types", list(rng_types), what, _FIX_CUDA)
        names.append(name)
    return tuple(names)
