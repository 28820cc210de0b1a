"""The check every function taking a ``ctx`` makes first, shared by all packages.

Private to funcaccel: it sits outside ``funcaccel.context`` so that the packages
above it can import it without making it part of the context's public API.

>>> check_context("f", DistributedContext()).num_processes
1
"""

from __future__ import annotations

from funcaccel._checks import check_type
from funcaccel.context import DistributedContext

__all__ = ["check_context"]


def check_context(caller: str, ctx: object) -> DistributedContext:
    """Return ``ctx``, or raise ``TypeError`` naming ``caller`` if it is not a context.

    >>> check_context("f", None)
    Traceback (most recent call last):
    TypeError: f: ctx must be a DistributedContext; got None (NoneType). Build one with build_context().
    """
    hint = "Build one with build_context()."
    return check_type(caller, "ctx", ctx, DistributedContext, hint=hint)
