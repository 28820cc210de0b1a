"""Start and end the default process group so that every rank exits cleanly.

Two behaviours of torch 2.13 make a run that finished its work fail anyway; both
are handled here, where funcaccel starts and ends groups.

1. ``init_process_group`` on gloo is not a barrier: a rank returns once its own
   side of the full mesh of connections is up. A rank with little to do (a short
   test, a rank with no data) can then end the group and exit while a peer is
   still connecting to it, and the peer's ``init_process_group`` fails with
   ``Gloo connectFullMesh failed ... Connection closed by peer``.
   ``start_process_group`` ends with a barrier on gloo, so no rank leaves before
   every rank has joined.
2. ``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as a default
   argument of ten functions when it is first imported. Imported after the
   default group exists (constructing ``DistributedDataParallel`` imports it,
   through ``torch._dynamo``), those defaults hold that group for the life of the
   interpreter: ``destroy_process_group`` then leaves it and its gloo threads
   alive until interpreter finalization: the group's destructor then runs
   inside ``Py_FinalizeEx`` (the garbage collection
   of module dictionaries frees those functions' defaults), and torch releases
   the GIL around it. Any other thread that takes the GIL in that window is
   ended by the interpreter (``pthread_exit``); one whose stack holds a C++
   destructor then calls ``std::terminate``, and the process aborts after its
   work is done with ``terminate called without an active exception``.
   ``start_process_group`` imports that module before the group exists (so its
   defaults stay ``None``: the default group at call time), and
   ``end_process_group`` resets defaults that still hold the group it destroys
   (a group started outside funcaccel), so the group and its threads end in
   ``destroy_process_group``, while Python is fully alive.
"""

from __future__ import annotations

import gc
import sys
import types
from datetime import timedelta
from typing import Final

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["end_process_group", "start_process_group"]

_NN_FUNCTIONAL: Final = "torch.distributed.nn.functional"


def start_process_group(
    backend: str,
    *,
    init_method: str | None,
    world_size: int,
    rank: int,
    timeout: timedelta | None = None,
) -> None:
    """Start the default group and return once every rank has joined it.

    ``torch.distributed.init_process_group`` with these arguments, after importing
    ``torch.distributed.nn.functional`` (see the module's docstring), then, on
    gloo, a barrier.
    """
    __import__(_NN_FUNCTIONAL)
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=timeout,
    )
    if dist.get_backend() == "gloo":
        dist.barrier()


def end_process_group() -> None:
    """Destroy the default group (if any) so that its threads end now.

    Unreachable objects are collected first: a DDP module sits in a reference
    cycle and holds the group too. Defaults of ``torch.distributed.nn.functional``
    that still hold the group are reset to ``None`` (the default group at call
    time, what they mean) so that nothing keeps it alive.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    group = c10d._get_default_group()
    dist.destroy_process_group()
    release_stale_defaults(group)
    del group


def release_stale_defaults(group: object) -> int:
    """Reset defaults of ``torch.distributed.nn.functional`` that are ``group``.

    Returns how many functions were changed (0 when the module was imported
    before the group existed, or not at all).
    """
    module = sys.modules.get(_NN_FUNCTIONAL)
    changed = 0
    for value in vars(module).values() if module is not None else ():
        defaults = getattr(value, "__defaults__", None)
        if isinstance(value, types.FunctionType) and defaults:
            if any(default is group for default in defaults):
                value.__defaults__ = tuple(
                    None if default is group else default for default in defaults
                )
                changed += 1
    return changed
