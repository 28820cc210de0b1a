"""The check of an ``rng_types`` argument, shared by ``shard_loader`` and the RNG sync.

Private to funcaccel: the loader checks its ``rng_types`` when it is built, the
RNG sync each time it runs, with the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from funcaccel._checks import fail_type
from funcaccel._checks import summary
from funcaccel._typing import RNG_TYPES
from funcaccel._typing import RngType
from funcaccel.context import DistributedContext

__all__ = ["check_rng_types"]


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
    for name in rng_types:
        if name not in RNG_TYPES:
            msg = (
                f"{caller}: rng_types may hold only 'torch', 'cuda' and 'generator'; "
                f"got {summary(name)} in {summary(list(rng_types))}. Remove it."
            )
            raise ValueError(msg)
        if name == "cuda" and ctx.device.type != "cuda":
            msg = (
                f"{caller}: rng_types has 'cuda' but ctx.device is {ctx.device}; "
                "remove 'cuda' on a CPU run."
            )
            raise ValueError(msg)
        names.append(name)
    return tuple(names)
